"""The FlyDSL slot of KDA decode on CPU: AITER discovery and the contract mapping (against a
stand-in exposing AITER's documented entry points, computing with the reference), source
selection, and arch gating. No FlyDSL kernel runs here (there is no AMD GPU)."""

import dataclasses

import pytest
import torch

from backend_core import flydsl_source, platform
from backend_core.tests.testing import aiter_standin as aiter_standin_of
from backend_core.tests.testing import (
    amd_props,
    clear_device_memos,
    fake_gpus,
    install_fake_aiter,
    nvidia_props,
    pretend_flydsl_device,
)
from kda_backend import REGISTRY, is_kda_decode_supported
from kda_backend import flydsl as kflydsl
from kda_backend.cases import clone_caches, compare_runs, make_case
from kda_backend.flydsl import aiter as kaiter

from . import aiter_standin

K3 = dict(H=12, K=128, W=4, lower_bound=-5.0)


@pytest.fixture
def standin(monkeypatch):
    with aiter_standin_of(monkeypatch, aiter_standin) as s:
        yield s


@pytest.fixture
def amd_here(monkeypatch):
    """CPU tensors count as sitting on a FlyDSL-capable AMD device (the registry path then runs)."""
    pretend_flydsl_device(monkeypatch, REGISTRY)


def run_both(case, fn):
    test, ref = clone_caches(case), clone_caches(case)
    fn(test)
    ref.call("torch")
    return compare_runs(test, ref, case, out_tol=1e-6, state_tol=1e-6)


@pytest.mark.parametrize("params", [
    dict(with_f_b=True, state_dtype=torch.float32, conv_layout="width"),
    dict(with_f_b=False, state_dtype=torch.bfloat16, conv_layout="channel", out_layout="heads"),
    dict(with_f_b=True, state_dtype=torch.float32, padding=(1,), out_of_range=(2,)),
])
def test_aiter_mapping_matches_reference(standin, params):
    case = make_case(B=4, **K3, **params, seed=7)
    p = clone_caches(case).problem()
    assert kaiter.covers(p) == (True, "H=12, K=V=128 Kimi-K3 layer")
    res = run_both(case, lambda c: kaiter.run(c.problem()))
    assert res["ok"], res
    assert standin.calls == ["flydsl_kda_decode_with_f_b" if params["with_f_b"] else "flydsl_kda_decode"]


def test_aiter_mapping_pads_rows_between_the_two_cache_sizes(standin):
    """Ours: an index past the smaller cache is padding. AITER checks its state cache only, so the
    adapter must turn indices in [conv slots, state slots) into -1 before the call."""
    case = make_case(B=3, **K3, with_f_b=True, slots=8, seed=2)
    kw = case.kwargs
    kw["conv_state"] = kw["conv_state"][:5]  # 5 conv slots, 8 state slots
    kw["state_indices"] = torch.tensor([0, 6, 3], dtype=torch.int32)
    case.live_rows, case.live_slots = [0, 2], [0, 3]
    res = run_both(case, lambda c: kaiter.run(c.problem()))
    assert res["ok"] and res["padding_zero"], res


def test_aiter_mapping_takes_int64_indices_as_int32_with_padding_kept(standin):
    """AITER takes int32 [B] indices; the contract also takes int64. An int64 index past int32 is padding, so it
    must reach AITER as -1, not wrapped onto a live row (2**32 + 1 would wrap to row 1)."""
    case = make_case(B=4, **K3, with_f_b=True, index_dtype=torch.int64, slots=8, seed=3)
    kw = case.kwargs
    kw["state_indices"] = torch.tensor([5, 2**32 + 1, 3, -2**40], dtype=torch.int64)
    case.live_rows, case.live_slots = [0, 2], [5, 3]
    assert kaiter.covers(clone_caches(case).problem())[0]
    res = run_both(case, lambda c: kaiter.run(c.problem()))
    assert res["ok"] and res["padding_zero"], res
    assert standin.calls == ["flydsl_kda_decode_with_f_b"]


@pytest.mark.parametrize("change,reason", [
    (dict(H=6), "built for H=12"),
    (dict(lower_bound=None), "safe gate only"),
    (dict(conv_bias=True), "no conv bias"),
    (dict(norm=False), "gated RMSNorm"),
    (dict(conv=False), "fused conv stage"),
])
def test_aiter_refuses_what_it_does_not_cover(standin, change, reason):
    params = {**K3, "with_f_b": True, **change}
    ok, why = kaiter.covers(make_case(B=2, **params).problem())
    assert not ok and reason in why


def test_aiter_refuses_scale_and_state_dtype(standin, monkeypatch):
    case = make_case(B=2, **K3, with_f_b=True, state_dtype=torch.bfloat16)
    ok, why = kaiter.covers(clone_caches(case).problem())
    assert ok
    monkeypatch.setattr(aiter_standin.flydsl_kda_decode_with_f_b, "state_dtypes", (torch.float32,))
    ok, why = kaiter.covers(clone_caches(case).problem())
    assert not ok and "takes torch.float32 state" in why
    ok, why = kaiter.covers(dataclasses.replace(make_case(B=2, **K3, with_f_b=True).problem(), scale=0.5))
    assert not ok and "default q scale" in why


def test_registry_path_auto_prefers_aiter_then_own(standin, amd_here, monkeypatch):
    case = make_case(B=3, **K3, with_f_b=True, seed=5)
    res = run_both(case, lambda c: c.call("flydsl"))
    assert res["ok"] and standin.calls == ["flydsl_kda_decode_with_f_b"]
    # a shape AITER does not cover goes to the project's kernel (stubbed here: it needs an AMD GPU)
    small = make_case(B=2, H=6, K=128, W=4, lower_bound=-5.0, with_f_b=True).problem()
    monkeypatch.setattr(kflydsl, "_own_covers", lambda p: (True, "own-stub"))
    assert kflydsl.source_for(small) == ("own", "project kernel: own-stub (AITER passed over: AITER's kernel is "
                                                "built for H=12, K=V=128 (got H=6, K=128))")
    monkeypatch.setenv("FLYDSL_BACKENDS_SOURCE", "own")
    assert kflydsl.source_for(clone_caches(case).problem())[0] == "own"
    monkeypatch.setattr(kflydsl, "_own_covers", lambda p: (False, "no-own"))
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_SOURCE=own but the project's FlyDSL kernel cannot serve"):
        kflydsl.source_for(small)
    monkeypatch.setenv("FLYDSL_BACKENDS_SOURCE", "aiter")
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_SOURCE=aiter but AITER cannot serve this call: .*H=12"):
        make_case(B=2, H=6, K=128, W=4, lower_bound=-5.0, with_f_b=True).call("flydsl")


def test_signature_drift_makes_aiter_unusable_with_the_reason(monkeypatch):
    fns = aiter_standin.functions()
    fns["flydsl_kda_decode_with_f_b"] = lambda f_a, x, out=None: None  # a different API
    install_fake_aiter(monkeypatch, fns)
    ok, why = kaiter.covers(make_case(B=1, **K3, with_f_b=True).problem())
    assert not ok and "flydsl_kda_decode_with_f_b: its signature lacks" in why
    flydsl_source.clear_cache()


def test_is_kda_decode_supported_reads_each_devices_arch(monkeypatch):
    for k in ("FLYDSL_GPU_ARCH", "ARCH", "HSA_OVERRIDE_GFX_VERSION"):
        monkeypatch.delenv(k, raising=False)
    impl = REGISTRY.get("flydsl")
    monkeypatch.setattr(impl, "_available_cache", (True, "stand-in"))
    try:
        fake_gpus(monkeypatch, [amd_props("gfx950:sramecc+:xnack-"), amd_props("gfx942"), amd_props("gfx1100")],
                  hip=True)
        assert is_kda_decode_supported(0)
        assert not is_kda_decode_supported(1)  # FlyDSL builds for the first GPU (gfx950)
        assert not is_kda_decode_supported(2)
        assert not is_kda_decode_supported(7)  # out of range: False, not an exception
        monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx942")
        assert is_kda_decode_supported("cuda:1") and not is_kda_decode_supported(0)
        fake_gpus(monkeypatch, [nvidia_props()], hip=False)
        assert not is_kda_decode_supported(0)
        assert not is_kda_decode_supported("cpu")
    finally:
        clear_device_memos()


def test_flydsl_on_this_machine_explains_itself():
    ok, why = REGISTRY.get("flydsl").is_available()
    if not platform.is_hip():
        assert not ok and ("AMD GPU" in why or "not installed" in why)
    case = make_case(B=1, H=3, K=32, W=4)
    with pytest.raises(ValueError, match="backend='flydsl'"):
        case.call("flydsl")
