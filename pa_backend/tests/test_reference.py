"""The paged-attention reference against an independent formulation.

Independent: K/V are read token by token with the index formulas of docs/design.md §4 (no fancy
gathers), attention is float64 with an explicit mask (``F.scaled_dot_product_attention`` when no
sinks; an appended sink logit otherwise).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from pa_backend import REGISTRY
from pa_backend.cases import make_pa_case


def read_token(kw, b, t):
    kc, vc = kw["key_cache"], kw["value_cache"]
    Hkv, D = kc.shape[1], kc.shape[2] * 16
    k = torch.empty(Hkv, D, dtype=torch.float64)
    v = torch.empty(Hkv, D, dtype=torch.float64)
    for h in range(Hkv):
        for d in range(D):
            k[h, d] = float(kc[b, h, d // 16, t, d % 16].float())
            v[h, d] = float((vc[b, h, t // 16, d, t % 16] if vc.dim() == 5 else vc[b, h, d, t]).float())
    ks, vs = kw["key_scale"], kw["value_scale"]
    k *= (ks[b, :, t].double()[:, None] if ks.dim() == 3 else float(ks.reshape(())))
    v *= (vs[b, :, t].double()[:, None] if vs.dim() == 3 else float(vs.reshape(())))
    return k, v


def independent(case):
    kw = case.kwargs
    bs = kw["key_cache"].shape[3]
    q_all = kw["query"].double()
    Hq, D = q_all.shape[1:]
    Hkv = kw["key_cache"].shape[1]
    scale = D ** -0.5
    out = torch.zeros_like(q_all)
    r0 = 0
    for s, (ctx, ql) in enumerate(zip(case.context_lengths, case.query_lengths)):
        ks, vs = zip(*[read_token(kw, int(kw["block_tables"][s, j // bs]),
                                  j % bs) for j in range(ctx)]) if ctx else ((), ())
        K = torch.stack(ks) if ctx else torch.zeros(0, Hkv, D, dtype=torch.float64)
        V = torch.stack(vs) if ctx else torch.zeros(0, Hkv, D, dtype=torch.float64)
        K = K.repeat_interleave(Hq // Hkv, 1).transpose(0, 1)  # [Hq, ctx, D]
        V = V.repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        q = q_all[r0:r0 + ql].transpose(0, 1)  # [Hq, ql, D]
        pos = torch.arange(ctx)
        rows = torch.arange(ctx - ql, ctx)
        allowed = pos[None, :] <= rows[:, None]
        w = kw.get("sliding_window", 0)
        if w:
            allowed &= pos[None, :] > rows[:, None] - w
        sinks = kw.get("sinks")
        if sinks is None and ctx:
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=allowed, scale=scale)
            o = torch.where(allowed.any(-1)[None, :, None], o, torch.zeros_like(o))
        elif ctx:
            logits = (q @ K.transpose(1, 2)) * scale
            logits = logits.masked_fill(~allowed, -math.inf)
            sink_col = sinks.double()[:, None, None].expand(Hq, ql, 1)
            p = torch.softmax(torch.cat([logits, sink_col], -1), -1)[..., :-1]
            o = p @ V
        else:
            o = torch.zeros_like(q)
        out[r0:r0 + ql] = o.transpose(0, 1)
        r0 += ql
    return out


CASES = [
    dict(context_lengths=[5, 17, 33]),
    dict(context_lengths=[20, 3], v_layout="5d", scales="token", Hq=4, Hkv=4),
    dict(context_lengths=[9, 40], query_length=3, sliding_window=7, Hq=8, Hkv=2),
    dict(context_lengths=[18, 1], sinks=True, block_size=16, fp8_dtype=torch.float8_e4m3fnuz),
    dict(context_lengths=[70], block_size=64, v_layout="5d", query_length=2, sinks=True, sliding_window=30),
    dict(context_lengths=[12, 30, 7], query_lengths=[4, 1, 7], scales="token"),
    dict(context_lengths=[16, 0], query_lengths=[3, 0]),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_reference_matches_independent(params):
    case = make_pa_case(**params, D=64, seed=3)
    out = case.call("torch")
    ref = independent(case)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 8e-3, err  # one bf16 rounding of the output


def test_prefill_with_equal_lengths_is_decode():
    dec = make_pa_case([10, 33, 21], query_length=2, scales="token", seed=5)
    pre = make_pa_case([10, 33, 21], query_lengths=[2, 2, 2], scales="token", seed=5)
    assert torch.equal(dec.call("torch"), pre.call("torch"))


@pytest.mark.parametrize("ql,scales,Hq", [(1, "tensor", 4), (3, "token", 8)])
def test_benchmark_baseline_matches_reference(ql, scales, Hq):
    """The bench's gather + SDPA baseline computes the same attention as the reference."""
    from pa_backend import pa_decode
    from pa_backend.benchmark import bench_case, gather_sdpa

    kw = bench_case(3, 64, ql, Hq, 2, 64, 16, scales, "cpu")
    ref = pa_decode(**kw, backend="torch").double()
    base = gather_sdpa(**kw).double()
    assert ((base - ref).norm() / ref.norm()).item() < 2e-2
    junk = torch.full((3, 28), 10**6, dtype=torch.int32)  # a server-width table: garbage past the context
    wide = dict(kw, block_tables=torch.cat([kw["block_tables"], junk], 1))
    assert torch.equal(gather_sdpa(**wide, ctx=64).double(), base)
    from pa_backend.benchmark import accuracy

    assert accuracy(kw, ref.to(torch.bfloat16)) < 5e-3  # the bench's accuracy column: bf16 rounding only
    assert accuracy(kw, torch.zeros_like(kw["query"])) == pytest.approx(1.0)


def test_benchmark_prefill_baseline_and_accuracy():
    """Prefill rows of the bench: equal new-token counts behind a prefix; the baseline's causal mask
    is offset by the prefix like the op's."""
    from pa_backend import pa_prefill
    from pa_backend.benchmark import accuracy, bench_case, gather_sdpa

    kw = bench_case(2, 48, 20, 4, 2, 64, 16, "tensor", "cpu")
    kw.pop("query_length")
    kw["query_start_loc"] = torch.tensor([0, 20, 40], dtype=torch.int32)
    ref = pa_prefill(**kw, backend="torch")
    assert accuracy(kw, ref) < 5e-3
    base = gather_sdpa(**{**kw, "query_length": 20}).double()
    assert ((base - ref.double()).norm() / ref.double().norm()).item() < 2e-2


def test_bench_layer_sets_copy_what_fits():
    """The bench's graph rows cycle over layers with their own caches: as many copies as fit in the
    given share of free memory, at most one per call; each copy its own storage and other values than
    layer 0 (pages and query rolled, 0-d scales rescaled), so a launch that reads another layer's
    tensor computes another output; nothing to copy into off CUDA (free 0)."""
    from pa_backend.benchmark import bench_case, layer_sets

    kw = bench_case(2, 48, 1, 4, 2, 64, 16, "token", "cpu")
    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    # every tensor of a layer counts, plus its output (the query's size)
    per = sum(t.numel() * t.element_size() for t in args.values()) + args["query"].numel() * 2
    assert layer_sets(args, 16) == [args]  # CPU: free 0
    assert len(layer_sets(args, 16, share=1.0, free=3 * per)) == 4
    assert len(layer_sets(args, 16, share=1.0, free=3 * per - 1)) == 3
    assert len(layer_sets(args, 2, share=1.0, free=10 * per)) == 2
    sets = layer_sets(args, 3, share=0.5, free=10 * per)
    assert len(sets) == 3 and sets[0] is args
    for j, other in enumerate(sets[1:], 1):
        for k, t in args.items():
            assert other[k].data_ptr() != t.data_ptr() and other[k].shape == t.shape and other[k].dtype == t.dtype
            assert not torch.equal(other[k].view(torch.uint8), t.view(torch.uint8)), k
            want = t.view(torch.uint8).roll((j, j), dims=(0, 1)) if k == "query" else t.view(torch.uint8).roll(j, 0)
            assert torch.equal(other[k].view(torch.uint8), want), k
    assert not torch.equal(sets[1]["key_cache"].view(torch.uint8), sets[2]["key_cache"].view(torch.uint8))
    kt = bench_case(2, 48, 1, 4, 2, 64, 16, "tensor", "cpu")
    tensor_args = {k: kt[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    three = layer_sets(tensor_args, 3, share=1.0, free=1 << 30)
    scales = [s["key_scale"] for s in three]
    assert all(s.dim() == 0 and torch.equal(s, tensor_args["key_scale"] * (1 + j / 8)) for j, s in enumerate(scales))
    assert len({float(s) for s in scales}) == 3
    one = dict(tensor_args, key_scale=tensor_args["key_scale"].reshape(1))  # a [1] scale is per-tensor too
    assert torch.equal(layer_sets(one, 2, share=1.0, free=1 << 30)[1]["key_scale"], one["key_scale"] * 1.125)


@pytest.mark.skipif(not REGISTRY.supported_on("triton", "cpu"),
                    reason="the Triton rows run on CPU tensors, which Triton takes only through its interpreter (off "
                           "where a GPU is visible; there the device script's bench-pa step runs the real rows)")
def test_bench_graph_rows_check_what_every_layer_replayed(monkeypatch):
    """run_bench's plumbing on CPU (the kernels on the interpreter or torch, the GPU parts stubbed; the
    stubbed graph runs the calls once as the warm-up, then ``after_capture``, then once as the replay):
    every graph row's calls cycle over the layer copies (call i on copy i % n, each its own output), the
    copies are sized beside the baseline's temporaries, and each layer's replayed output is checked
    against its own reference. Faults that must show: a replay that reads layer 0's cache in every layer
    (MISSES), a replay that writes nothing (inf: the outputs are poisoned after the capture) and rows
    that never write their outputs after another row filled them (inf: each row starts poisoned)."""
    import pa_backend
    import pa_backend.benchmark as bm
    from backend_core.timing import BenchContext, Timing

    calls = 5
    seen, log = {}, []
    replaying = [False]
    # graph rows in order: 0 torch decode, 1 triton decode, 2 gather decode, 3 torch mixed, 4 triton mixed,
    # 5 torch prefill, 6 triton prefill, 7 gather prefill
    faults = {1: "stale", 4: "skip", 6: "no-replay"}

    class Spy:  # records which caches and output each plan.run call got; injects the row's fault
        def __init__(self, plan):
            self.plan, self.first = plan, None

        def run(self, **kw):
            fault = faults.get(len(seen))
            if self.first is None:
                self.first = kw["key_cache"]
            if fault == "stale" and replaying[0]:
                kw = {**kw, "key_cache": self.first}
            log.append((kw["key_cache"].data_ptr(), kw["value_cache"].data_ptr(), kw["query"].data_ptr(),
                        kw["out"].data_ptr()))
            return kw["out"] if fault == "skip" else self.plan.run(**kw)

    for name in ("plan_decode", "plan_prefill"):
        real = getattr(pa_backend, name)
        monkeypatch.setattr(pa_backend, name, lambda *a, real=real, **k: Spy(real(*a, **k)))
    # eager rows in order: 0 torch decode, 1 triton decode, 2 torch mixed, 3 triton mixed; row 1 never
    # writes its output, which still held the triton graph row's layer 0 (right) before the row's poison
    eager_seen, real_decode = [], pa_backend.pa_decode
    monkeypatch.setattr(pa_backend, "pa_decode",
                        lambda *a, **k: k["out"] if len(eager_seen) == 1 else real_decode(*a, **k))

    def eager(fn, trials, device=None):
        fn(0)
        eager_seen.append(1)
        return Timing(1.0, 1.0, 1.0, 1, 1)

    def graph(fn, inner, trials, device=None, after_capture=None):
        for i in range(inner):  # the warm-up (eager) calls
            fn(i)
        if after_capture is not None:
            after_capture()
        del log[:]
        replaying[0] = True
        if faults.get(len(seen)) != "no-replay":
            for i in range(inner):
                fn(i)
        replaying[0] = False
        seen[len(seen)] = list(log)
        return Timing(1.0, 1.0, 1.0, 1, inner)

    decode = (2, 48, 1, 4, 2, 64, 16, "tensor")
    kw = bm.bench_case(*decode, "cpu")
    per_layer = sum(kw[k].numel() * kw[k].element_size() for k in ("query", "key_cache", "value_cache", "query"))
    need = 8 * 2 * 48 * 2 * 64 + 4 * 2 * 4 * 1 * 48
    free = int(need / 0.6) + int(2 * per_layer / 0.4) + 1  # 2 copies fit beside the baseline: 3 layers
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, 2 * free))
    monkeypatch.setattr(bm, "bench_context", lambda progress: BenchContext(torch.device("cpu"), "cpu", "x", "d", 1.0))
    monkeypatch.setattr(bm, "time_cuda_graph", graph)
    monkeypatch.setattr(bm, "time_eager", eager)
    monkeypatch.setattr(bm, "host_overhead", lambda *a, **k: {})
    monkeypatch.setattr(bm, "EXACT_CONFIGS", [])
    monkeypatch.setattr(bm, "MIXED_CONFIG", (2, (5, 40), 1, 4, 2, 64, 16, "tensor"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = bm.run_bench(impls=("torch", "triton"), configs=[decode],
                        prefill_configs=[(2, 16, 16, 4, 2, 64, 16, "tensor")],
                        trials=1, table_tokens=256, progress=lambda *a: None, calls_per_graph=calls)
    graph_rows = [r for r in rows if "graph timing" in r["notes"]]
    assert [(r["op"], r["impl"]) for r in graph_rows] == [
        ("pa_decode", "torch"), ("pa_decode", "triton"), ("pa_decode", "torch_gather_sdpa"),
        ("pa_decode", "torch"), ("pa_decode", "triton"),
        ("pa_prefill", "torch"), ("pa_prefill", "triton"), ("pa_prefill", "torch_gather_sdpa")]
    assert "(5 calls per replay, 3 layers' caches)" in graph_rows[0]["notes"]
    err = {k: float(r["notes"].split()[0].split("=")[1]) for k, r in enumerate(graph_rows) if k not in (2, 7)}
    # layer 0's cache read by every layer: a finite error far past the target (1.4 here; the faultless
    # interpreter row is ~3e-3); no write, no replay: inf
    assert 0.1 < err[1] < float("inf") and "MISSES" in graph_rows[1]["notes"]
    assert err[4] == err[6] == float("inf")
    # the faultless rows (torch, whose results the triton rows' outputs held before) keep their own error
    assert all(err[k] < bm.ACCURACY_TARGET for k in (0, 3, 5)), err
    eager_err = [float(r["notes"].split()[0].split("=")[1]) for r in rows if "eager timing" in r["notes"]]
    assert len(eager_err) == 4 and eager_err[1] == float("inf") and max(eager_err[::2] + eager_err[3:]) < 1e-2
    # call i reads layer i % n's caches and query and writes its output, each layer its own storage; the
    # decode case has 3 layers beside its baseline, the mixed one (no baseline) as many as calls
    for k, n in ((0, 3), (3, calls), (5, None)):
        got = seen[k]
        n = n or len(set(got))
        assert len(got) == calls and len(set(got)) == n >= 2 and got == [got[i % n] for i in range(calls)]
        for j in range(4):  # no two layers share a cache, query or output
            assert len({g[j] for g in got}) == n


def test_bench_rejects_zero_calls_per_graph():
    """``bench pa --calls-per-graph 0`` is refused before anything runs (no GPU needed)."""
    from pa_backend.benchmark import run_bench

    with pytest.raises(ValueError, match="calls_per_graph"):
        run_bench(calls_per_graph=0, progress=lambda *a: None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
def test_reference_per_token_scales_are_ieee_quotients(device):
    """The reference writer's per-token scale is amax / fp8_max correctly rounded on every device (the
    exact quotient, from float64, rounded once to float32). torch's CUDA division by a Python number
    multiplies by its reciprocal, an ulp off for about half of the tokens: Triton's write_kv (IEEE
    div_rn) was then not byte-equal to the reference on the GPU."""
    from pa_backend import write_kv
    from pa_backend.fp8 import fp8_dtype_for, fp8_max

    fp8 = fp8_dtype_for(torch.device(device))
    NB, Hkv, D, bs, T = 8, 2, 64, 16, 100
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(T, Hkv, D, generator=g) * 3).bfloat16()
    v = (torch.randn(T, Hkv, D, generator=g) * 2).bfloat16()
    kc = torch.zeros(NB, Hkv, D // 16, bs, 16, dtype=torch.uint8).view(fp8)
    vc = torch.zeros(NB, Hkv, D, bs, dtype=torch.uint8).view(fp8)
    ks, vs = torch.full((NB, Hkv, bs), float("nan")), torch.full((NB, Hkv, bs), float("nan"))
    slots = torch.randperm(NB * bs, generator=g)[:T]
    dev = [t.to(device) for t in (k, v, kc, vc, slots, ks, vs)]
    write_kv(*dev[:5], *dev[5:], backend="torch")
    fmax = fp8_max(fp8)
    for x, scale in ((k, dev[5].cpu()), (v, dev[6].cpu())):
        want = (x.double().abs().amax(-1) / fmax).float()  # [T, Hkv]
        got = scale[slots // bs, :, slots % bs]
        assert torch.equal(got, want), int((got != want).sum())
