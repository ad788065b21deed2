"""Plan once per batch, run per layer; work that follows the real context (issue 15, docs/design.md §4.1).

CPU: the Triton kernels through the interpreter and the reference. The CUDA-graph and host-sync
cases are GPU-marked (run on the device).
"""

import pytest
import torch

from pa_backend import REGISTRY, pa_decode, plan_decode, plan_prefill
from pa_backend.cases import make_pa_case
from pa_backend.verify import tolerance

from .test_triton import rel_to_reference

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0],
                                                                  reason="triton not usable here"))]
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LAYER_ARGS = ("query", "key_cache", "value_cache", "key_scale", "value_scale")


def widen(case, extra_blocks: int = 300):
    """The case's block table with ``extra_blocks`` more columns of garbage: ids of NaN pages, of
    other sequences' pages and ids far past the cache — none may be dereferenced."""
    bt = case.kwargs["block_tables"]
    NB = case.kwargs["key_cache"].shape[0]
    g = torch.Generator().manual_seed(5)
    junk = torch.randint(0, NB, (bt.shape[0], extra_blocks), generator=g, dtype=torch.int32)
    junk[:, ::3] = 10**7  # far past the cache
    return torch.cat([bt, junk.to(bt.device)], 1)


def prefill_case(**kw):
    return make_pa_case([40, 7, 90], query_lengths=[40, 3, 17], Hq=4, Hkv=2, D=64, extra_table=0, device=DEVICE,
                        seed=3, **kw)


def decode_case(**kw):
    return make_pa_case([40, 7, 130, 0], query_length=kw.pop("query_length", 1), Hq=8, Hkv=2, D=64, extra_table=0,
                        device=DEVICE, seed=4, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["decode", "decode-ql3", "prefill", "window-sinks"])
def test_wide_table_is_bit_identical_to_exact(impl, kind):
    """A server-width table (garbage past each context) gives exactly the exact-width output."""
    if kind == "prefill":
        c = prefill_case()
    elif kind == "window-sinks":
        c = decode_case(sliding_window=37, sinks=True, scales="token")
    else:
        c = decode_case(query_length=3 if kind == "decode-ql3" else 1)
    exact = c.call(impl, out=None)
    wide = c.call(impl, out=None, block_tables=widen(c))
    assert torch.isfinite(exact).all()
    assert torch.equal(exact, wide)
    # through a shape-only plan: the same bytes. A plan bounded by the batch's max context does not split
    # short contexts of a small batch (one partition each, written without a reduce: planner.plan_partitions'
    # small_split), so its bytes may differ from the shape-only split's: its rounding is checked instead
    bt = widen(c)
    kw = c.kwargs
    args = {k: kw[k] for k in LAYER_ARGS}
    scal = dict(sliding_window=kw.get("sliding_window", 0), sinks=kw.get("sinks"))
    if c.prefill:
        plans = [plan_prefill(bt, kw["query_start_loc"], kw["context_lengths"], backend=impl),
                 plan_prefill(bt, kw["query_start_loc"], kw["context_lengths"],
                              query_start_loc_host=kw["query_start_loc"].tolist(), max_context=90, backend=impl)]
    else:
        plans = [plan_decode(bt, kw["context_lengths"], query_length=kw["query_length"], backend=impl),
                 plan_decode(bt, kw["context_lengths"], query_length=kw["query_length"], max_context=130, backend=impl)]
    assert torch.equal(plans[0].run(**args, **scal), exact)
    assert rel_to_reference(c, plans[1].run(**args, **scal)) <= tolerance(DEVICE)
    assert rel_to_reference(c, exact) <= tolerance(DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_is_reused_across_layers(impl):
    """One plan, several layers with their own caches, queries, outputs and scalars: each equals
    the eager op on that layer; the launch state is made once."""
    layers = [decode_case(scales=s) for s in ("tensor", "token")]  # same batch layout (same seed): two caches
    base = layers[0].kwargs
    plan = plan_decode(widen(layers[0]), base["context_lengths"], backend=impl)
    g = torch.Generator().manual_seed(9)
    for i, c in enumerate(layers * 2):
        kw = dict(c.kwargs, query=torch.randn(base["query"].shape, generator=g).bfloat16().to(DEVICE))
        out = torch.full_like(kw["query"], float("nan"))
        got = plan.run(*(kw[k] for k in LAYER_ARGS), softmax_scale=0.1 + 0.05 * i, out=out)
        assert got is out
        want = pa_decode(**dict(kw, out=None), softmax_scale=0.1 + 0.05 * i, backend=impl)
        assert torch.equal(got, want)
    if impl == "triton":
        assert len(plan.state) == 1  # one layer shape: launch state made once


def test_plan_checks_layer_arguments_against_the_batch():
    c = decode_case()
    kw = c.kwargs
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="torch")
    with pytest.raises(ValueError, match="query: expected 4 sequences x query_length 1"):
        plan.run(kw["query"][:2], *(kw[k] for k in LAYER_ARGS[1:]))
    with pytest.raises(ValueError, match="out: shares memory with query"):
        plan.run(*(kw[k] for k in LAYER_ARGS), out=kw["query"])
    p = prefill_case()
    with pytest.raises(ValueError, match="query_start_loc_host: expected non-decreasing"):
        plan_prefill(p.kwargs["block_tables"], p.kwargs["query_start_loc"], p.kwargs["context_lengths"],
                     query_start_loc_host=[0, 40, 30, 60])
    plan = plan_prefill(p.kwargs["block_tables"], p.kwargs["query_start_loc"], p.kwargs["context_lengths"],
                        query_start_loc_host=p.kwargs["query_start_loc"].tolist())
    with pytest.raises(ValueError, match="query_start_loc: the last offset 60 is past the query's 59 rows"):
        plan.run(p.kwargs["query"][:59], *(p.kwargs[k] for k in LAYER_ARGS[1:]))
    with pytest.raises(ValueError, match="max_context: expected None or an int >= 0"):
        plan_decode(kw["block_tables"], kw["context_lengths"], max_context=-1)


@pytest.mark.parametrize("backend, exc, msg", [
    ("", ValueError, "backend: '' is not an implementation"),
    (0, TypeError, "backend: expected None or a str"),
    (["torch"], TypeError, "backend: expected None or a str"),
])
def test_run_refuses_a_bad_backend_naming_it(backend, exc, msg):
    """A falsy override did not fall back to the plan's choice silently, nor a list fail unhashable in the memo."""
    c = decode_case()
    kw = c.kwargs
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="torch")
    with pytest.raises(exc, match=msg):
        plan.run(*(kw[k] for k in LAYER_ARGS), backend=backend)
    with pytest.raises(TypeError, match="backend: expected a str"):
        plan_decode(kw["block_tables"], kw["context_lengths"], backend=0)


def test_run_refuses_a_before_launch_that_is_not_callable():
    c = decode_case()
    kw = c.kwargs
    before = [kw[k].clone() for k in ("key_cache", "value_cache")]
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="torch")
    with pytest.raises(TypeError, match="before_launch: expected None or a callable, got int"):
        plan.run(*(kw[k] for k in LAYER_ARGS), before_launch=5)
    assert all(torch.equal(a.view(torch.uint8), kw[k].view(torch.uint8))
               for a, k in zip(before, ("key_cache", "value_cache")))
    seen = []
    plan.run(*(kw[k] for k in LAYER_ARGS), before_launch=lambda: seen.append(1))
    assert seen == [1]


def test_decode_partitions_follow_the_context():
    """The split is made per sequence on the device: with a huge table and a short context every
    sequence still uses the partitions its own context needs (checked through the kernel's helper
    rule, mirrored here), and the grid's P does not grow without bound."""
    from pa_backend.planner import MAX_PARTITIONS, plan_partitions

    sp_wide = plan_partitions(32, 8, 1 << 17, 132)
    sp_exact = plan_partitions(32, 8, 2048, 132)

    for span in (1, 100, 2048, 30000):
        if span <= 2048:
            assert split_count(span, sp_wide) == split_count(span, sp_exact)
    assert sp_wide.P <= MAX_PARTITIONS


def split_count(span, sp):
    """The kernels' per-sequence partition count (pa_decode.py _partition_span), mirrored."""
    import math

    p = min(max(-(-span // sp.long_tokens), sp.few), -(-span // sp.min_tokens))
    p = max(p, min(math.isqrt(span // 8), sp.short))
    return max(1, min(sp.P, p))


def test_small_work_splits_short_contexts():
    """Few (sequence, KV head) pairs: contexts under the 256-token floor still split, into partitions of about
    sqrt(8 x span) tokens, at most SHORT_TASKS_PER_SM x SMs / pairs per sequence; larger work keeps the floor,
    and long contexts the usual split."""
    from pa_backend.planner import SHORT_TASKS_PER_SM, plan_partitions

    small = plan_partitions(16, 2, 1 << 17, 132, programs_per_sm=32, few_per_sm=8)  # the one-warp policy
    assert small.short == SHORT_TASKS_PER_SM * 132 // 32
    assert [split_count(s, small) for s in (100, 128, 512, 2048, 8192)] == [3, 4, 8, 16, 32]
    assert split_count(128, plan_partitions(16, 2, 1024, 132, programs_per_sm=32, few_per_sm=8)) == 4
    big = plan_partitions(64, 8, 1 << 17, 132, programs_per_sm=32, few_per_sm=8)
    assert big.short == 1 and [split_count(s, big) for s in (128, 512)] == [1, 2]
    assert plan_partitions(4, 1, 4096, 132, requested=4).short == 1  # a requested split is taken as asked


@pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0], reason="triton is not installed")
def test_small_work_split_is_for_shape_only_decode_plans():
    """The Triton launches take the small-work split only in shape-only decode plans (measured there):
    prefill's work items and plans bounded by a max context keep the 256-token floor (short == 1)."""
    def shorts(plan, c):
        kw = c.kwargs
        plan.run(**{k: kw[k] for k in LAYER_ARGS})
        return [st.split.short for st in plan.state.values()]

    d, pf = decode_case(), prefill_case()
    dk, pk = d.kwargs, pf.kwargs
    assert shorts(plan_decode(dk["block_tables"], dk["context_lengths"], backend="triton"), d)[0] > 1
    assert shorts(plan_decode(dk["block_tables"], dk["context_lengths"], max_context=130, backend="triton"), d) == [1]
    assert shorts(plan_prefill(pk["block_tables"], pk["query_start_loc"], pk["context_lengths"],
                               query_start_loc_host=pk["query_start_loc"].tolist(), backend="triton"), pf) == [1]


# --- GPU: CUDA graphs and host syncs -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.gpu
def test_graph_replay_wide_table_equals_exact_eager(kind):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    c = prefill_case() if kind == "prefill" else decode_case()
    kw = c.kwargs
    exact = c.call("triton", out=None)
    bt = widen(c, 8000)  # 128k tokens of garbage columns
    out = torch.full_like(kw["query"], float("nan"))
    args = {k: kw[k] for k in LAYER_ARGS}
    cl = kw["context_lengths"].clone()
    if c.prefill:
        plan = plan_prefill(bt, kw["query_start_loc"], cl, query_start_loc_host=kw["query_start_loc"].tolist(),
                            backend="triton")
    else:
        plan = plan_decode(bt, cl, backend="triton")
    plan.run(**args, out=out)  # warm-up: compiles, allocates the launch state
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(**args, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, exact)
    if not c.prefill:  # contexts refilled in place: the captured kernels split the new contexts
        new = torch.tensor([3, 7, 129, 16], dtype=torch.int32, device=DEVICE)
        cl.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = c.call("triton", out=None, context_lengths=new)
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_multi_layer_step_does_not_sync_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    c = prefill_case()
    d = decode_case()
    pp = plan_prefill(widen(c), c.kwargs["query_start_loc"], c.kwargs["context_lengths"],
                      query_start_loc_host=c.kwargs["query_start_loc"].tolist(), backend="triton")
    pd = plan_decode(widen(d), d.kwargs["context_lengths"], max_context=130, backend="triton")
    outs = [torch.empty_like(x.kwargs["query"]) for x in (c, d)]
    for plan, x, o in ((pp, c, outs[0]), (pd, d, outs[1])):
        plan.run(*(x.kwargs[k] for k in LAYER_ARGS), out=o)  # first layer: launch state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):  # eight layers of a mixed step
            for plan, x, o in ((pp, c, outs[0]), (pd, d, outs[1])):
                plan.run(*(x.kwargs[k] for k in LAYER_ARGS), out=o)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[1]).all()


def test_layer_checks_are_memoized_and_still_reject_bad_arguments(monkeypatch):
    """A server's layers pass the same addresses, shapes and strides every step: ``plan.run`` and
    ``write_kv`` check each distinct argument set in full once, later calls only rebuild the problem
    around the caller's tensors. Any argument the checks read that differs (a bool for an int, an
    overlapping ``out``, another shape) is checked again, and rejected."""
    import pa_backend.contract as contract
    from pa_backend import write_kv

    calls = {"layer": 0, "write": 0}
    full_layer, full_write = contract._check_layer, contract._prepare_write

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(contract, "_CALL_MEMO", type(contract._CALL_MEMO)())  # (earlier tests' buffers)
    monkeypatch.setattr(contract, "_check_layer", count("layer", full_layer))
    monkeypatch.setattr(contract, "_prepare_write", count("write", full_write))
    c = decode_case()
    kw = c.kwargs
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="torch")
    out = torch.empty_like(kw["query"])
    first = plan.run(*(kw[k] for k in LAYER_ARGS), softmax_scale=0.125, out=out).clone()
    for _ in range(3):
        assert torch.equal(plan.run(*(kw[k] for k in LAYER_ARGS), softmax_scale=0.125, out=out), first)
    assert calls["layer"] == 1
    with pytest.raises(TypeError, match="sliding_window: expected an int"):
        plan.run(*(kw[k] for k in LAYER_ARGS), softmax_scale=0.125, sliding_window=True, out=out)
    with pytest.raises(ValueError, match="out: shares memory with query"):
        plan.run(*(kw[k] for k in LAYER_ARGS), softmax_scale=0.125, out=kw["query"])
    with pytest.raises(ValueError, match="query: expected 4 sequences"):
        plan.run(kw["query"][:3], *(kw[k] for k in LAYER_ARGS[1:]), softmax_scale=0.125)
    with pytest.raises(ValueError, match="softmax_scale"):
        plan.run(*(kw[k] for k in LAYER_ARGS), softmax_scale=-1.0, out=out)
    assert calls["layer"] == 5

    key = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    val = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([1, 17, -1], dtype=torch.int64, device=DEVICE)
    caches = [kw[k].clone() for k in ("key_cache", "value_cache")]
    calls["write"] = 0  # (making the case wrote its caches)
    for _ in range(3):
        write_kv(key, val, *caches, slots, kw["key_scale"], kw["value_scale"], backend="torch")
    assert calls["write"] == 1
    with pytest.raises(ValueError, match="slot_mapping: expected dtype"):
        write_kv(key, val, *caches, slots.int().float(), kw["key_scale"], kw["value_scale"], backend="torch")
    overlapping = caches[0].view(torch.uint8).view(-1)[:3 * 2 * 64 * 2].view(torch.bfloat16).view(3, 2, 64)
    with pytest.raises(ValueError, match="shares memory"):  # a key inside the key cache's bytes
        write_kv(overlapping, val, *caches, slots, kw["key_scale"], kw["value_scale"], backend="torch")
    assert calls["write"] == 3


def test_memoized_checks_keep_no_tensor_alive():
    """The memo holds numbers only: a server that frees its caches gets the memory back."""
    import gc
    import weakref

    c = decode_case()
    kw = dict(c.kwargs)
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="torch")
    kc = kw.pop("key_cache")
    plan.run(kw["query"], kc, *(kw[k] for k in LAYER_ARGS[2:]))
    ref = weakref.ref(kc)
    del kc, c
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("change", ["resize", "restride"])
def test_a_plan_refuses_a_batch_changed_in_place(change):
    """Refilling the batch tensors' values between runs is the contract (CUDA graphs); resizing or re-striding
    them in place is not: the kernels would read the planned shape's rows of the new storage."""
    case = make_pa_case([20, 33], D=64, extra_table=2)
    kw = dict(case.kwargs)
    bt, cl = kw["block_tables"].clone(), kw["context_lengths"].clone()
    plan = plan_decode(bt, cl, backend="torch")
    args = [kw[k] for k in LAYER_ARGS]
    plan.run(*args)
    cl.fill_(5)
    plan.run(*args)  # new values: fine
    if change == "resize":
        bt.resize_(1, bt.shape[1])
    else:
        bt.as_strided_(bt.shape, (1, bt.shape[0]))
    with pytest.raises(ValueError, match="make a new plan"):
        plan.run(*args)


BOUND_KINDS = ["decode-queue", "decode-one-partition", "decode-one-partition-sinks", "decode-split", "prefill",
               "window-sinks-token"]


def _layers_through_one_plan(kind, taken):
    """Four layers through one plan, twice (two steps). Layers 0-2 share one signature, each with its own
    query, caches (K and / or V with their signs flipped: other values at other addresses), scales and
    sinks; layer 3 is layer 0's tensors with another softmax scale (another signature: its own launches).
    Each layer's output must equal a fresh plan's run of that layer alone, which builds every argument, and
    in the second step every layer's partition launch must have gone through a bound launch.
    ``taken``: the bound launches' (kernel name, launched) records."""
    c = (prefill_case() if kind == "prefill"
         else decode_case(sliding_window=37, sinks=True, scales="token") if kind == "window-sinks-token"
         else decode_case(sinks=True) if kind == "decode-one-partition-sinks"
         else decode_case())
    kw = c.kwargs
    bt = widen(c)
    opts = {"decode-one-partition": {"max_context": 130}, "decode-one-partition-sinks": {"max_context": 130},
            "decode-split": {"max_context": 100000}}.get(kind, {})

    def make_plan():
        if c.prefill:
            return plan_prefill(bt, kw["query_start_loc"], kw["context_lengths"],
                                query_start_loc_host=kw["query_start_loc"].tolist(), backend="triton", **opts)
        return plan_decode(bt, kw["context_lengths"], backend="triton", **opts)

    def flipped(cache, flip):  # FP8 e4m3 with the sign bit flipped: the negated values (NaN stays NaN)
        return (cache.view(torch.uint8) ^ 0x80).view(cache.dtype) if flip else cache.clone()

    sinks = kw.get("sinks")
    layers = []
    for i in range(3):  # 1: K negated, 2: V negated
        layers.append(dict(query=kw["query"] * (0.5 + 0.25 * i), key_cache=flipped(kw["key_cache"], i & 1),
                           value_cache=flipped(kw["value_cache"], i & 2), key_scale=kw["key_scale"] * (1 + i),
                           value_scale=kw["value_scale"] * (2.0 ** i), sliding_window=kw.get("sliding_window", 0),
                           sinks=None if sinks is None else sinks + 0.5 * i))
    layers.append(dict(layers[0], softmax_scale=0.05))
    plan = make_plan()
    outs = [torch.full_like(kw["query"], float("nan")) for _ in layers]
    for step in range(2):  # the second step: every layer bound (the queue's grid is known after one launch)
        first = len(taken)
        for a, o in zip(layers, outs):
            o.fill_(float("nan"))
            plan.run(**a, out=o)
    second = taken[first:]
    wants = [make_plan().run(**a, out=torch.full_like(o, float("nan"))) for a, o in zip(layers, outs)]
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for i, (o, want) in enumerate(zip(outs, wants)):
        assert torch.isfinite(want).all()
        assert torch.equal(o, want), f"layer {i}"
    for i in (1, 2, 3):
        assert not torch.equal(outs[0], outs[i]), f"layer {i}: the layers' values differ"
    partitions = [ok for name, ok in second if name == "pa_decode_partition_kernel"]
    assert partitions == [True] * len(layers), second  # every layer of the second step, none refused
    assert all(ok for _, ok in taken), taken


@pytest.mark.parametrize("kind", [k for k in BOUND_KINDS if k != "decode-split"])  # the queue has a reduce too
def test_later_layers_launch_bound_with_their_own_tensors_interpreter(kind, monkeypatch):
    """The plan's bound-launch wiring on the interpreter: ``bind`` replaced by a stand-in that keeps the first
    call's arguments (tensors included) and puts in only the tensors at the positions the implementation says
    vary; a position missing from them would run a later layer on the first layer's tensors."""
    from pa_backend.triton import pa_decode_launch

    if not REGISTRY.get("triton").is_available()[0]:
        pytest.skip("triton not usable here")
    from backend_core.tests.testing import kept_args_binder

    taken = []
    monkeypatch.setattr(pa_decode_launch, "bind", kept_args_binder(taken))
    _layers_through_one_plan(kind, taken)


@pytest.mark.parametrize("kind", BOUND_KINDS)
@pytest.mark.gpu
def test_later_layers_launch_bound_with_their_own_tensors(kind):
    """The same on the GPU with backend_core.launch.Bound (only the addresses put in)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from backend_core import launch as launch_mod
    from backend_core.tests.testing import bound_launches

    if not launch_mod.enabled:
        pytest.skip("the direct launch is switched off (FLYDSL_BACKENDS_TRITON_DIRECT=0)")
    with bound_launches() as taken:
        _layers_through_one_plan(kind, taken)
