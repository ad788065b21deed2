"""The warp-specialized Gluon partition kernel (pa_backend/triton/gluon_decode.py): when it is chosen, that it
compiles for sm_90 without spills (CPU, no GPU needed), and on a Hopper GPU that its results match the float64
reference: the 64-row decode eager and in CUDA-graph replay with new context lengths, the 128-row prefill through
the workspace and direct, and the layers it does not cover on the Triton kernel."""

import os
import types

import pytest
import torch

from backend_core import platform
from backend_core.tests.aot import run_report_script
from pa_backend.cases import make_pa_case

from .test_gpu import assert_replay_matches_eager
from .test_triton import check, rel_to_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gluon_importable() -> bool:
    from pa_backend.triton import gluon_available

    return gluon_available()


def test_the_switch_is_checked_and_off_by_default(monkeypatch):
    from pa_backend.triton import gluon_mode, gluon_ws

    never = types.SimpleNamespace()  # off: nothing of the problem is read
    monkeypatch.delenv("FLYDSL_BACKENDS_PA_GLUON", raising=False)
    assert gluon_mode() == "off" and gluon_ws(never, never) is False
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "0")
    assert gluon_mode() == "off" and gluon_ws(never, never) is False
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "1")
    assert gluon_mode() == "decode"
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "all")
    assert gluon_mode() == "all"
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "yes")
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_PA_GLUON"):
        gluon_ws(never, never)


def test_cpu_problems_never_take_it(monkeypatch):
    """On CPU (the interpreter) the switch changes nothing: the Triton kernel runs."""
    if not platform.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "all")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the GPU test covers it")
    check(dict(context_lengths=[5, 70], query_length=4, Hq=16, Hkv=1, D=128, block_size=16), seed=3)


SCRIPT = """
import json
from pa_backend.triton import (GLUON_CONSUMER_REGS, GLUON_MAXNREG, GLUON_MAXNREG_128, GLUON_PREFILL_M,
                               GLUON_PRODUCER_REGS, GLUON_SLOTS, GLUON_SLOTS_128)
from pa_backend.tests.triton_resources import gluon_ptxas_report
rows = [["decode", gluon_ptxas_report(GLUON_SLOTS, GLUON_PRODUCER_REGS, GLUON_MAXNREG)]]
for direct in (True, False):
    rows.append([f"prefill direct={direct}", gluon_ptxas_report(GLUON_SLOTS_128, GLUON_PRODUCER_REGS, GLUON_MAXNREG_128,
                                                              rows=GLUON_PREFILL_M, consumer_regs=GLUON_CONSUMER_REGS,
                                                              direct=direct)])
print(json.dumps(rows))
"""


@pytest.mark.skipif(not _gluon_importable(), reason="this triton has no Gluon Hopper ops")
def test_compiles_for_sm90_without_spills():
    """Decode (64 rows): two CTAs of 8 (padded) warps per SM. Prefill (128 rows, two consumer warpgroups): one
    CTA of 12 warps per SM."""
    proc, rows = run_report_script(SCRIPT, ROOT)
    assert rows is not None, proc.stderr[-3000:]
    for what, rep in rows:
        print(what, rep)
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (what, rep)
        assert rep["wgmma_serialized"] == 0, (what, rep)  # ptxas kept the asynchronous dots asynchronous
        if what == "decode":
            assert rep["registers"] == 128, rep  # the launch's cap
            assert rep["shared"] <= 113 * 1024, rep  # two CTAs per SM (228 KB, 1 KB reserved per CTA)
        else:
            assert rep["registers"] == 168, rep  # 12 warps x 32 x 168 <= 64k registers
            assert rep["shared"] <= 227 * 1024, rep


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def gluon_on(monkeypatch):
    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    import pa_backend.triton as tri

    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "all")
    calls = []
    real = tri._run_gluon

    def spy(L, sinks, p):
        calls.append(p.query.shape)
        return real(L, sinks, p)

    monkeypatch.setattr(tri, "_run_gluon", spy)
    return calls


@pytest.mark.gpu
def test_switch_1_takes_decode_only_gpu(gluon_on, monkeypatch):
    """FLYDSL_BACKENDS_PA_GLUON=1: the ql 4 decode on the Gluon kernel, prefill on the Triton kernel's 256-row
    items; unset: neither."""
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "1")
    check(dict(context_lengths=[3000, 17, 700], query_length=4, Hq=16, Hkv=1, D=128, block_size=16), seed=4)
    assert len(gluon_on) == 1
    case = make_pa_case([300, 90], query_lengths=[100, 90], Hq=32, Hkv=8, D=128, block_size=16, device="cuda", seed=4)
    case.call("triton")
    assert len(gluon_on) == 1
    monkeypatch.delenv("FLYDSL_BACKENDS_PA_GLUON")
    check(dict(context_lengths=[3000, 17, 700], query_length=4, Hq=16, Hkv=1, D=128, block_size=16), seed=4)
    assert len(gluon_on) == 1


CONTEXTS = [4, 5, 63, 64, 65, 97, 1027, 8192, 65536, 4000]


@pytest.mark.gpu
@pytest.mark.parametrize("gqa,ql", [(16, 4), (16, 3), (12, 4)])
@pytest.mark.parametrize("B", [1, 7, 81])
def test_gluon_decode_against_reference_gpu(gluon_on, B, gqa, ql):
    ctx = [max(ql, CONTEXTS[(i * 3 + B) % len(CONTEXTS)]) for i in range(B)]
    check(dict(context_lengths=ctx, query_length=ql, Hq=gqa, Hkv=1, D=128, block_size=16, extra_table=300),
          seed=B + gqa)
    assert gluon_on, "the Gluon kernel was not chosen"


@pytest.mark.gpu
@pytest.mark.parametrize("params", [dict(block_size=64), dict(v_layout="5d"), dict(scales="token"),
                                    dict(sliding_window=100), dict(Hq=8)])
def test_other_shapes_keep_the_triton_kernel_gpu(gluon_on, params):
    base = dict(context_lengths=[3000, 17], query_length=4, Hq=16, Hkv=1, D=128, block_size=16)
    check({**base, **params}, seed=9)
    assert not gluon_on, params


@pytest.mark.gpu
def test_gluon_two_kv_heads_and_sinks_gpu(gluon_on):
    check(dict(context_lengths=[3000, 17, 700], query_length=4, Hq=32, Hkv=2, D=128, block_size=16, sinks=True),
          seed=5)
    assert gluon_on


@pytest.mark.gpu
def test_gluon_graph_replay_with_new_context_lengths_gpu(gluon_on):
    case = make_pa_case([100, 2000, 37], query_length=4, Hq=16, Hkv=1, D=128, block_size=16, extra_table=200,
                        device="cuda")
    assert_replay_matches_eager(case, ([100, 2000, 37], [5, 3000, 4], [2100, 4, 640]))
    assert gluon_on


# prefill: 128-row items (32 query rows x GQA 4) on two consumer warpgroups

def test_prefill_tiling_takes_the_gluon_rows_only_when_chosen(monkeypatch):
    """prefill_tiling's M override gives 128-row items; on CPU (or without the switch) a prefill problem keeps
    the Triton tiling."""
    from pa_backend.contract import prepare_attention
    from pa_backend.triton import GLUON_PREFILL_M, gluon_prefill, prefill_tiling, work_rows

    for G in (1, 3, 4, 8, 16):
        rows = prefill_tiling(128, G, 16, False, GLUON_PREFILL_M)[0]
        assert work_rows(G, rows) == GLUON_PREFILL_M, G
    case = make_pa_case([40, 30], query_lengths=[5, 7], Hq=32, Hkv=8, D=128, block_size=16)
    kw = dict(case.kwargs)
    p = prepare_attention(**kw, prefill=True)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "all")
    assert not gluon_prefill(p)  # a CPU problem
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_GLUON", "x")
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_PA_GLUON"):
        gluon_prefill(p)


PREFILL_CASES = [
    # ragged: a chunk of 1 row, rows not a multiple of 32, a long prefix, an empty sequence, GQA 4 and 8
    dict(context_lengths=[70, 3000, 33, 1, 500], query_lengths=[70, 45, 1, 0, 97], Hq=32, Hkv=8),
    dict(context_lengths=[8192, 129], query_lengths=[300, 129], Hq=16, Hkv=2),
    dict(context_lengths=[2100, 64, 65], query_lengths=[64, 64, 65], Hq=64, Hkv=8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("params", PREFILL_CASES, ids=["ragged", "gqa8", "tile-edges"])
def test_gluon_prefill_against_reference_gpu(gluon_on, params):
    """Eager prefill (its split is sized to the table width: the workspace and the reduce)."""
    check(dict(**params, D=128, block_size=16, extra_table=300), seed=3)
    assert gluon_on, "the Gluon kernel was not chosen"


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", [False, True])
def test_gluon_prefill_direct_plan_gpu(gluon_on, sinks):
    """A plan bounded by a short max context: one partition per item, the kernel writes the output rows (with
    the sinks in the denominator)."""
    from pa_backend import plan_prefill
    from pa_backend.verify import tolerance

    case = make_pa_case([40, 3, 100, 9], query_lengths=[5, 3, 40, 0], Hq=32, Hkv=8, D=128, block_size=16,
                        sinks=sinks, extra_table=200, device="cuda", seed=11)
    kw = dict(case.kwargs)
    plan = plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                        query_start_loc_host=kw["query_start_loc"].tolist(), max_context=100, backend="triton")
    out = torch.full_like(kw["query"], float("nan"))
    plan.run(*(kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")),
             sinks=kw.get("sinks"), out=out)
    L = next(iter(plan.state.values()))
    assert L.direct and L.BM == 128 and L.gluon
    err = rel_to_reference(case, out)
    assert torch.isfinite(out).all() and err <= tolerance(torch.device("cuda")), err
    assert gluon_on


@pytest.mark.gpu
@pytest.mark.parametrize("later", [dict(sliding_window=64), dict(scales="token"), dict(v_layout="5d")],
                         ids=["window", "per-token-scales", "5d-v"])
@pytest.mark.parametrize("decode", [False, True])
def test_later_layer_the_kernel_does_not_cover_takes_the_triton_kernel_gpu(gluon_on, later, decode):
    """A plan's launch state is made from its first layer (covered: the Gluon kernel); a later layer with a
    window, per-token scales or the 5-D V layout runs the Triton kernel on the same state, and is right; the
    first layer's kind runs the Gluon kernel again after it."""
    from pa_backend import plan_decode, plan_prefill
    from pa_backend.verify import tolerance

    shape = dict(Hq=32, Hkv=8, D=128, block_size=16, extra_table=100, device="cuda", seed=5)
    shape.update(dict(query_length=4, Hq=16, Hkv=1) if decode else dict(query_lengths=[100, 90]))
    first, other = make_pa_case([700, 90], **shape), make_pa_case([700, 90], **shape, **later)
    kw1, kw2 = dict(first.kwargs), dict(other.kwargs)
    assert torch.equal(kw1["block_tables"], kw2["block_tables"])  # one batch, two layers
    names = ("query", "key_cache", "value_cache", "key_scale", "value_scale")
    if decode:
        plan = plan_decode(kw1["block_tables"], kw1["context_lengths"], query_length=4, backend="triton")
    else:
        plan = plan_prefill(kw1["block_tables"], kw1["query_start_loc"], kw1["context_lengths"],
                            query_start_loc_host=kw1["query_start_loc"].tolist(), backend="triton")
    plan.run(*(kw1[k] for k in names), out=torch.empty_like(kw1["query"]))
    assert len(gluon_on) == 1
    out = torch.full_like(kw2["query"], float("nan"))
    plan.run(*(kw2[k] for k in names), sliding_window=kw2.get("sliding_window", 0), out=out)
    assert len(gluon_on) == 1, later  # not taken for that layer
    err = rel_to_reference(other, out)
    assert torch.isfinite(out).all() and err <= tolerance(torch.device("cuda")), err
    plan.run(*(kw1[k] for k in names), out=torch.empty_like(kw1["query"]))
    assert len(gluon_on) == 2
