"""docs/design.md §4 safety and write_kv contract, one test per bullet (reference implementation)."""

import pytest
import torch

from pa_backend import fp8_dtype_for, fp8_max, pa_decode, write_kv
from pa_backend.cases import make_pa_case
from pa_backend.contract import prepare_attention
from pa_backend.reference import dequantize_tokens


def test_stale_table_entries_do_not_change_the_result():
    case = make_pa_case([5, 17, 33], extra_table=3, seed=1)
    a = case.call("torch").clone()
    kw = dict(case.kwargs)
    tables = kw["block_tables"].clone()
    bs = 16
    for s, c in enumerate(case.context_lengths):
        tables[s, (c + bs - 1) // bs:] = tables[(s + 1) % 3, 0]  # different stale ids
    b = pa_decode(**dict(kw, block_tables=tables, out=None), backend="torch")
    assert torch.equal(a, b)


def test_nan_pages_never_leak():
    case = make_pa_case([3, 40], spare_blocks=6, v_layout="5d", seed=2)  # unused pages are FP8 NaN bytes
    out = case.call("torch")
    assert torch.isfinite(out).all()


def test_all_zero_query_row_is_finite_and_context_of_one():
    case = make_pa_case([1, 19], sinks=True, seed=3)
    case.kwargs["query"].zero_()
    out = case.call("torch")
    assert torch.isfinite(out).all()


def test_context_zero_rows_are_zero():
    case = make_pa_case([0, 5], query_length=1, seed=4)
    out = case.call("torch")
    assert (out[0] == 0).all() and torch.isfinite(out).all()


def test_out_must_be_contiguous():
    case = make_pa_case([5, 6], seed=5)
    q = case.kwargs["query"]
    bad = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype).transpose(0, 1)
    with pytest.raises(ValueError, match="out: expected a contiguous tensor"):
        case.call("torch", out=bad)


def test_out_filled_in_place_and_returned():
    case = make_pa_case([5, 6], seed=5)
    out = case.kwargs["out"]
    assert case.call("torch") is out
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("scales", ["tensor", "token"])
@pytest.mark.parametrize("v_layout", ["4d", "5d"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["fn", "fnuz"])
def test_write_kv_round_trip_and_padding_slot(scales, v_layout, fp8):
    case = make_pa_case([0], spare_blocks=4, scales=scales, v_layout=v_layout, fp8_dtype=fp8, Hkv=2, D=64)
    kw = case.kwargs
    T = 5
    g = torch.Generator().manual_seed(0)
    key = (torch.randn(T, 2, 64, generator=g) * 3).bfloat16()
    value = (torch.randn(T, 2, 64, generator=g) * 2).bfloat16()
    if scales == "tensor":
        kw["key_scale"].fill_(3 * 4 / fp8_max(fp8))
        kw["value_scale"].fill_(2 * 4 / fp8_max(fp8))
    slots = torch.tensor([16 * 1 + 3, -1, 16 * 2 + 0, 16 * 2 + 15, 16 * 4 + 7])
    before_k = kw["key_cache"].view(torch.uint8).clone()
    write_kv(key, value, kw["key_cache"], kw["value_cache"], slots, kw["key_scale"], kw["value_scale"], backend="torch")
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, off = divmod(slot, 16)
        written.add(b)
        table = torch.tensor([b], dtype=torch.int32)
        cache = prepare_attention(query=torch.zeros(1, 2, 64, dtype=torch.bfloat16), key_cache=kw["key_cache"],
                                  value_cache=kw["value_cache"], block_tables=table[None],
                                  context_lengths=torch.tensor([16], dtype=torch.int32), key_scale=kw["key_scale"],
                                  value_scale=kw["value_scale"]).cache
        k, v = dequantize_tokens(cache, table, off + 1)
        for got, want in ((k[off], key[t]), (v[off], value[t])):
            rel = (got - want.float()).norm() / want.float().norm()
            assert rel < 0.07, rel  # e4m3: 3 mantissa bits
        if scales == "token":
            assert torch.allclose(kw["key_scale"][b, :, off], key[t].float().abs().amax(-1) / fp8_max(fp8))
    # blocks nobody wrote are byte-identical (the padding row wrote nothing)
    for b in range(kw["key_cache"].shape[0]):
        if b not in written:
            assert torch.equal(kw["key_cache"].view(torch.uint8)[b], before_k[b])


def test_write_kv_saturates_instead_of_overflowing():
    case = make_pa_case([0], spare_blocks=1, Hkv=1, D=64)
    kw = case.kwargs
    key = torch.full((1, 1, 64), 1e4, dtype=torch.bfloat16)  # 1e4 / 0.02 = 5e5 >> 448
    write_kv(key, -key, kw["key_cache"], kw["value_cache"], torch.tensor([0]), kw["key_scale"], kw["value_scale"])
    k = kw["key_cache"][0, 0, :, 0, :].float()
    v = kw["value_cache"][0, 0, :, 0].float()
    assert (k == 448).all() and (v == -448).all()


def test_fp8_dtype_per_arch(monkeypatch):
    from types import SimpleNamespace

    from backend_core import platform

    for arch, want in (("gfx942:sramecc+", torch.float8_e4m3fnuz), ("gfx950", torch.float8_e4m3fn),
                       ("sm_90", torch.float8_e4m3fn)):
        monkeypatch.setattr(platform, "device_info", lambda d=None, a=arch: SimpleNamespace(arch=a.split(":")[0]))
        assert fp8_dtype_for(0) == want
    assert fp8_max(torch.float8_e4m3fnuz) == 240.0 and fp8_max(torch.float8_e4m3fn) == 448.0


def test_flydsl_without_amd_gpu_says_why():
    case = make_pa_case([5], seed=6)
    with pytest.raises(ValueError, match="backend='flydsl' cannot serve this pa_decode call: not available: "
                                         "(flydsl is not installed|no AMD GPU visible)"):
        case.call("flydsl")


def test_each_op_has_its_own_registry_and_coverage(monkeypatch):
    """Decode, prefill and write are separate ops: flydsl serves decode only, so it is not an
    implementation of the other two; forcing it through FLYDSL_BACKENDS_PA means auto for them,
    an explicit backend="flydsl" for them is an error naming the op."""
    from pa_backend import api

    assert api.DECODE.names() == ["torch", "triton", "flydsl"]
    assert api.PREFILL.names() == api.WRITE.names() == ["torch", "triton"]
    case = make_pa_case([10, 12], query_lengths=[3, 4], device=torch.device("cpu"), seed=3)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA", "flydsl")
    out = case.call("torch").clone()
    assert torch.equal(case.call("auto"), out)  # prefill: flydsl absent -> auto -> torch on CPU
    with pytest.raises(ValueError, match="'flydsl' is not an implementation of pa_prefill"):
        case.call("flydsl")
    monkeypatch.setenv("FLYDSL_BACKENDS_PA", "tritn")
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_PA='tritn': expected 'auto' or one of"):
        case.call("auto")


def test_select_returns_a_runner_bound_once():
    """``select`` returns the chosen implementation with its run bound: a plan keeps it, so each
    choice (the FlyDSL source among them) is made once per layer shape."""
    from backend_core.registry import Runner
    from pa_backend import api
    from pa_backend.contract import prepare_attention

    case = make_pa_case([10, 12], device=torch.device("cpu"), seed=4)
    kw = dict(case.kwargs)
    p = prepare_attention(**kw, prefill=False)
    r = api.registry_for(p).select(p, "auto", device_type="cpu")
    assert isinstance(r, Runner) and r.name == "torch" and r.run is r.impl.run
