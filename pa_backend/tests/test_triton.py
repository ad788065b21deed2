"""The Triton paged-attention decode kernel against the float64 reference (interpreter on CPU)."""

import dataclasses

import pytest
import torch

from pa_backend import REGISTRY
from pa_backend.cases import make_pa_case
from pa_backend.contract import prepare_attention
from pa_backend.reference import run_attention
from pa_backend.verify import tolerance

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
pytestmark = pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0], reason="triton not usable here")


def rel_to_reference(case, out):
    """Relative error of ``out`` against the float64 reference of ``case`` (its inputs as built)."""
    kw = dict(case.kwargs)
    kw.pop("out", None)
    ref = torch.empty(kw["query"].shape, dtype=torch.float64, device=out.device)
    run_attention(dataclasses.replace(prepare_attention(**kw, prefill=case.prefill), out=ref),
                  compute_dtype=torch.float64)
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(params, seed=0, **call):
    case = make_pa_case(**params, device=DEVICE, seed=seed)
    out = case.call("triton", **call)
    assert torch.isfinite(out).all()
    err = rel_to_reference(case, out)
    assert err <= tolerance(DEVICE), (case.desc, err)
    return out


@pytest.mark.parametrize("v_layout", ["4d", "5d"])
@pytest.mark.parametrize("scales", ["tensor", "token"])
@pytest.mark.parametrize("ql", [1, 3])
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_grid(v_layout, scales, ql, gqa):
    check(dict(context_lengths=[3, 35, 17], query_length=ql, Hq=2 * gqa, Hkv=2, D=64, block_size=16,
               v_layout=v_layout, scales=scales), seed=ql * 10 + gqa)


def _launches(monkeypatch, **forced):
    """Every Triton launch state (``Launch``) made while ``monkeypatch`` holds, with the ``forced`` attributes
    set after its own init (launch facts the interpreter's device lacks, e.g. NVIDIA's SM count)."""
    from pa_backend.triton.launch_state import Launch

    made = []
    init = Launch.__init__

    def forcing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for name, value in forced.items():
            setattr(self, name, value)
        made.append(self)

    monkeypatch.setattr(Launch, "__init__", forcing)
    return made


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU takes this path by itself (test_decode_grid there)")
@pytest.mark.parametrize("params", [
    dict(context_lengths=[3, 35, 17], query_length=3, Hq=8, Hkv=2, D=64, v_layout="4d", scales="token"),
    dict(context_lengths=[3, 35, 17], query_length=1, Hq=2, Hkv=2, D=64, v_layout="5d", scales="tensor"),
    dict(context_lengths=[70, 1], query_length=2, Hq=4, Hkv=1, D=64, block_size=64, v_layout="4d", sinks=True),
])
def test_nvidia_v_clear_on_the_interpreter(params, monkeypatch):
    """The NVIDIA path clears V's NaN bytes (unused slots of a live page) with maxNum, which the interpreter
    runs as a GPU does (backend_core.interpreter.faithful_maxnum): forced on here (its per-SM queue counters
    off: the interpreter has no %smid), against the reference with NaN in every unused slot. Deleting that
    clear, or the interpreter's NaN-propagating maxNum, fails these."""
    from pa_backend.triton import launch_state, tiling

    monkeypatch.setattr(tiling, "v_maxnum", lambda device: True)
    monkeypatch.setattr(launch_state, "QUEUE_SM_SLOTS", 0)
    made = _launches(monkeypatch)
    check(params, seed=5)
    assert made and all(L.v_maxnum for L in made)


@pytest.mark.parametrize("sms", [1, 16, 108, 148])
def test_split_plans_of_other_gpus(sms, monkeypatch):
    """The split-K plan sizes its partitions from the SM count (132 on CPU, as an H100 / H200): an A100's 108,
    a B200's 148, a MIG slice's 16, and 1 give other partition counts, small-work splits and task spaces.
    Decode (a one-warp queue program and a 64-row program, 128k-style wide tables) and a ragged prefill
    against the float64 reference with NaN in every unused slot."""
    from backend_core import platform

    monkeypatch.setattr(platform, "sm_count", lambda device: sms)
    check(dict(context_lengths=[40, 1, 333, 97, 0, 260], Hq=8, Hkv=2, D=64, extra_table=20), seed=sms)
    check(dict(context_lengths=[300, 7], query_length=4, Hq=16, Hkv=1, D=64, scales="token"), seed=sms + 1)
    check(dict(context_lengths=[200, 30], query_lengths=[70, 30], Hq=4, Hkv=2, D=64, v_layout="5d"), seed=sms + 2)


@pytest.mark.parametrize("bs", [32, 48, 80, 96, 112])
@pytest.mark.parametrize("v_layout", ["4d", "5d"])
def test_decode_and_prefill_any_multiple_of_16_block(bs, v_layout):
    """Blocks that are not 16/64/128 (vLLM's --block-size): tiles of the block's largest power-of-two
    divisor, contexts ending mid-block and spanning several blocks; decode (ql 1 and 3) and ragged
    prefill against the float64 reference."""
    check(dict(context_lengths=[3, 2 * bs + 5, bs], query_length=1, Hq=4, Hkv=2, D=64, block_size=bs,
               v_layout=v_layout, scales="tensor"), seed=bs)
    check(dict(context_lengths=[bs + 7, 4], query_length=3, Hq=2, Hkv=2, D=128, block_size=bs, v_layout=v_layout,
               scales="token"), seed=bs + 1)
    check(dict(context_lengths=[bs + 9, 20], query_lengths=[bs + 9, 3], Hq=4, Hkv=2, D=64, block_size=bs,
               v_layout=v_layout, scales="tensor"), seed=bs + 2)


@pytest.mark.parametrize("extra", [dict(sliding_window=9), dict(sinks=True), dict(sinks=True, sliding_window=5),
                                   dict(block_size=64, context_lengths=[70, 1]), dict(D=128),
                                   dict(block_size=128, context_lengths=[200, 3]), dict(D=256, block_size=64),
                                   dict(fp8_dtype=torch.float8_e4m3fnuz)],
                         ids=["window", "sinks", "sinks+window", "bs64", "D128", "bs128-subtiles", "D256", "fnuz"])
def test_decode_features(extra):
    params = dict(context_lengths=[40, 6], query_length=2, Hq=4, Hkv=1, D=64)
    params.update(extra)
    if params.get("fp8_dtype") == torch.float8_e4m3fnuz and not (DEVICE.type == "cuda" and torch.version.hip):
        case = make_pa_case(**params, device=DEVICE)
        with pytest.raises(ValueError, match="float8_e4m3fnuz caches need an AMD GPU"):
            case.call("triton")
        return
    check(params)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_explicit_partitions_and_padded_sequence(parts):
    out = check(dict(context_lengths=[0, 50, 1], query_length=1, Hq=4, Hkv=2, D=64, sinks=True), num_partitions=parts)
    assert (out[0] == 0).all()  # a padded sequence (context 0) gives zeros


def test_reduce_rescales_from_the_max_of_every_partition():
    """20 partitions (the reduce's max pass loads 16 at a time): one key of partition 18 scores hundreds of
    nats above every other, so a merge that rescaled from the first 16 partitions' max would overflow."""
    from pa_backend.reference import dequantize_tokens

    case = make_pa_case(context_lengths=[640], query_length=1, Hq=4, Hkv=1, D=64, device=DEVICE, seed=3)
    kw = dict(case.kwargs)
    kw.pop("out")
    k, _ = dequantize_tokens(prepare_attention(**kw).cache, kw["block_tables"][0], 640)
    k600 = k[600, 0].double()
    q = (k600 / k600.dot(k600) * 500.0 * 8.0).to(kw["query"].dtype)  # q.k600 * D**-0.5 = 500
    kw["query"] = q.expand_as(kw["query"]).contiguous()
    scores = (k[:, 0].double() @ q.double()) / 8.0
    assert scores[600] - scores[torch.arange(640) != 600].max() > 100  # the case is what it claims
    ref = torch.empty(kw["query"].shape, dtype=torch.float64, device=DEVICE)
    run_attention(dataclasses.replace(prepare_attention(**kw), out=ref), compute_dtype=torch.float64)
    out = case.call("triton", query=kw["query"], num_partitions=20)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() <= tolerance(DEVICE)


def test_planner_is_shape_only_and_bounded():
    from pa_backend.planner import MAX_PARTITIONS, plan_partitions

    sp = plan_partitions(81, 1, 8192, 132)
    assert 81 * sp.P >= 4 * 132 and sp.P * sp.min_tokens <= 8192 + sp.min_tokens
    assert plan_partitions(81, 1, 8192, 132) == sp
    assert plan_partitions(1, 1, 16, 132).P == 1
    assert plan_partitions(4, 1, 4096, 132, requested=4).P == 4
    # a 128k-token table only raises the grid's upper bound; the device splits each real context
    assert plan_partitions(81, 1, 1 << 17, 132).P >= sp.P
    assert plan_partitions(1, 1, 1 << 20, 132).P <= MAX_PARTITIONS


@pytest.mark.parametrize("params", [
    dict(context_lengths=[12, 30, 7], query_lengths=[4, 1, 7]),
    dict(context_lengths=[50, 3], query_lengths=[45, 3], Hq=4, Hkv=1, scales="token", v_layout="5d"),  # 3 chunks
    dict(context_lengths=[20, 0, 64], query_lengths=[20, 0, 33], Hq=8, Hkv=2, sliding_window=10, sinks=True),
    dict(context_lengths=[130, 17], query_lengths=[70, 17], Hq=2, Hkv=2, block_size=64),  # 2 chunks at G=1
], ids=["small", "chunks-token-5d", "empty-seq-window-sinks", "bs64"])
def test_prefill_ragged(params):
    check(dict(params, D=64), seed=7)


@pytest.mark.parametrize("params,call", [
    # decode: a long context (whole unmasked tiles, then the masked last tile) with a window whose
    # edge cuts a tile; explicit partitions put the edge and the end in different programs
    (dict(context_lengths=[517, 200, 64], query_length=2, Hq=4, Hkv=1, sliding_window=130), {}),
    (dict(context_lengths=[517, 200, 64], query_length=2, Hq=4, Hkv=1, sliding_window=130), dict(num_partitions=3)),
    # prefill: chunk rows wider than the window (every tile masked), and one narrower (masked edge
    # tiles before the unmasked run, the causal diagonal after it)
    (dict(context_lengths=[400, 260], query_lengths=[150, 40], Hq=4, Hkv=2, sliding_window=37), {}),
    (dict(context_lengths=[400, 260], query_lengths=[150, 40], Hq=4, Hkv=2, sliding_window=200, scales="token"), {}),
], ids=["decode-window", "decode-window-3-partitions", "prefill-narrow-window", "prefill-wide-window-token"])
def test_masked_and_unmasked_tile_regions(params, call):
    """The kernels skip masking on tiles every query row sees whole; the tiles around a sliding
    window's edge, the causal diagonal and the context's end stay masked (NaN past the context)."""
    check(dict(params, D=64), seed=11, **call)


def test_prefill_rows_outside_sequences_are_zero():
    case = make_pa_case([10, 12], query_lengths=[3, 4], device=DEVICE, seed=8)
    kw = dict(case.kwargs)
    T = kw["query"].shape[0]
    qsl = torch.tensor([1, 4, T - 1], dtype=torch.int32, device=DEVICE)  # row 0 and the last row belong to none
    ref = case.call("torch", query_start_loc=qsl, out=torch.full_like(kw["query"], float("nan")))
    out = case.call("triton", query_start_loc=qsl, out=torch.full_like(kw["query"], float("nan")))
    assert (out[0] == 0).all() and (out[-1] == 0).all()
    assert ((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-2


@pytest.mark.parametrize("scales", ["tensor", "token"])
@pytest.mark.parametrize("v_layout", ["4d", "5d"])
@pytest.mark.parametrize("D,bs", [(64, 16), (128, 64), (64, 48), (128, 112)])
def test_write_kv_bitwise_equal_to_reference(scales, v_layout, D, bs):
    """Same bytes and scales as the reference writer; slot -1 and a slot past the cache skipped."""
    from pa_backend import write_kv

    a, b = (make_pa_case([0], spare_blocks=5, scales=scales, v_layout=v_layout, D=D, block_size=bs, Hkv=2,
                         device=DEVICE) for _ in range(2))
    g = torch.Generator().manual_seed(1)
    T = 7
    key = (torch.randn(T, 2, D, generator=g) * 4).bfloat16().to(DEVICE)
    value = (torch.randn(T, 2, D, generator=g) * 3).bfloat16().to(DEVICE)
    key[3] *= 1e4  # saturates under a per-tensor scale
    cap = a.kwargs["key_cache"].shape[0] * bs
    slots = torch.tensor([0, -1, bs + 3, 2 * bs - 1, 4 * bs + 5, cap, 3 * bs], device=DEVICE)
    for case, backend in ((a, "torch"), (b, "triton")):
        kw = case.kwargs
        write_kv(key, value, kw["key_cache"], kw["value_cache"], slots, kw["key_scale"], kw["value_scale"],
                 backend=backend)
    for name in ("key_cache", "value_cache"):
        assert torch.equal(a.kwargs[name].view(torch.uint8), b.kwargs[name].view(torch.uint8)), name
    for name in ("key_scale", "value_scale"):
        assert torch.equal(a.kwargs[name].nan_to_num(7.0), b.kwargs[name].nan_to_num(7.0)), name


def test_write_kv_kept_launches_follow_their_arguments(monkeypatch):
    """write_kv keeps its launch per check-memo key (every argument's address, shape and strides): the same
    call again uses the kept launch (slot values refilled in place are read on the device), a call with any
    other tensor (key, value, slots, caches and their scales) makes its own. On the interpreter, with a
    stand-in of ``bind`` that keeps the first call's tensors: the bytes still equal the reference writer's."""
    from backend_core.tests.testing import kept_args_binder
    from pa_backend import write_kv
    from pa_backend.triton import write_kv_launch as T

    taken = []
    monkeypatch.setattr(T, "bind", kept_args_binder(taken))
    T._WRITE_LAUNCHES.clear()
    pairs = [tuple(make_pa_case([0], spare_blocks=5, scales="token", D=64, Hkv=2, device=DEVICE) for _ in range(2))
             for _ in range(2)]  # (reference, triton) caches, twice
    g = torch.Generator().manual_seed(2)
    keys = [(torch.randn(5, 2, 64, generator=g) * s).bfloat16().to(DEVICE) for s in (2.0, 5.0)]
    values = [torch.randn(5, 2, 64, generator=g).bfloat16().to(DEVICE) for _ in range(2)]
    slots = [torch.tensor([0, 17, 18, 40, 63], device=DEVICE), torch.tensor([5, 6, 7, 8, 9], device=DEVICE)]
    calls = [(0, 0, 0, 0, None), (0, 0, 0, 0, [1, 2, 3, 4, 70]),  # the same call; then its slots refilled
             (1, 0, 0, 0, None), (0, 1, 0, 0, None), (0, 0, 1, 0, None), (0, 0, 0, 1, None)]
    for k, v, sl, cache, refill in calls:
        if refill is not None:
            slots[sl].copy_(torch.tensor(refill))
        for case, backend in zip(pairs[cache], ("torch", "triton")):
            kw = case.kwargs
            write_kv(keys[k], values[v], kw["key_cache"], kw["value_cache"], slots[sl], kw["key_scale"],
                     kw["value_scale"], backend=backend)
        a, b = pairs[cache]
        for name in ("key_cache", "value_cache", "key_scale", "value_scale"):
            assert torch.equal(a.kwargs[name].view(torch.uint8), b.kwargs[name].view(torch.uint8)), (name, k, v, sl)
    assert [ok for _, ok in taken] == [True]  # the repeated call only


@pytest.mark.parametrize("shape,split", [(dict(query_length=1), None), (dict(query_length=1), 4),
                                         (dict(query_length=4), None), (dict(query_lengths=[5, 7]), None)])
def test_context_past_the_table_reads_as_the_table(shape, split):
    """A context longer than its table row reads as the row, positions included: the entries after it
    (here a poisoned next row pointing at a NaN page) are never read, and the output equals the call
    with the row's length (bit for bit: the split and the causal positions follow the clamped length).
    The GPU's split-K plans gave 1 ulp apart at ql 1 and the unclamped positions at ql 4 before the
    clamp moved to where the length is read (``split`` 4: the ql 1 difference on CPU too)."""
    case = make_pa_case([20, 48], extra_table=0, spare_blocks=2, device=DEVICE, **shape)  # 3 blocks
    kw = case.kwargs
    nb = kw["key_cache"].shape[0]
    nan_page = sorted(set(range(nb)) - set(case.used_blocks))[0]
    big = torch.full((3, kw["block_tables"].shape[1]), nan_page, dtype=torch.int32, device=DEVICE)
    big[:2] = kw["block_tables"]
    extra = {} if split is None else dict(num_partitions=split)  # (pa_prefill takes no num_partitions)
    good = case.call("triton", **extra).clone()
    for ctx in (49, 64, 10_000, 2**31 - 1):
        out = case.call("triton", block_tables=big[:2], out=torch.full_like(good, float("nan")),
                        context_lengths=torch.tensor([20, ctx], dtype=torch.int32, device=DEVICE), **extra)
        assert torch.equal(out, good), ctx


@pytest.mark.parametrize("prefill", [False, True])
def test_block_ids_outside_the_cache_read_block_zero(prefill):
    """A corrupted table (ids past the cache or negative inside a sequence's extent; the reference
    raises ValueError) never makes the kernels load outside the caches: such an id reads block 0,
    so the output equals the same call with those ids replaced by 0."""
    case = make_pa_case([40, 30], query_lengths=[3, 2] if prefill else None, Hq=4, Hkv=2, D=64, device=DEVICE,
                        seed=21)
    bt = case.kwargs["block_tables"]
    nb = case.kwargs["key_cache"].shape[0]
    bad, zeroed = bt.clone(), bt.clone()
    bad[0, 1], bad[1, 0] = nb + 7, -3
    zeroed[0, 1], zeroed[1, 0] = 0, 0
    out = case.call("triton", block_tables=bad, out=torch.full_like(case.kwargs["query"], float("nan")))
    ref = case.call("triton", block_tables=zeroed, out=torch.full_like(case.kwargs["query"], float("nan")))
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())


def test_reserved_workspace_is_reused_and_outgrown_buffers_stay_alive():
    """After reserve() a decode batch within the reservation allocates nothing; a larger one grows
    the workspace and keeps the old buffer (a graph captured earlier still writes to it)."""
    from backend_core.buffers import indexed
    from pa_backend import planner

    key = indexed(DEVICE)  # the buffers' key: a bare "cuda" is stored as "cuda:<current>"
    planner._WS.buffers.pop(key, None)  # earlier tests may have grown it past these sizes
    planner.reserve(8, 4, 1, 64, 4096, 16, device=DEVICE, sms=4)
    buf = planner._WS.buffers[key][0]
    case = make_pa_case([40, 6, 100], Hq=4, Hkv=1, D=64, device=DEVICE)
    case.call("triton")
    assert planner._WS.buffers[key][0] is buf
    planner.reserve(64, 16, 1, 256, 1 << 16, 16, device=DEVICE, sms=4)
    assert planner._WS.buffers[key][0] is not buf and any(r[0] is buf for r in planner._WS.retired)
    with pytest.raises(ValueError, match="Hq: expected a multiple of Hkv"):
        planner.reserve(8, 6, 4, 64, 4096, 16, device=DEVICE)


@pytest.mark.parametrize("G,ql,D,bs", [(16, 4, 128, 16), (4, 1, 128, 16), (8, 1, 64, 64), (16, 1, 256, 16)])
def test_reserve_covers_every_launch_of_the_triton_split(G, ql, D, bs):
    """reserve() sizes the workspace for whatever the Triton launch plans at every batch size up to
    the reservation, one-warp programs' split targets included."""
    from backend_core.buffers import indexed
    from pa_backend import planner
    from pa_backend.triton.tiling import decode_tiling, split_policy

    sms, max_ctx, Hkv = 132, 1 << 17, 2
    planner._WS.buffers.pop(indexed(DEVICE), None)
    reserved = planner.reserve(64, G * Hkv, Hkv, D, max_ctx, bs, query_length=ql, device=DEVICE, sms=sms) // 4
    BM = planner.work_rows(G, ql)
    warps = decode_tiling(D, BM, bs)[1]
    for b in (1, 3, 17, 64):
        P = planner.plan_partitions(b, Hkv, max_ctx, sms, 0, *split_policy(warps)).P
        assert planner._floats(b, Hkv, P, BM, D) <= reserved, (b, P)


def test_cache_over_2gib_uses_64bit_offsets():
    """K and V caches of 2.1 GB each, the sequences' pages at the far end: the writer and the
    decode kernel address them exactly (32-bit offsets would wrap into page 0's neighbourhood)."""
    from pa_backend import pa_decode, write_kv

    D, bs, Hkv, Hq = 128, 16, 1, 4
    NB = 2**31 // (Hkv * D * bs) + 64
    fp8 = torch.float8_e4m3fn
    kc = torch.empty((NB, Hkv, D // 16, bs, 16), dtype=torch.uint8, device=DEVICE).view(fp8)
    vc = torch.empty((NB, Hkv, D, bs), dtype=torch.uint8, device=DEVICE).view(fp8)
    far = [NB - 3, NB - 1, NB - 2, NB - 10]
    for b in far + [0]:
        kc[b].view(torch.uint8).fill_(0x7F)  # NaN everywhere the writer does not reach
        vc[b].view(torch.uint8).fill_(0x7F)
    tables = torch.tensor([[far[0], far[1], far[2]], [far[3], 0, 0]], dtype=torch.int32, device=DEVICE)
    ctx = [40, 9]
    t_cpu = tables.cpu()  # index on the host (the table lives on DEVICE)
    slots = torch.cat([t_cpu[0, torch.arange(40) // bs].long() * bs + torch.arange(40) % bs,
                       t_cpu[1, torch.arange(9) // bs].long() * bs + torch.arange(9) % bs]).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(49, Hkv, D, generator=g) * 2).bfloat16().to(DEVICE)
    value = torch.randn(49, Hkv, D, generator=g).bfloat16().to(DEVICE)
    ks, vs = torch.tensor(0.02, device=DEVICE), torch.tensor(0.01, device=DEVICE)
    write_kv(key, value, kc, vc, slots, ks, vs, backend="torch")
    want_k, want_v = kc[far].clone(), vc[far].clone()
    for b in far:  # back to NaN, then the Triton writer
        kc[b].view(torch.uint8).fill_(0x7F)
        vc[b].view(torch.uint8).fill_(0x7F)
    write_kv(key, value, kc, vc, slots, ks, vs, backend="triton")
    assert torch.equal(kc[far].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc[far].view(torch.uint8), want_v.view(torch.uint8))
    q = torch.randn(2, Hq, D, generator=g).bfloat16().to(DEVICE)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    ref = pa_decode(q, kc, vc, tables, cl, ks, vs, backend="torch").double()
    out = pa_decode(q, kc, vc, tables, cl, ks, vs, backend="triton").double()
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() <= tolerance(DEVICE)


def _queue_case():
    # GQA 4 x query length 1 = 16 rows at D 64, page 16: a one-warp decode program (the task queue)
    params = dict(context_lengths=[40, 1, 333, 97, 0, 260], Hq=8, Hkv=2, D=64)
    from pa_backend.triton.tiling import decode_tiling

    assert decode_tiling(64, 16, 16)[1] == 1
    return params


def test_task_queue_counters_are_zero_after_every_launch():
    """One-warp decode programs take tasks from a device counter (and per-SM counters on NVIDIA);
    the reduce kernel zeroes them, so the next launch finds a full queue."""
    from pa_backend.planner import task_queue

    params = _queue_case()
    first = check(params)
    assert not task_queue(DEVICE).any()
    assert torch.equal(check(params), first)  # the next launch does the same work
    assert not task_queue(DEVICE).any()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU takes this path by itself")
def test_task_queue_per_sm_counters_on_the_interpreter(monkeypatch):
    """NVIDIA's queue also caps the programs of one SM that take tasks (per-SM counters indexed by %smid, zeroed by
    the reduce with the task counter). The interpreter has no inline asm: here %smid is faked (programs spread
    over 132 SMs), with the NVIDIA launch facts forced (V_MAXNUM, 132 SMs, 256 slots). The output matches the
    reference and the next launch, and every counter is zero after each launch."""
    from types import SimpleNamespace

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from pa_backend.planner import task_queue
    from pa_backend.triton import tiling

    smids = []

    def fake_smid(self, asm, constraints, values, type, is_pure, pack):
        if "%smid" not in asm:
            raise NotImplementedError(f"inline asm {asm!r} in the interpreter")
        sm = (int(self.grid_idx[0]) * 37 + 11) % 132
        smids.append(sm)
        handle = interpreter.TensorHandle(np.full(np.shape(values[0].data), sm, dtype=np.int32), tl.int32)
        return SimpleNamespace(get_result=lambda i: handle)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", fake_smid)
    monkeypatch.setattr(tiling, "v_maxnum", lambda device: True)
    _launches(monkeypatch, sms=132, sm_slots=256)
    params = _queue_case()
    first = check(params)
    assert smids and len(set(smids)) > 1  # the per-SM path ran, over several SMs
    assert not task_queue(DEVICE).any()
    assert torch.equal(check(params), first)
    assert not task_queue(DEVICE).any()


def test_task_queue_is_reset_when_the_reduce_launch_fails(monkeypatch):
    """A failure between the two kernels (the reduce's launch raising) must not leave the counters
    drained: the launcher zeroes them, and the next call is whole."""
    from pa_backend.planner import task_queue
    from pa_backend.triton import pa_decode as kmod

    params = _queue_case()
    want = check(params)

    class Failing:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("reduce launch failed")
            return launch

    with monkeypatch.context() as m:
        m.setattr(kmod, "pa_decode_reduce_kernel", Failing())
        case = make_pa_case(**params, device=DEVICE, seed=0)
        with pytest.raises(RuntimeError, match="reduce launch failed"):
            case.call("triton")
    assert not task_queue(DEVICE).any()
    assert torch.equal(check(params), want)


def test_task_queue_only_for_shape_only_plans():
    """One-warp decode programs take the task queue when the plan's context bound is the table
    width (CUDA graphs, eager calls); a plan that knows its batch's max context keeps the grid (sized
    to it); both give the reference's output (not the same bytes: this small batch splits its short
    contexts under the shape-only plan only, planner.plan_partitions' small_split)."""
    from pa_backend import plan_decode

    case = make_pa_case(**_queue_case(), device=DEVICE, seed=0)
    kw = dict(case.kwargs)
    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    outs, modes = [], []
    for mc in (None, 333):
        plan = plan_decode(kw["block_tables"], kw["context_lengths"], max_context=mc, backend="triton")
        outs.append(plan.run(**args, out=torch.full_like(kw["query"], float("nan"))))
        modes.append(next(iter(plan.state.values())).queue_mode)
    assert modes == [True, False]
    ref = torch.empty(kw["query"].shape, dtype=torch.float64, device=DEVICE)
    kw.pop("out")
    run_attention(dataclasses.replace(prepare_attention(**kw), out=ref), compute_dtype=torch.float64)
    for out in outs:
        assert ((out.double() - ref).norm() / ref.norm()).item() <= tolerance(DEVICE)


@pytest.mark.parametrize("qk8", [False, True])
@pytest.mark.parametrize("prefill", [False, True])
def test_single_partition_writes_the_output_without_the_reduce(monkeypatch, prefill, qk8):
    """A plan whose items each take one partition (a short max context: what the adapters plan for
    small batches outside graphs) writes the output rows from the partition kernel: the reduce is
    not launched. Sinks, a sliding window and a sequence with nothing to attend (zeros) included.
    ``qk8``: the 64-row programs' FP8 Q.K, on by default on NVIDIA (decode at ql 4 with GQA 16, prefill)."""
    from pa_backend import plan_decode, plan_prefill
    from pa_backend.triton import pa_decode as kmod

    class Failing:
        def __getitem__(self, grid):
            raise AssertionError("the reduce kernel was launched")

    ql = 4 if qk8 else 2
    params = dict(context_lengths=[40, 0, 100, 9], Hq=32 if qk8 else 8, Hkv=2, D=64, sinks=True, sliding_window=50)
    if prefill:
        params.update(context_lengths=[40, 3, 100, 9], query_lengths=[5, 3, 16, 0])
    else:
        params.update(query_length=ql)
    spy = _LaunchSpy(kmod.pa_decode_partition_kernel)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_FP8_QK", "1" if qk8 else "0")
    monkeypatch.setattr(kmod, "pa_decode_partition_kernel", spy)
    case = make_pa_case(**params, device=DEVICE, seed=7)
    kw = dict(case.kwargs)
    kw.pop("out")
    ref = torch.empty(kw["query"].shape, dtype=torch.float64, device=DEVICE)
    run_attention(dataclasses.replace(prepare_attention(**kw, prefill=prefill), out=ref), compute_dtype=torch.float64)
    if prefill:
        plan = plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                            query_start_loc_host=kw["query_start_loc"].tolist(), max_context=100, backend="triton")
    else:
        plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, max_context=100,
                           backend="triton")
    out = torch.full_like(kw["query"], float("nan"))
    with monkeypatch.context() as m:
        m.setattr(kmod, "pa_decode_reduce_kernel", Failing())
        plan.run(*(kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")),
                 sinks=kw["sinks"], sliding_window=kw["sliding_window"], out=out)
    assert next(iter(plan.state.values())).direct
    assert spy.qk8 == [qk8]
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= tolerance(DEVICE), err
    if not prefill:
        assert (out[ql:2 * ql] == 0).all()  # the sequence with context 0 attended nothing


class _LaunchSpy:
    """Wraps the partition kernel and records the QK8 constexpr of every launch."""

    def __init__(self, kernel):
        self.kernel, self.qk8 = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            self.qk8.append(kwargs["QK8"])
            return launch(*args, **kwargs)
        return call


FP8_QK_CASES = [
    dict(context_lengths=[3, 70, 33], query_length=4, Hq=16, Hkv=1, D=128, v_layout="4d", scales="tensor"),
    dict(context_lengths=[40, 6], query_length=4, Hq=32, Hkv=2, D=64, v_layout="5d", scales="token"),
    dict(context_lengths=[90, 7], query_length=4, Hq=16, Hkv=1, D=64, block_size=64, sliding_window=37, sinks=True),
    dict(context_lengths=[60, 9], query_lengths=[35, 9], Hq=8, Hkv=2, D=64, v_layout="5d", scales="tensor"),
]


@pytest.mark.parametrize("params", FP8_QK_CASES, ids=["ql4-gqa16-D128", "ql4-5d-token", "bs64-window-sinks", "prefill"])
def test_fp8_qk_path_matches_reference(monkeypatch, params):
    """The wgmma programs' FP8 Q.K (the BF16 query as an exact hi + lo FP8 pair, K's 2-D tiles from the
    cache bytes; on by default on NVIDIA sm_89+, forced here so the interpreter checks it): the float64
    reference's tolerance with NaN bytes in every unused slot, a 128k-style wide table's stale columns
    included (make_pa_case's extra_table), and it was the path taken."""
    from pa_backend.triton import pa_decode as kmod

    spy = _LaunchSpy(kmod.pa_decode_partition_kernel)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_FP8_QK", "1")
    monkeypatch.setattr(kmod, "pa_decode_partition_kernel", spy)
    check(params, seed=11)
    assert spy.qk8 and all(spy.qk8)


def test_fp8_qk_needs_16_byte_aligned_caches(monkeypatch):
    """A cache whose base address is not 16-byte aligned (a view at an odd offset) cannot declare the
    2-D tiles' 16-byte runs: the launch takes the FP16 dots, with the same result as an aligned copy."""
    from pa_backend.triton import pa_decode as kmod

    params = FP8_QK_CASES[0]
    case = make_pa_case(**params, device=DEVICE, seed=3)
    kw = dict(case.kwargs)
    kw.pop("out")
    shifted = {}
    for name in ("key_cache", "value_cache"):
        t = kw[name]
        raw = torch.empty(t.numel() + 1, dtype=torch.uint8, device=DEVICE)
        view = raw[1:].view(t.dtype).view(t.shape)
        view.copy_(t)
        shifted[name] = view
    assert shifted["key_cache"].data_ptr() % 16
    spy = _LaunchSpy(kmod.pa_decode_partition_kernel)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_FP8_QK", "1")
    monkeypatch.setattr(kmod, "pa_decode_partition_kernel", spy)
    aligned = case.call("triton", out=torch.full_like(kw["query"], float("nan")))
    unaligned = case.call("triton", out=torch.full_like(kw["query"], float("nan")), **shifted)
    assert spy.qk8 == [True, False]
    err = ((unaligned.double() - aligned.double()).norm() / aligned.double().norm()).item()
    assert err <= tolerance(DEVICE), err


def test_fp8_qk_switch(monkeypatch):
    """Off for one-warp M = 16 programs and off the GPU by default; the override is validated."""
    from pa_backend.triton import tiling as pt

    cache = make_pa_case(**FP8_QK_CASES[0], device=DEVICE, seed=0).kwargs
    holder = type("Cache", (), {"key_cache": cache["key_cache"]})()
    bf16, fp16 = torch.bfloat16, torch.float16
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_FP8_QK", "1")
    assert pt.fp8_qk(torch.device(DEVICE), holder, 64, bf16) and not pt.fp8_qk(torch.device(DEVICE), holder, 16, bf16)
    assert not pt.fp8_qk(torch.device(DEVICE), holder, 64, fp16)  # FP16 queries never (forced or not)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_FP8_QK", "0")
    assert not pt.fp8_qk(torch.device(DEVICE), holder, 64, bf16)
    monkeypatch.delenv("FLYDSL_BACKENDS_PA_FP8_QK")
    if DEVICE.type == "cpu":
        assert not pt.fp8_qk(torch.device("cpu"), holder, 64, bf16)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_FP8_QK", "yes")
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_PA_FP8_QK"):
        pt.fp8_qk(torch.device(DEVICE), holder, 64, bf16)


@pytest.mark.parametrize("params", [
    dict(context_lengths=[300], query_lengths=[40], Hq=4, Hkv=1, D=128),
    dict(context_lengths=[300], query_length=4, Hq=16, Hkv=1, D=128),
], ids=["prefill-40-rows", "ql4-gqa16"])
def test_fp16_queries_keep_fp16_dots(monkeypatch, params):
    """The FP8 Q.K pair holds a BF16 query exactly but would cut an FP16 one (8 of its 11 significant bits,
    always towards zero): FP16 queries keep the FP16 dots even where the FP8 Q.K is forced, and stay at FP16's
    accuracy (rel. error ~2e-4 here; the FP8 pair gave 3.6e-3)."""
    from pa_backend.triton import pa_decode as kmod

    spy = _LaunchSpy(kmod.pa_decode_partition_kernel)
    monkeypatch.setenv("FLYDSL_BACKENDS_PA_FP8_QK", "1")
    monkeypatch.setattr(kmod, "pa_decode_partition_kernel", spy)
    case = make_pa_case(**params, act_dtype=torch.float16, device=DEVICE, seed=5)
    out = case.call("triton")
    kw = {k: v for k, v in case.kwargs.items() if k != "out"}
    ref = torch.empty(kw["query"].shape, dtype=torch.float64, device=DEVICE)
    run_attention(dataclasses.replace(prepare_attention(**kw, prefill=case.prefill), out=ref),
                  compute_dtype=torch.float64)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-3, err
    assert spy.qk8 and not any(spy.qk8)


@pytest.mark.parametrize("kind,D", [("prefill", 128), ("prefill", 64), ("decode", 256)])
def test_amd_tilings_match_reference(monkeypatch, kind, D):
    """The tilings the launcher picks on AMD GPUs (``amd=True``: no scratch on gfx942 / gfx950; never run on
    AMD hardware here) compute the same attention: run here through the tuning overrides."""
    from pa_backend.triton import tiling as pt

    if kind == "prefill":
        tiling = pt.prefill_tiling(D, 4, 16, amd=True)
        assert tiling != pt.prefill_tiling(D, 4, 16)
        rows, bt, warps, stages = tiling
        env = dict(FLYDSL_BACKENDS_PA_PREFILL_M=rows * 4, FLYDSL_BACKENDS_PA_PREFILL_BT=bt,
                   FLYDSL_BACKENDS_PA_PREFILL_WARPS=warps, FLYDSL_BACKENDS_PA_PREFILL_STAGES=stages)
        params = dict(context_lengths=[150, 40, 7], query_lengths=[70, 40, 1], Hq=8, Hkv=2, D=D)
    else:
        tiling = pt.decode_tiling(D, 16, 64, amd=True)
        assert tiling != pt.decode_tiling(D, 16, 64)
        bt, warps, stages = tiling
        env = dict(FLYDSL_BACKENDS_PA_TRITON_BT=bt, FLYDSL_BACKENDS_PA_TRITON_WARPS=warps,
                   FLYDSL_BACKENDS_PA_TRITON_STAGES=stages)
        params = dict(context_lengths=[100, 37, 260], Hq=4, Hkv=1, D=D, block_size=64, scales="token", v_layout="5d")
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    pt.decode_tiling.cache_clear()
    pt.prefill_tiling.cache_clear()
    try:
        check(params, seed=5)
    finally:
        monkeypatch.undo()
        pt.decode_tiling.cache_clear()
        pt.prefill_tiling.cache_clear()
