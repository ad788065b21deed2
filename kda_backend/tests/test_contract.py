"""docs/design.md §3 contract, one test per bullet, for the reference and (interpreted or on GPU) Triton."""

import os
import subprocess
import sys

import pytest
import torch

import kda_backend
from kda_backend import contract
from kda_backend.cases import SENTINEL, clone_caches, compare_runs, make_case
from kda_backend.reference import run_reference
from kda_backend.verify import tolerances

from .conftest import DEVICE

SMALL = dict(H=2, K=32, W=4)


def run_and_compare(params, impl, seed=0):
    case = make_case(**params, device=DEVICE, seed=seed)
    ref = clone_caches(case)
    run_reference(ref.problem(), compute_dtype=torch.float64)
    test = clone_caches(case)
    returned = test.call(impl)
    res = compare_runs(test, ref, case, **tolerances(params.get("state_dtype", torch.float32)))
    return case, test, returned, res


@pytest.mark.parametrize("layout", ["width", "channel"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(impl, layout, state_dtype):
    _, _, _, res = run_and_compare(dict(B=4, **SMALL, conv_layout=layout, state_dtype=state_dtype), impl)
    assert res["ok"], res


def test_padding_rows_zero_and_caches_bit_identical(impl):
    # negative indices, indices >= slots, and one row past the smaller (conv) cache
    params = dict(B=6, **SMALL, padding=[0, 3], out_of_range=[5])
    case = make_case(**params, device=DEVICE, seed=3)
    # shrink the conv cache to fewer slots than the state: a row indexing past it is padding too
    test = clone_caches(case)
    live_before = test.kwargs["state"].clone()
    test.call(impl)
    out = test.kwargs["out"]
    for n in (0, 3, 5):
        assert torch.equal(out[n], torch.zeros_like(out[n])), f"row {n} not zeroed"
    ref = clone_caches(case)
    run_reference(ref.problem(), compute_dtype=torch.float64)
    res = compare_runs(test, ref, case, **tolerances(torch.float32))
    assert res["ok"], res
    assert not torch.equal(live_before[case.live_slots], test.kwargs["state"][case.live_slots])  # live rows did update


def test_row_past_the_smaller_cache_is_padding(impl):
    case = make_case(B=2, **SMALL, slots=6, device=DEVICE, seed=4)
    kw = dict(case.kwargs)
    kw["conv_state"] = kw["conv_state"][:4]  # 4 conv slots, 6 state slots
    live = [s for s in case.live_slots if s < 4][0]
    kw["state_indices"] = torch.tensor([4, live], dtype=torch.int32, device=DEVICE)
    state_before = kw["state"].clone()
    conv_before = kw["conv_state"].clone()
    out = kda_backend.kda_decode(**kw, backend=impl)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(kw["state"][4], state_before[4])
    others = [s for s in range(4) if s != live]
    assert torch.equal(kw["conv_state"][others], conv_before[others])
    assert not torch.equal(kw["conv_state"][live], conv_before[live])


def test_slot_zero_is_live(impl):
    case = make_case(B=2, **SMALL, include_slot0=True, device=DEVICE, seed=5)
    assert 0 in case.live_slots
    before = case.kwargs["state"][0].clone()
    test = clone_caches(case)
    test.call(impl)
    assert not torch.equal(test.kwargs["state"][0], before)


@pytest.mark.parametrize("out_layout", ["batch", "heads"])
def test_out_filled_in_place_and_returned(impl, out_layout):
    case, test, returned, res = run_and_compare(dict(B=3, **SMALL, out_layout=out_layout), impl)
    assert returned is test.kwargs["out"]
    assert res["ok"], res
    assert not torch.isnan(returned).any()


def test_out_allocated_when_none(impl):
    case = make_case(B=3, **SMALL, device=DEVICE)
    ref = clone_caches(case)
    run_reference(ref.problem(), compute_dtype=torch.float64)
    out = kda_backend.kda_decode(**clone_caches(case).kwargs | {"out": None}, backend=impl)
    assert out.shape == (3, 2, 32) and out.dtype == torch.bfloat16
    assert (out.float() - ref.kwargs["out"].float()).abs().max() < 5e-2


@pytest.mark.parametrize("variant", [
    dict(conv=False), dict(norm=False), dict(conv=False, norm=False), dict(conv_bias=True),
    dict(with_f_b=True, R=20), dict(with_f_b=True, lower_bound=-5.0, state_dtype=torch.bfloat16),
    dict(lower_bound=-2.0), dict(page_pad=9), dict(W=2), dict(W=3, conv_layout="channel"),
    dict(index_dtype=torch.int64),
], ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_optional_stages_and_layouts(impl, variant):
    params = dict(B=3, **SMALL)
    params.update(variant)
    _, _, _, res = run_and_compare(params, impl, seed=11)
    assert res["ok"], res


def test_conv_state_untouched_when_conv_stage_off(impl):
    case = make_case(B=2, **SMALL, conv=False, device=DEVICE)
    cs = torch.full((4, 3 * 2 * 32, 3), SENTINEL, dtype=torch.bfloat16, device=DEVICE)
    kda_backend.kda_decode(**dict(case.kwargs, conv_state=cs), backend=impl)
    assert (cs == SENTINEL).all()


def test_scale_argument(impl):
    _, _, _, res = run_and_compare(dict(B=2, **SMALL), impl)
    case = make_case(B=2, **SMALL, device=DEVICE, seed=1)
    a, b = clone_caches(case), clone_caches(case)
    a.call(impl, scale=0.05)
    b.call(impl)
    assert not torch.equal(a.kwargs["out"], b.kwargs["out"])


def test_duplicate_slot_debug_check(monkeypatch, impl):
    monkeypatch.setattr(contract, "SLOT_CHECK", True)
    monkeypatch.setattr(contract, "SLOT_CHECK_PADDING_SLOT", None)
    case = make_case(B=3, **SMALL, device=DEVICE)
    kw = dict(case.kwargs)
    s = case.live_slots[1]
    kw["state_indices"] = torch.tensor([s, s, -1], dtype=torch.int32, device=DEVICE)
    before = kw["state"].clone()
    with pytest.raises(ValueError, match="state_indices: live rows share slots"):
        kda_backend.kda_decode(**kw, backend=impl)
    assert torch.equal(before, kw["state"])
    monkeypatch.setattr(contract, "SLOT_CHECK_PADDING_SLOT", s)
    kda_backend.kda_decode(**kw, backend=impl)  # the scratch slot may repeat


def test_duplicate_slots_not_checked_by_default(impl):
    assert contract.SLOT_CHECK is False or os.environ.get(contract.SLOT_CHECK_ENV)
    case = make_case(B=2, **SMALL, device=DEVICE)
    s = case.live_slots[0]
    kw = dict(case.kwargs, state_indices=torch.tensor([s, s], dtype=torch.int32, device=DEVICE))
    kda_backend.kda_decode(**kw, backend=impl)  # undefined result, but no error and no host sync


@pytest.mark.parametrize("value", ["yes", "1.5"])
def test_slot_check_env_must_be_integer(value):
    env = dict(os.environ, FLYDSL_BACKENDS_KDA_SLOT_CHECK_PADDING_SLOT=value, FLYDSL_BACKENDS_KDA_SLOT_CHECK="1")
    proc = subprocess.run([sys.executable, "-c", "import kda_backend"], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode != 0
    assert f"FLYDSL_BACKENDS_KDA_SLOT_CHECK_PADDING_SLOT={value!r}: expected an integer" in proc.stderr


def test_slot_check_variables_are_read_at_import():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYDSL_BACKENDS_KDA_SLOT")}
    env.update(FLYDSL_BACKENDS_KDA_SLOT_CHECK="1", FLYDSL_BACKENDS_KDA_SLOT_CHECK_PADDING_SLOT="7")
    code = "from kda_backend import contract; print(contract.SLOT_CHECK, contract.SLOT_CHECK_PADDING_SLOT)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "7"]


def test_specialization_cache_bounded_and_scalar_free():
    """The specialization key is shape-class only: per-model scalars never add entries.
    (The GPU test also counts Triton's compiled kernels.)"""
    from kda_backend import triton as ktriton

    assert ktriton.launch_config.cache_info().maxsize == 1024
    if not kda_backend.REGISTRY.get("triton").is_available()[0]:
        pytest.skip("triton not usable here")
    case = make_case(B=2, **SMALL, device=DEVICE)
    clone_caches(case).call("triton")
    size = ktriton.launch_config.cache_info().currsize
    for i in range(12):
        clone_caches(case).call("triton", norm_eps=1e-6 * (i + 1), lower_bound=-1.0 - i * 0.25)
    assert ktriton.launch_config.cache_info().currsize == size


def test_empty_batch(impl):
    case = make_case(B=1, **SMALL, device=DEVICE)
    kw = dict(case.kwargs)
    for name in ("x", "a", "output_gate", "state_indices"):
        kw[name] = kw[name][:0]
    kw["b"] = kw["b"][:, :0]
    kw["out"] = None
    before = kw["state"].clone()
    out = kda_backend.kda_decode(**kw, backend=impl)
    assert out.shape == (0, 2, 32)
    assert torch.equal(before, kw["state"])


def test_is_kda_decode_supported():
    assert kda_backend.is_kda_decode_supported("cpu", backend="torch")
    assert not kda_backend.is_kda_decode_supported(backend="flydsl")
    with pytest.raises(ValueError, match="backend"):
        kda_backend.is_kda_decode_supported(backend="cuda-magic")


@pytest.mark.parametrize("bv", [8, 16, 32])
@pytest.mark.parametrize("stages", [dict(), dict(norm=False), dict(conv=False)], ids=["conv+norm", "conv", "norm"])
def test_many_v_blocks_last_program_protocol(monkeypatch, bv, stages):
    """V split over several programs: the last one shifts the q/k conv windows and applies the norm.
    Two consecutive steps check that the per-(row, head) counters are reset for the next launch."""
    if not kda_backend.REGISTRY.get("triton").is_available()[0]:
        pytest.skip("triton not usable here")
    from kda_backend import triton as ktriton

    monkeypatch.setenv("FLYDSL_BACKENDS_KDA_TRITON_BV", str(bv))
    ktriton.launch_config.cache_clear()
    try:
        case = make_case(B=4, H=2, K=32, W=4, padding=[1], **stages, device=DEVICE, seed=21)
        ref, test = clone_caches(case), clone_caches(case)
        for step in range(2):
            run_reference(ref.problem(), compute_dtype=torch.float64)
            test.call("triton")
            res = compare_runs(test, ref, case if step == 0 else case, **tolerances(torch.float32))
            assert res["out_err"] < 1e-2 and res["state_err"] < 1e-4 and res["padding_zero"], (step, res)
            if case.kwargs.get("conv_state") is not None:
                assert res["conv_exact"], (step, res)
        cnt = ktriton.WORKSPACE.get(DEVICE, 8, 32)[0]
        assert int(cnt[:8].abs().sum()) == 0  # counters back at zero
    finally:
        monkeypatch.delenv("FLYDSL_BACKENDS_KDA_TRITON_BV")
        ktriton.launch_config.cache_clear()


def test_auto_choice_logged_at_the_callers_line(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="flydsl_backends")
    kda_backend.REGISTRY.reset_cache()
    case = make_case(B=2, **SMALL, device=DEVICE)
    clone_caches(case).call("auto")
    msgs = [r.getMessage() for r in caplog.records if "backend='auto' chose" in r.getMessage()]
    assert msgs and "cases.py" in msgs[0]  # KDACase.call is the caller of kda_decode
