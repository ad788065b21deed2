"""Test session setup shared by every test folder.

Without a GPU, Triton kernels run through Triton's interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before any test module loads; the interpreter
then treats NaN as a GPU does (``backend_core.interpreter``): FP8 NaN bytes read as NaN, maxNum.
Tests marked ``gpu`` are skipped, with the reason, when torch sees no GPU.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from backend_core import platform

    if platform.triton_interpreter_enabled():
        from backend_core.interpreter import faithful_interpreter

        faithful_interpreter()  # FP8 NaN bytes (the caches' poisoned pages) read as NaN, maxNum as on a GPU


# The long CPU cases (Triton's interpreter, ahead-of-time compiles, subprocesses), marked ``slow`` so the default
# run (``-m "not slow"`` in pyproject's addopts) stays a few minutes on two cores; ``-m slow`` runs them. Each grid
# keeps a fast member in the default run, so every kernel path is still checked there. Entries are node ids or, with
# a trailing ``[``, every parametrization of a test.
SLOW = {
    # ahead-of-time compiles for sm_90 / gfx942 / gfx950 (the resource gates)
    "kda_backend/tests/test_triton_resources.py::test_shipped_configs_have_no_spills",
    "kda_backend/tests/test_triton_resources.py::test_shipped_configs_compile_for_amd_without_scratch",
    "pa_backend/tests/test_triton_resources.py::test_decode_kernels_compile_for_sm90_without_spills[",
    "pa_backend/tests/test_triton_resources.py::test_kernels_compile_for_amd_gfx942_and_gfx950[",
    # long interpreter runs; the grid's other members stay in the default run
    "kda_backend/tests/test_long_horizon.py::test_drift_short_cpu[triton-bf16]",
    "kda_backend/tests/test_long_horizon.py::test_drift_short_cpu[triton-fp32]",
    "pa_backend/tests/test_long_decode.py::test_long_decode_short_cpu[triton]",
    "pa_backend/tests/test_plan.py::test_later_layers_launch_bound_with_their_own_tensors_interpreter[prefill]",
    "pa_backend/tests/test_plan.py::test_later_layers_launch_bound_with_their_own_tensors_interpreter[decode-queue]",
    "pa_backend/tests/test_plan.py::test_later_layers_launch_bound_with_their_own_tensors_interpreter"
    "[window-sinks-token]",
    "pa_backend/tests/test_plan.py::test_later_layers_launch_bound_with_their_own_tensors_interpreter"
    "[decode-one-partition-sinks]",
    "pa_backend/tests/test_plan.py::test_wide_table_is_bit_identical_to_exact[prefill-triton]",
    "pa_backend/tests/test_plan.py::test_wide_table_is_bit_identical_to_exact[prefill-torch]",
    "pa_backend/tests/test_plan.py::test_wide_table_is_bit_identical_to_exact[decode-ql3-triton]",
    "pa_backend/tests/test_plan.py::test_wide_table_is_bit_identical_to_exact[window-sinks-triton]",
    "pa_backend/tests/test_plan.py::test_plan_is_reused_across_layers[triton]",
    "pa_backend/tests/test_reference.py::test_bench_graph_rows_check_what_every_layer_replayed",
    "pa_backend/tests/test_input_safety.py::test_a_huge_num_partitions_hint_is_capped[triton]",
    "pa_backend/tests/test_triton.py::test_split_plans_of_other_gpus[16]",
    "pa_backend/tests/test_triton.py::test_split_plans_of_other_gpus[108]",
    "pa_backend/tests/test_triton.py::test_split_plans_of_other_gpus[148]",
    "pa_backend/tests/test_triton.py::test_masked_and_unmasked_tile_regions[prefill-wide-window-token]",
    "pa_backend/tests/test_triton.py::test_masked_and_unmasked_tile_regions[prefill-narrow-window]",
    "pa_backend/tests/test_triton.py::test_decode_and_prefill_any_multiple_of_16_block[4d-112]",
    "pa_backend/tests/test_triton.py::test_decode_and_prefill_any_multiple_of_16_block[5d-112]",
    "pa_backend/tests/test_triton.py::test_decode_and_prefill_any_multiple_of_16_block[4d-96]",
    "pa_backend/tests/test_triton.py::test_decode_and_prefill_any_multiple_of_16_block[5d-96]",
    "pa_backend/tests/test_triton.py::test_decode_and_prefill_any_multiple_of_16_block[4d-80]",
    "pa_backend/tests/test_triton.py::test_decode_and_prefill_any_multiple_of_16_block[5d-80]",
    "pa_backend/tests/test_layout_fuzz.py::test_attention_on_relaid_tensors[pre-D64-G4-bs64-4d-token]",
    "kda_backend/tests/test_contract.py::test_specialization_cache_bounded_and_scalar_free",
    # subprocesses importing torch once per case
    "backend_core/tests/test_launch.py::test_the_switch_is_on_with_cuda_opt_in_with_rocm_and_checked",
}


def _slow(nodeid: str) -> bool:
    return nodeid in SLOW or any(s.endswith("[") and nodeid.startswith(s) for s in SLOW)


@pytest.hookimpl(tryfirst=True)  # before the -m deselection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (none visible to torch); run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
