"""The FlyDSL slot of the paged-attention ops on CPU: AITER discovery, the contract mapping
against a stand-in with AITER's documented ``pa_decode`` (computing with the reference), the
decode-only coverage, FP8 format per arch, and arch gating. Nothing runs on AMD here."""

import dataclasses

import pytest
import torch

from backend_core import platform
from backend_core.tests.testing import aiter_standin as aiter_standin_of
from backend_core.tests.testing import (
    amd_props,
    clear_device_memos,
    fake_gpus,
    nvidia_props,
    pretend_flydsl_device,
)
from pa_backend import REGISTRY, fp8_dtype_for, is_pa_decode_supported, pa_decode
from pa_backend import flydsl as pflydsl
from pa_backend.cases import make_pa_case
from pa_backend.contract import prepare_attention, prepare_write
from pa_backend.flydsl import aiter as paiter

from . import aiter_standin


@pytest.fixture
def standin(monkeypatch):
    with aiter_standin_of(monkeypatch, aiter_standin) as s:
        yield s


@pytest.fixture
def amd_here(monkeypatch):
    """CPU tensors count as sitting on a FlyDSL-capable AMD device (the registry path then runs)."""
    pretend_flydsl_device(monkeypatch, REGISTRY)


def problem(case):
    kw = dict(case.kwargs)
    return prepare_attention(**kw, prefill=case.prefill)


@pytest.mark.parametrize("params", [
    dict(query_length=1, scales="tensor", v_layout="4d", Hq=4, Hkv=1),
    dict(query_length=3, scales="token", v_layout="5d", Hq=8, Hkv=2),
    dict(query_length=1, scales="tensor", v_layout="4d", Hq=8, Hkv=2, block_size=64),
])
def test_aiter_mapping_matches_reference(standin, amd_here, params):
    params = dict(params)
    bs = params.pop("block_size", 16)
    case = make_pa_case([1, 40, 97], D=64, block_size=bs, extra_table=20, **params)
    want = case.call("torch", out=torch.full_like(case.kwargs["query"], float("nan")))
    got = case.call("flydsl", out=torch.full_like(case.kwargs["query"], float("nan")))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ql, parts, size = standin.calls[-1]
    table_tokens = case.kwargs["block_tables"].shape[1] * bs
    assert (ql, size) == (params["query_length"], 256) and parts == -(-table_tokens // 256)


@pytest.mark.parametrize("change, reason", [
    ("interleaved", "a strided key_cache"),
    ("table_rows", "strided block_tables rows"),
    ("sinks", "sinks / a sliding window"),
    ("window", "sinks / a sliding window"),
    ("block128", "block size 128"),
    ("wide_table", "at most 64 partitions"),
])
def test_aiter_declines_what_its_kernel_cannot_read(standin, amd_here, change, reason):
    """What the readable AITER kernel cannot serve goes to the Triton kernel (auto) with the reason, instead of a
    misread cache (it derives the caches' strides from their shapes) or a raise inside a server's step."""
    bs = 128 if change == "block128" else 16
    case = make_pa_case([20, 33], D=64, block_size=bs, extra_table=1100 if change == "wide_table" else 2)
    kw = dict(case.kwargs)
    if change == "interleaved":  # vLLM's pages: K and V of a block side by side in one allocation
        kc, vc = kw["key_cache"], kw["value_cache"]
        page = torch.empty((kc.shape[0], 2, kc[0].numel()), dtype=torch.uint8)
        page[:, 0].copy_(kc.view(torch.uint8).reshape(kc.shape[0], -1))
        page[:, 1].copy_(vc.view(torch.uint8).reshape(vc.shape[0], -1))
        kw["key_cache"] = page[:, 0].view(kc.dtype).view(kc.shape)
        kw["value_cache"] = page[:, 1].view(vc.dtype).view(vc.shape)
        assert not kw["key_cache"].is_contiguous()
    elif change == "table_rows":
        bt = kw["block_tables"]
        kw["block_tables"] = torch.cat([bt, bt], 1)[:, :bt.shape[1]]
    elif change == "sinks":
        kw["sinks"] = torch.zeros(kw["query"].shape[1])
    elif change == "window":
        kw["sliding_window"] = 8
    ok, why = paiter.covers(prepare_attention(**kw))
    assert not ok and reason in why, why
    assert torch.equal(pa_decode(**kw, backend="auto"), pa_decode(**kw, backend="torch"))
    assert standin.calls == []  # auto served it elsewhere


def test_partition_count_comes_from_the_table_not_the_lengths(standin, amd_here):
    """Graph stability: the same table width gives the same AITER arguments whatever the lengths."""
    case = make_pa_case([5, 300], D=64, extra_table=40)
    case.call("flydsl")
    case.kwargs["context_lengths"].copy_(torch.tensor([600, 1], dtype=torch.int32))
    case.call("flydsl")
    assert standin.calls[0] == standin.calls[1]


def test_decode_only_and_scale_coverage(standin):
    pre = make_pa_case([20, 33], query_lengths=[4, 1], D=64)
    ok, why = paiter.covers(problem(pre))
    assert not ok and "decode-only" in why
    dec = make_pa_case([20], D=64)
    ok, why = paiter.covers(dataclasses.replace(problem(dec), softmax_scale=0.3))
    assert not ok and "softmax_scale" in why
    kw = dec.kwargs
    wp = prepare_write(key=torch.zeros(1, 1, 64, dtype=torch.bfloat16), value=torch.zeros(1, 1, 64,
                                                                                          dtype=torch.bfloat16),
                       key_cache=kw["key_cache"], value_cache=kw["value_cache"], slot_mapping=torch.zeros(1,
                                                                                                          dtype=torch.int32),
                       key_scale=kw["key_scale"], value_scale=kw["value_scale"])
    assert not paiter.covers(wp)[0]


def test_auto_on_amd_uses_triton_for_prefill_and_write(standin, amd_here):
    pre = make_pa_case([20, 33], query_lengths=[4, 1], D=64)
    ok, why = pflydsl.supports(problem(pre))
    assert not ok and "decode-only" in why and "no FlyDSL paged-attention kernel of its own" in why


def test_fnuz_cache_on_gfx950_is_refused(standin, monkeypatch):
    try:
        fake_gpus(monkeypatch, [amd_props("gfx950")], hip=True)
        case = make_pa_case([20], D=64, fp8_dtype=torch.float8_e4m3fnuz)
        p = dataclasses.replace(problem(case), query=case.kwargs["query"])
        monkeypatch.setattr(type(p), "device", property(lambda self: torch.device("cuda", 0)))
        ok, why = paiter.covers(p)
        assert not ok and "reads torch.float8_e4m3fn" in why
    finally:
        clear_device_memos()


def test_source_own_is_refused_with_the_reason(standin, amd_here, monkeypatch):
    monkeypatch.setenv("FLYDSL_BACKENDS_SOURCE", "own")
    case = make_pa_case([20], D=64)
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_SOURCE=own but the project's FlyDSL kernel cannot serve"):
        case.call("flydsl")


def test_fp8_format_and_support_per_arch(monkeypatch):
    for k in ("FLYDSL_GPU_ARCH", "ARCH", "HSA_OVERRIDE_GFX_VERSION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(REGISTRY.get("flydsl"), "_available_cache", (True, "stand-in"))
    try:
        fake_gpus(monkeypatch, [amd_props("gfx942:sramecc+:xnack-"), amd_props("gfx950")], hip=True)
        assert fp8_dtype_for(0) == torch.float8_e4m3fnuz and fp8_dtype_for(1) == torch.float8_e4m3fn
        assert is_pa_decode_supported(0) and not is_pa_decode_supported(1)  # FlyDSL builds for the first GPU
        assert not is_pa_decode_supported(9)
        fake_gpus(monkeypatch, [nvidia_props()], hip=False)
        assert fp8_dtype_for(0) == torch.float8_e4m3fn and not is_pa_decode_supported(0)
    finally:
        clear_device_memos()


def test_without_aiter_flydsl_explains_itself():
    ok, why = REGISTRY.get("flydsl").is_available()
    assert not ok or platform.is_hip()
    with pytest.raises(ValueError, match="backend='flydsl'"):
        make_pa_case([20], D=64).call("flydsl")


def _interleaved(kc, vc):
    """vLLM-style K/V pages: the two caches of a block side by side in one allocation (same shapes, strided)."""
    page = torch.empty((kc.shape[0], 2, kc[0].numel()), dtype=torch.uint8)
    page[:, 0].copy_(kc.view(torch.uint8).reshape(kc.shape[0], -1))
    page[:, 1].copy_(vc.view(torch.uint8).reshape(vc.shape[0], -1))
    return page[:, 0].view(kc.dtype).view(kc.shape), page[:, 1].view(vc.dtype).view(vc.shape)


def test_a_plan_chooses_anew_for_a_layer_flydsl_cannot_serve(standin, amd_here):
    """A plan keeps one implementation per layer kind; a later layer FlyDSL's kernel cannot read (interleaved
    K/V pages of the same shapes; another softmax_scale, which AITER's pa_decode does not take) must not reuse
    the first layer's FlyDSL choice: forced, it is refused; on auto it goes to another implementation."""
    import math

    from pa_backend import pa_decode, plan_decode

    kw = dict(make_pa_case([20, 33], D=128, extra_table=2).kwargs)
    q, kc, vc, ks, vs = (kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale"))
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="flydsl")
    plan.run(q, kc, vc, ks, vs, softmax_scale=1 / math.sqrt(128))  # an ulp off 128**-0.5: FlyDSL serves it
    served = len(standin.calls)
    assert served >= 1
    kc2, vc2 = _interleaved(kc, vc)
    with pytest.raises(ValueError, match="strided key_cache"):
        plan.run(q, kc2, vc2, ks, vs)
    with pytest.raises(ValueError, match="softmax_scale"):
        plan.run(q, kc, vc, ks, vs, softmax_scale=0.3)
    assert len(standin.calls) == served
    auto = plan_decode(kw["block_tables"], kw["context_lengths"])
    auto.run(q, kc, vc, ks, vs)
    served = len(standin.calls)
    want = pa_decode(q, kc, vc, kw["block_tables"], kw["context_lengths"], ks, vs, softmax_scale=0.3, backend="torch")
    got = auto.run(q, kc, vc, ks, vs, softmax_scale=0.3)
    assert len(standin.calls) == served  # not AITER's kernel
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
