"""Tests of the Gluon partition kernel experiment (benchmarks/gluon_decode.py), run by hand:
``python3 -m pytest -q benchmarks/test_gluon_decode.py`` from the repo root. That it compiles for sm_90 without
spills (CPU, no GPU needed), and on a Hopper GPU that its results match the float64 reference: the 64-row
decode eager and the 128-row prefill through the workspace and direct."""

import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gluon_importable() -> bool:
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except Exception:  # noqa: BLE001 (no triton, or one without Gluon's Hopper ops)
        return False
    return True


pytestmark = pytest.mark.skipif(not _gluon_importable(), reason="this triton has no Gluon Hopper ops")

SCRIPT = """
import json, sys
sys.path.insert(0, "benchmarks")
from test_gluon_decode import gluon_ptxas_report
from gluon_decode import (GLUON_CONSUMER_REGS, GLUON_MAXNREG, GLUON_MAXNREG_128, GLUON_PREFILL_M,
                          GLUON_PRODUCER_REGS, GLUON_SLOTS, GLUON_SLOTS_128)
rows = [["decode", gluon_ptxas_report(GLUON_SLOTS, GLUON_PRODUCER_REGS, GLUON_MAXNREG)]]
for direct in (True, False):
    rows.append([f"prefill direct={direct}", gluon_ptxas_report(GLUON_SLOTS_128, GLUON_PRODUCER_REGS, GLUON_MAXNREG_128,
                                                              rows=GLUON_PREFILL_M, consumer_regs=GLUON_CONSUMER_REGS,
                                                              direct=direct)])
print(json.dumps(rows))
"""


def gluon_ptxas_report(slots: int, producer_regs: int, maxnreg: int, block_size: int = 16, rows: int = 64,
                       consumer_regs: int = 200, direct: bool = False):
    """ptxas' numbers (sm_90) of the Gluon partition kernel as its launcher builds it: for the GQA 16 x 4-row
    decode (``rows`` 64), or for prefill chunks of 32 rows x GQA 4 (``rows`` 128: two consumer warpgroups;
    ``direct``: one partition per chunk, the output written by the kernel, with sinks)."""
    from gluon_decode import gluon_partition_kernel

    from backend_core.tests.aot import ptxas_report
    from pa_backend.tests.triton_resources import _arg_types

    types = _arg_types(gluon_partition_kernel)
    ce = dict(HKV=1, G=16, QL=4, BM=64, D=128, BS=block_size, BT=64, ALIGN=max(64, block_size), NBUF=slots,
              PRODUCER_REGS=producer_regs, RAGGED=False, DIRECT=direct, CONSUMER_REGS=consumer_regs,
              HAS_SINKS=direct)
    if rows == 128:
        ce.update(HKV=8, G=4, QL=32, BM=128, RAGGED=True)
    elif rows != 64:
        raise ValueError(f"rows={rows}: expected 64 or 128")
    return ptxas_report(gluon_partition_kernel, types, ce, [n for n in types if n.startswith(("p_", "stride_"))],
                        num_warps=4, maxnreg=maxnreg or None)


def test_compiles_for_sm90_without_spills():
    """Decode (64 rows): two CTAs of 8 (padded) warps per SM. Prefill (128 rows, two consumer warpgroups): one
    CTA of 12 warps per SM."""
    from backend_core.tests.aot import run_report_script

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


gpu = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
NAMES = ("query", "key_cache", "value_cache", "key_scale", "value_scale")
CONTEXTS = [4, 5, 63, 64, 65, 97, 1027, 8192, 65536, 4000]


def _check(case, plan, max_err=None):
    from gluon_decode import gluon_layer

    from pa_backend.tests.test_triton import rel_to_reference
    from pa_backend.verify import tolerance

    kw = dict(case.kwargs)
    out = torch.full_like(kw["query"], float("nan"))
    _, L = gluon_layer(plan, *(kw[k] for k in NAMES), sinks=kw.get("sinks"), out=out)
    err = rel_to_reference(case, out)
    assert torch.isfinite(out).all() and err <= tolerance(torch.device("cuda")), err
    return L


@gpu
@pytest.mark.parametrize("gqa,ql", [(16, 4), (16, 3), (12, 4)])
@pytest.mark.parametrize("B", [1, 7, 81])
def test_gluon_decode_against_reference_gpu(B, gqa, ql):
    from pa_backend import plan_decode
    from pa_backend.cases import make_pa_case

    ctx = [max(ql, CONTEXTS[(i * 3 + B) % len(CONTEXTS)]) for i in range(B)]
    case = make_pa_case(ctx, query_length=ql, Hq=gqa, Hkv=1, D=128, block_size=16, extra_table=300, device="cuda",
                        seed=B + gqa)
    kw = dict(case.kwargs)
    _check(case, plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, backend="triton"))


@gpu
def test_gluon_two_kv_heads_and_sinks_gpu():
    from pa_backend import plan_decode
    from pa_backend.cases import make_pa_case

    case = make_pa_case([3000, 17, 700], query_length=4, Hq=32, Hkv=2, D=128, block_size=16, sinks=True,
                        device="cuda", seed=5)
    kw = dict(case.kwargs)
    _check(case, plan_decode(kw["block_tables"], kw["context_lengths"], query_length=4, backend="triton"))


PREFILL_CASES = [
    # ragged: a chunk of 1 row, rows not a multiple of 32, a long prefix, an empty sequence, GQA 4 and 8
    dict(context_lengths=[70, 3000, 33, 1, 500], query_lengths=[70, 45, 1, 0, 97], Hq=32, Hkv=8),
    dict(context_lengths=[8192, 129], query_lengths=[300, 129], Hq=16, Hkv=2),
    dict(context_lengths=[2100, 64, 65], query_lengths=[64, 64, 65], Hq=64, Hkv=8),
]


@pytest.fixture
def rows_128(monkeypatch):
    """Prefill items of 128 rows (the Gluon kernel's; the Triton kernel's are 256)."""
    from pa_backend.triton.tiling import prefill_tiling

    monkeypatch.setenv("FLYDSL_BACKENDS_PA_PREFILL_M", "128")
    prefill_tiling.cache_clear()
    yield
    prefill_tiling.cache_clear()


@gpu
@pytest.mark.parametrize("params", PREFILL_CASES, ids=["ragged", "gqa8", "tile-edges"])
def test_gluon_prefill_against_reference_gpu(rows_128, params):
    """Eager-style prefill (its split is sized to the table width: the workspace and the reduce)."""
    from pa_backend import plan_prefill
    from pa_backend.cases import make_pa_case

    case = make_pa_case(**params, D=128, block_size=16, extra_table=300, device="cuda", seed=3)
    kw = dict(case.kwargs)
    plan = plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                        query_start_loc_host=kw["query_start_loc"].tolist(), backend="triton")
    assert _check(case, plan).BM == 128


@gpu
@pytest.mark.parametrize("sinks", [False, True])
def test_gluon_prefill_direct_plan_gpu(rows_128, sinks):
    """A plan bounded by a short max context: one partition per item, the kernel writes the output rows (with
    the sinks in the denominator)."""
    from pa_backend import plan_prefill
    from pa_backend.cases import make_pa_case

    case = make_pa_case([40, 3, 100, 9], query_lengths=[5, 3, 40, 0], Hq=32, Hkv=8, D=128, block_size=16,
                        sinks=sinks, extra_table=200, device="cuda", seed=11)
    kw = dict(case.kwargs)
    plan = plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                        query_start_loc_host=kw["query_start_loc"].tolist(), max_context=100, backend="triton")
    L = _check(case, plan)
    assert L.direct and L.BM == 128
