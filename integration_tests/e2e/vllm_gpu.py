"""What a vLLM 0.33 engine needs to run on an NVIDIA GPU without vLLM's compiled CUDA extensions
(the device image has torch 2.11; vLLM's extensions are built for torch 2.14 and cannot travel), the
GPU counterpart of ``vllm_cpu`` (shared/notes/e2e.md, steps 1-4):

* ``vllm._C_stable_libtorch`` (imported unconditionally by ``vllm/platforms/cuda.py``): a stand-in
  module; ``register_ops()`` defines under ``torch.ops._C`` what vLLM touches on the CUDA path for a
  dense Llama model, eager and with FULL_DECODE_ONLY CUDA graphs:
  - the capability queries vLLM evaluates while importing/building layers (``cutlass_*_supported``,
    ``cutlass_scaled_mm_supports_*``, ``mxfp4_experts_quant_supported``): all answer False;
  - the activation ops ``CustomOp`` subclasses look up in ``__init__`` on CUDA (``silu_and_mul``,
    ``gelu_and_mul``, ...): defined, raising if called (``custom_ops=["none"]`` runs the native path);
  - ``weak_ref_tensor`` (CUDA-graph capture keeps weak references to graph outputs): a view of the
    input (it keeps the storage alive, which a graph's output pool does anyway).
  ``get_cuda_view_from_cpu_tensor`` (UVA) is used only by Model Runner V2 and CPU weight offloading:
  not defined; ``VLLM_USE_V2_MODEL_RUNNER=0`` keeps the V1 runner.
* ``vllm.vllm_flash_attn``: its ``__init__`` raises ImportError when neither FA2 nor FA3 extension
  loads, and every model imports it on CUDA: the package is registered without running that
  ``__init__`` (its ``flash_attn_interface`` then reports FA2/FA3 unavailable).
* Environment (``ENV``, set unless already set): no FlashInfer sampler, the V1 model runner, the
  engine core in this process, max_model_len past the tiny model's positions, HF offline.
* ``engine_kwargs(mode)``: vLLM engine arguments that keep every op on its native/Triton path
  (``custom_ops=["none"]``, IR ops ``native`` first, no FlashInfer autotune, no CuTeDSL/JIT warmup),
  eager (``enforce_eager``), CUDA graphs (``mode=0`` i.e. no torch.compile,
  ``cudagraph_mode="FULL_DECODE_ONLY"``) or compiled (torch.compile, ``FULL_AND_PIECEWISE``).

Call ``prepare()`` in the process that builds the engine, before importing ``vllm.LLM``. Nothing
here needs a GPU to import or register: ``register_ops()`` and ``install_flash_attn_stub()`` run on
a CPU machine too (that is how they are checked there).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the sampler would import FlashInfer
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # V2 calls torch.ops._C.get_cuda_view_from_cpu_tensor
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in process
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",  # max_model_len 131072 past the model's positions
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

# torch.ops._C capability queries (int capability -> bool) evaluated while importing / building layers
CAPABILITY_QUERIES = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
)

# activation ops CustomOp subclasses look up unconditionally in __init__ on CUDA (name -> schema
# arguments); never called with custom_ops=["none"]
ACTIVATION_OPS = {
    "silu_and_mul": "Tensor(a!) result, Tensor input",
    "mul_and_silu": "Tensor(a!) result, Tensor input",
    "situ_and_mul": "Tensor(a!) result, Tensor input",
    "silu_and_mul_with_clamp": "Tensor(a!) result, Tensor input, float limit",
    "fatrelu_and_mul": "Tensor(a!) result, Tensor input, float threshold",
    "gelu_and_mul": "Tensor(a!) result, Tensor input",
    "gelu_tanh_and_mul": "Tensor(a!) result, Tensor input",
    "gelu_new": "Tensor(a!) result, Tensor input",
    "gelu_fast": "Tensor(a!) result, Tensor input",
    "gelu_quick": "Tensor(a!) result, Tensor input",
    "relu_squared": "Tensor(a!) result, Tensor input",
}

_LIB = None


# ops vLLM's torch.compile fusion passes name at import time (vllm/compilation/passes/fusion/*.py: the
# patterns they match and the fused ops they substitute); declared only, never called: ``engine_kwargs``
# turns those fusions off (they fuse custom ops that custom_ops=["none"] does not run anyway). The schemas
# are placeholders for that reason.
FUSION_PATTERN_OPS = (
    "rotary_embedding", "static_scaled_fp8_quant", "dynamic_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant",
    "fused_add_rms_norm", "rms_norm", "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_quant", "silu_and_mul_quant", "silu_and_mul_per_block_quant", "fused_qk_norm_rope",
)


def _not_built(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"torch.ops._C.{name}: vLLM's CUDA extension is not loaded (integration_tests/e2e/vllm_gpu.py "
            "stand-in); run with compilation_config custom_ops=['none'] so the native path is used")

    return kernel


def register_ops() -> None:
    """Define the stand-in ``torch.ops._C`` ops (once per process; a name that already exists, e.g.
    from the real extension, is left alone) and install the ``vllm._C_stable_libtorch`` module."""
    global _LIB
    import torch

    if _LIB is None:
        lib = torch.library.Library("_C", "FRAGMENT")
        for name in CAPABILITY_QUERIES:
            if not hasattr(torch.ops._C, name):
                lib.define(f"{name}(int cuda_device_capability) -> bool")
                lib.impl(name, lambda capability: False, "CompositeExplicitAutograd")
        for name, args in ACTIVATION_OPS.items():
            if not hasattr(torch.ops._C, name):
                lib.define(f"{name}({args}) -> ()")
                lib.impl(name, _not_built(name), "CompositeExplicitAutograd")
        for name in FUSION_PATTERN_OPS:
            if not hasattr(torch.ops._C, name):
                lib.define(f"{name}(Tensor(a!) out, Tensor input) -> ()")
                lib.impl(name, _not_built(name), "CompositeExplicitAutograd")
        if not hasattr(torch.ops._C, "weak_ref_tensor"):
            lib.define("weak_ref_tensor(Tensor(a) tensor) -> Tensor(a)")
            lib.impl("weak_ref_tensor", lambda t: t.view(t.shape), "CompositeExplicitAutograd")
        _LIB = lib
    name = "vllm._C_stable_libtorch"
    if name not in sys.modules:
        mod = types.ModuleType(name, "stand-in for vLLM's CUDA extension (integration_tests/e2e/vllm_gpu.py)")
        sys.modules[name] = mod
        parent = sys.modules.get("vllm")
        if parent is not None:
            setattr(parent, "_C_stable_libtorch", mod)


def install_flash_attn_stub() -> None:
    """Register the ``vllm.vllm_flash_attn`` package without running its ``__init__`` (which raises
    ImportError when no FA extension loads) and give it the names that ``__init__`` exports, from
    ``flash_attn_interface``."""
    name = "vllm.vllm_flash_attn"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"{name} is not in this vLLM tree")
    pkg = types.ModuleType(name)
    pkg.__spec__ = spec
    pkg.__path__ = list(spec.submodule_search_locations or [])
    pkg.__file__ = spec.origin
    pkg.__package__ = name
    sys.modules[name] = pkg
    try:
        iface = importlib.import_module(name + ".flash_attn_interface")
    except Exception:
        del sys.modules[name]
        raise
    exported = ("FA2_AVAILABLE", "FA3_AVAILABLE", "compile_flash_attn_varlen_func_from_specs",
                "fa_version_unsupported_reason", "flash_attn_varlen_func", "get_scheduler_metadata",
                "is_fa_version_supported")
    for attr in exported:
        if hasattr(iface, attr):
            setattr(pkg, attr, getattr(iface, attr))
    pkg.flash_attn_interface = iface
    pkg.__all__ = [a for a in exported if not a.isupper() and hasattr(iface, a)]
    setattr(sys.modules["vllm"], "vllm_flash_attn", pkg)


def prepare() -> None:
    """Environment, stand-in ops and the flash-attention package: call before ``from vllm import LLM``."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    register_ops()
    install_flash_attn_stub()
    inspect_models_in_process()


def _original_run_in_subprocess(registry):
    """vLLM's own ``registry._run_in_subprocess`` (kept on the module the first time it is replaced)."""
    if "_flydsl_original_run" not in registry.__dict__:
        registry._flydsl_original_run = registry._run_in_subprocess
    return registry._flydsl_original_run


def inspect_models_in_process() -> None:
    """vLLM inspects a model class in a fresh ``python -m vllm.model_executor.models.registry``
    process (to keep CUDA uninitialized in the parent); that process has none of the stand-ins
    above, so the import fails there. With the engine core in process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) nothing forks after CUDA starts: inspect in this process."""
    from vllm.model_executor.models import registry

    _original_run_in_subprocess(registry)
    registry._run_in_subprocess = lambda fn: fn()


SUBPROCESS_MARK = "flydsl-e2e: the model-inspection subprocess failed"


def inspect_models_in_subprocess() -> None:
    """For ``vllm serve``'s API server, whose engine core runs in another process: inspect a model class in a
    fresh process as vLLM does, so that importing the model's modules cannot initialise CUDA here (a CUDA
    context in the API server holds GPU memory the engine core needs). The process is
    ``integration_tests.e2e.vllm_registry_subprocess``: vLLM's inspection entry point with the stand-ins
    installed first. Should it fail, the inspection runs in this process after all, and stderr says so
    (``SUBPROCESS_MARK`` and the subprocess's last output)."""
    from vllm.model_executor.models import registry

    original = _original_run_in_subprocess(registry)
    registry._SUBPROCESS_COMMAND = [sys.executable, "-m", "integration_tests.e2e.vllm_registry_subprocess"]

    def run(fn):
        try:
            return original(fn)
        except RuntimeError as e:
            tail = str(e)[-800:].replace("\n", " | ")
            sys.stderr.write(f"{SUBPROCESS_MARK}, inspecting in this process: {tail}\n")
            sys.stderr.flush()
            return fn()

    registry._run_in_subprocess = run


def serve_args(mode: str = "eager") -> list:
    """``vllm serve`` options equal to ``engine_kwargs(mode)`` (eager or graphs): the same kernel and
    compilation settings as JSON."""
    import dataclasses
    import json

    if mode not in ("eager", "graphs"):
        raise ValueError(f"mode: expected 'eager' or 'graphs', got {mode!r}")
    kw = engine_kwargs(mode)
    k = kw["kernel_config"]
    kernel = {"ir_op_priority": dataclasses.asdict(k.ir_op_priority),
              "enable_flashinfer_autotune": k.enable_flashinfer_autotune,
              "enable_cutedsl_warmup": k.enable_cutedsl_warmup, "enable_jit_warmup": k.enable_jit_warmup}
    args = ["--kernel-config", json.dumps(kernel), "-cc", json.dumps(kw["compilation_config"])]
    return args + (["--enforce-eager"] if kw.get("enforce_eager") else [])


MODES = ("eager", "graphs", "compiled")


def engine_kwargs(mode: str, capture_sizes=None) -> dict:
    """``vllm.LLM`` arguments for the extension-less CUDA path: ``eager``; ``graphs``: full CUDA graphs
    for decode batches only, no torch.compile; ``compiled``: the model under torch.compile (vLLM's
    compilation mode 3, inductor) with FULL_AND_PIECEWISE graphs (full graphs for decode batches,
    piecewise ones around the attention op for the rest). ``capture_sizes`` limits the captured batch
    sizes."""
    from vllm.config.kernel import IrOpPriorityConfig, KernelConfig

    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    kernel = KernelConfig(ir_op_priority=IrOpPriorityConfig.with_default(["native"]),
                          enable_flashinfer_autotune=False, enable_cutedsl_warmup=False, enable_jit_warmup=False)
    compilation = {"custom_ops": ["none"]}
    if mode == "graphs":
        compilation.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    elif mode == "compiled":
        # no fusion passes: they rewrite vLLM's custom ops, which custom_ops=["none"] replaces by torch code
        fusions = ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "fuse_allreduce_rms",
                   "enable_qk_norm_rope_fusion", "fuse_rope_kvcache_cat_mla", "fuse_act_padding",
                   "fuse_mla_dual_rms_norm", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")
        compilation.update(mode=3, cudagraph_mode="FULL_AND_PIECEWISE", pass_config={f: False for f in fusions})
    if mode != "eager" and capture_sizes:
        compilation["cudagraph_capture_sizes"] = sorted(capture_sizes)
    return {"kernel_config": kernel, "compilation_config": compilation, "enforce_eager": mode == "eager"}
