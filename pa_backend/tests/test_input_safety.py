"""Inputs the validation accepts must never make a kernel read or write the wrong memory (issue 14).

Each case runs on the torch reference and the Triton kernels (the interpreter on CPU): either the
right answer, or a ValueError/TypeError naming the argument with every cache bit-identical.
"""

import pytest
import torch

from pa_backend import REGISTRY, pa_decode, pa_prefill, write_kv
from pa_backend.cases import make_pa_case

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0],
                                                                  reason="triton not usable here"))]
CACHE_ARGS = ("key_cache", "value_cache", "key_scale", "value_scale")


def case(**kw):
    params = dict(context_lengths=[5, 20, 9], Hq=4, Hkv=2, D=64, seed=1, device=DEVICE)
    params.update(kw)
    return make_pa_case(**params)


def snap(kw):
    return {k: kw[k].view(torch.uint8).clone() if kw[k].element_size() == 1 else kw[k].clone() for k in CACHE_ARGS}


def same_bytes(kw, before):
    for k, v in before.items():
        now = kw[k].view(torch.uint8) if kw[k].element_size() == 1 else kw[k]
        if not torch.equal(now.view(torch.uint8) if now.element_size() == 1 else now.nan_to_num(1e30),
                           v.view(torch.uint8) if v.element_size() == 1 else v.nan_to_num(1e30)):
            return False
    return True


def strided(t: torch.Tensor, junk: int = 10**6) -> torch.Tensor:
    """The same values as ``t`` (1-D) with stride 2; the skipped elements hold junk."""
    base = torch.stack([t, torch.full_like(t, junk)], 1).reshape(-1)
    v = base[::2]
    assert v.stride(0) == 2 and torch.equal(v, t)
    return v


# --- 1. write_kv reads slot_mapping through its stride --------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scales", ["tensor", "token"])
def test_write_kv_strided_slot_mapping(impl, scales):
    c = case(scales=scales)
    kw = c.kwargs
    free = [b for b in range(kw["key_cache"].shape[0]) if b not in c.used_blocks]
    slots = torch.tensor([free[0] * 16 + 3, free[1] * 16 + 7, -1, free[0] * 16 + 9], dtype=torch.int32,
                         device=DEVICE)
    g = torch.Generator().manual_seed(3)
    key = torch.randn(4, 2, 64, generator=g).bfloat16().to(DEVICE)
    value = torch.randn(4, 2, 64, generator=g).bfloat16().to(DEVICE)
    caches = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()} for _ in range(2)]
    for kv, sm in ((caches[0], slots), (caches[1], strided(slots, junk=free[2] * 16))):
        write_kv(key, value, kv["key_cache"], kv["value_cache"], sm, kv["key_scale"], kv["value_scale"],
                 backend=impl)
    for k in CACHE_ARGS:  # the junk between the strided slots names a free block: it must stay untouched
        a, b = caches[0][k], caches[1][k]
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.nan_to_num(1e30),
                           b.view(torch.uint8) if b.element_size() == 1 else b.nan_to_num(1e30)), k
    before = snap(kw)
    assert not same_bytes(caches[0], before)  # the write did something


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scales", ["tensor", "token"])
def test_write_kv_non_finite_inputs_follow_the_reference(impl, scales):
    """A NaN or inf in K/V: the Triton writer stored large finite values (the grid rounding's min / max, a
    NaN-skipping per-token amax; +inf per token even came back as -384) where the reference stores NaN
    (or saturates an inf under a per-tensor scale). The same NaN positions and finite bytes now."""
    c = case(scales=scales)
    kw = c.kwargs
    free = [b for b in range(kw["key_cache"].shape[0]) if b not in c.used_blocks]
    slots = torch.tensor([free[0] * 16 + 3, free[0] * 16 + 4, free[1] * 16 + 5], dtype=torch.int64, device=DEVICE)
    g = torch.Generator().manual_seed(5)
    key = torch.randn(3, 2, 64, generator=g).bfloat16()
    value = torch.randn(3, 2, 64, generator=g).bfloat16()
    key[0, 1, 5] = float("nan")
    key[2, 0, 9] = -float("inf")
    value[1, 0, 7] = float("inf")
    key[1, 1, 2] = -float("nan")  # a NaN with its sign bit set (per-token on x86: inf / inf is one too)
    key, value = key.to(DEVICE), value.to(DEVICE)
    out = {}
    for name in ("torch", impl):
        kv = {k: kw[k].clone() for k in CACHE_ARGS}
        write_kv(key, value, kv["key_cache"], kv["value_cache"], slots, kv["key_scale"], kv["value_scale"],
                 backend=name)
        out[name] = kv
    for k in CACHE_ARGS:
        a, b = out["torch"][k].float(), out[impl][k].float()
        assert torch.equal(torch.isnan(a), torch.isnan(b)), k
        assert torch.equal(a.nan_to_num(1e30), b.nan_to_num(1e30)), k
    # the same bytes, NaNs included: one NaN byte whatever the sign (the reference's followed the device's division)
    assert same_bytes(out[impl], snap(out["torch"]))
    kc = out[impl]["key_cache"].float()
    assert torch.isnan(kc[free[0], 1, 0, 3, 5])  # the NaN element is a NaN byte, under either scale
    if scales == "token":  # the NaN token's scale is NaN, an inf token's scale is inf
        assert torch.isnan(out[impl]["key_scale"][free[0], 1, 3])
        assert torch.isinf(out[impl]["value_scale"][free[0], 0, 4])
    else:  # an inf saturates
        assert kc[free[1], 0, 0, 5, 9] == -torch.finfo(kw["key_cache"].dtype).max


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scales", ["tensor", "token"])
def test_write_kv_bf16_subnormals_give_the_reference_bytes(impl, scales):
    """Rows of BF16 subnormals (|x| < 2^-126) and tiny values: the writers' bytes are equal (Triton's interpreter
    widened BF16 subnormals wrongly: backend_core.interpreter.faithful_bf16_widening)."""
    c = case(scales=scales)
    kw = c.kwargs
    free = [b for b in range(kw["key_cache"].shape[0]) if b not in c.used_blocks]
    slots = torch.tensor([free[0] * 16 + 1, free[0] * 16 + 2], dtype=torch.int64, device=DEVICE)
    tiny = torch.linspace(-5e-39, 5e-39, 2 * 2 * 64).reshape(2, 2, 64)
    key = tiny.bfloat16().to(DEVICE)
    value = (tiny * 1e3).bfloat16().to(DEVICE)  # normal but tiny: scales near FP32's smallest normal
    out = {}
    for name in ("torch", impl):
        kv = {k: kw[k].clone() for k in CACHE_ARGS}
        write_kv(key, value, kv["key_cache"], kv["value_cache"], slots, kv["key_scale"], kv["value_scale"],
                 backend=name)
        out[name] = kv
    assert same_bytes(out[impl], snap(out["torch"]))
    assert not same_bytes(out["torch"], snap(kw))  # the write did something


def test_reference_writer_runs_without_autograd():
    """The torch writer (``auto`` on CPU) wrote the caches under autograd: a per-token scale that requires grad
    failed mid-write (the key cache already written), and keys that require grad made the caches graph nodes
    that kept every written key alive."""
    import gc
    import weakref

    c = case(scales="token")
    kw = c.kwargs
    free = [b for b in range(kw["key_cache"].shape[0]) if b not in c.used_blocks]
    kv = {k: kw[k].clone() for k in CACHE_ARGS}
    kv["value_scale"] = torch.nn.Parameter(kv["value_scale"])
    refs = []
    for step in range(3):
        key = torch.randn(1, 2, 64, device=DEVICE).bfloat16().requires_grad_(True)
        write_kv(key, key.detach(), kv["key_cache"], kv["value_cache"],
                 torch.tensor([free[0] * 16 + step], device=DEVICE), kv["key_scale"], kv["value_scale"],
                 backend="torch")
        refs.append(weakref.ref(key))
        del key
    gc.collect()
    assert not any(r() is not None for r in refs)
    for k in ("key_cache", "value_cache", "key_scale"):
        assert kv[k].grad_fn is None and not kv[k].requires_grad, k
    assert not same_bytes(kv, snap(kw))



# --- 2. pa_decode / pa_prefill read context_lengths (and query_start_loc) through their strides ---
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("prefill", [False, True])
def test_strided_index_vectors(impl, prefill):
    c = case(query_lengths=[2, 5, 1] if prefill else None)
    kw = dict(c.kwargs, out=None)
    want = c.call(impl, out=None)
    over = dict(context_lengths=strided(kw["context_lengths"]))
    if prefill:
        over["query_start_loc"] = strided(kw["query_start_loc"])
    got = c.call(impl, out=None, **over)
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_block_table_rows(impl):
    """A table sliced out of a wider buffer (row stride > width) is read through its row stride."""
    c = case()
    bt = c.kwargs["block_tables"]
    wide = torch.full((bt.shape[0], bt.shape[1] + 5), 10**6, dtype=torch.int32, device=DEVICE)
    wide[:, :bt.shape[1]] = bt
    assert torch.equal(c.call(impl, out=None, block_tables=wide[:, :bt.shape[1]]), c.call(impl, out=None))


# --- 3. pa_prefill checks query_start_loc on the host before any launch ---------------------------
BAD_QSL = [
    ("past-the-rows", [0, 2, 7, 9], "the last offset 9 is past the query's 8 rows"),
    ("decreasing", [0, 5, 3, 8], "expected non-decreasing offsets, got 5 then 3"),
    ("negative", [-2, 2, 7, 8], "expected a first offset >= 0, got -2"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qid,qsl,msg", BAD_QSL, ids=[b[0] for b in BAD_QSL])
def test_prefill_bad_query_start_loc(impl, qid, qsl, msg):
    c = case(query_lengths=[2, 5, 1])
    kw = c.kwargs
    before = snap(kw)
    with pytest.raises(ValueError, match="query_start_loc: " + msg.replace("[", r"\[")):
        pa_prefill(**dict(kw, query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE)), backend=impl)
    assert same_bytes(kw, before)
    assert torch.isnan(kw["out"]).all()
    # a valid call afterwards still works (nothing was corrupted)
    assert torch.isfinite(c.call(impl, out=None)).all()


def test_prefill_host_offsets_are_checked_too():
    c = case(query_lengths=[2, 5, 1])
    with pytest.raises(ValueError, match="query_start_loc_host: expected non-decreasing"):
        from pa_backend.contract import prepare_attention
        prepare_attention(**c.kwargs, prefill=True, query_start_loc_host=[0, 5, 3, 8])


@pytest.mark.parametrize("host", [[0, 2.9, 7.5, 8.0], "0278", [False, True, True, True], [0, 2, 7, float("inf")],
                                  torch.tensor([0.0, 2.5, 7.2, 8.0])],
                         ids=["floats", "string", "bools", "inf", "float-tensor"])
def test_prefill_host_offsets_must_be_integers(host):
    """Host offsets were converted with int(): floats truncated, a string parsed digit by digit."""
    from pa_backend import plan_prefill

    kw = case(query_lengths=[2, 5, 1]).kwargs
    with pytest.raises(TypeError, match="query_start_loc_host: expected 4 integers"):
        plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"], query_start_loc_host=host)


def test_prefill_host_offsets_accept_integer_types():
    import numpy as np

    from pa_backend import plan_prefill

    kw = case(query_lengths=[2, 5, 1]).kwargs
    for host in ([0, 2, 7, 8], np.array([0, 2, 7, 8]), torch.tensor([0, 2, 7, 8], dtype=torch.int32),
                 [torch.tensor(v) for v in (0, 2, 7, 8)]):
        plan = plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"], query_start_loc_host=host)
        assert plan.batch.query_start_loc_host == (0, 2, 7, 8)


@pytest.mark.parametrize("hint", [257, 2**40, 2**63, 2**64])
def test_the_planner_caps_a_num_partitions_hint(hint):
    from pa_backend.planner import MAX_PARTITIONS, plan_partitions

    split = plan_partitions(2, 1, 4096, 132, hint)
    assert split.P == split.few == MAX_PARTITIONS


@pytest.mark.parametrize("impl", IMPLS)
def test_a_huge_num_partitions_hint_is_capped(impl):
    """A hint past 2^63 reached the kernel unclamped: its split arithmetic went unsigned and the program's
    tile count wrapped (a kernel that never finishes); 2^64 raised an OverflowError in Triton's launcher.
    (One hint through the kernel: 256 partitions take ~18 s in the interpreter.)"""
    hint = 2**63
    c = case(context_lengths=[5, 20])
    kw = c.kwargs
    before = snap(kw)
    out = pa_decode(**dict(kw, out=None, num_partitions=hint), backend=impl)
    want = pa_decode(**dict(kw, out=None), backend="torch")
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert same_bytes(kw, before)


# --- 4. aliasing: outputs and written caches share no memory with any other argument --------------
def _bf16_over(t: torch.Tensor, shape) -> torch.Tensor:
    """A contiguous bf16 tensor of ``shape`` laid over ``t``'s first bytes."""
    n = 1
    for s in shape:
        n *= s
    return t.view(torch.uint8).reshape(-1)[:2 * n].view(torch.bfloat16).view(*shape)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_over_a_cache_is_rejected(impl):
    c = case()
    kw = c.kwargs
    before = snap(kw)
    for name in ("key_cache", "value_cache"):
        bad = _bf16_over(kw[name], tuple(kw["query"].shape))
        with pytest.raises(ValueError, match=f"out: shares memory with {name}"):
            pa_decode(**dict(kw, out=bad), backend=impl)
    with pytest.raises(ValueError, match="out: shares memory with query"):
        pa_decode(**dict(kw, out=kw["query"]), backend=impl)
    assert same_bytes(kw, before)


@pytest.mark.parametrize("impl", IMPLS)
def test_value_cache_over_key_cache_is_rejected(impl):
    c = case(v_layout="5d")
    kw = c.kwargs
    before = snap(kw)
    kc = kw["key_cache"]  # [NB, Hkv, D/16, bs, 16] and [NB, Hkv, bs/16, D, 16] hold the same bytes per block
    vc = kc.view(kc.shape[0], kc.shape[1], 1, 64, 16)
    with pytest.raises(ValueError, match="value_cache: shares memory with key_cache"):
        pa_decode(**dict(kw, value_cache=vc), backend=impl)
    with pytest.raises(ValueError, match="value_cache: shares memory with key_cache"):
        write_kv(kw["query"][:1, :2], kw["query"][:1, :2], kc, vc, torch.tensor([0], device=DEVICE),
                 kw["key_scale"], kw["value_scale"], backend=impl)
    assert same_bytes(kw, before)


@pytest.mark.parametrize("impl", IMPLS)
def test_write_kv_aliasing_is_rejected(impl):
    c = case(scales="token")
    kw = c.kwargs
    before = snap(kw)
    kc, vc, ks, vs = (kw[k] for k in CACHE_ARGS)
    key = torch.randn(3, 2, 64).bfloat16().to(DEVICE)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="key_scale: shares memory with value_scale"):
        write_kv(key, key, kc, vc, slots, ks, ks, backend=impl)
    with pytest.raises(ValueError, match="key_cache: shares memory with key"):
        write_kv(_bf16_over(kc, (3, 2, 64)), key, kc, vc, slots, ks, vs, backend=impl)
    with pytest.raises(ValueError, match="value_cache: shares memory with slot_mapping"):
        write_kv(key, key, kc, vc, vc.view(torch.uint8).reshape(-1)[:12].view(torch.int32), ks, vs, backend=impl)
    # per-token scales whose blocks overlap (stride 0): every block would share one scale row
    with pytest.raises(ValueError, match="key_scale: elements overlap"):
        write_kv(key, key, kc, vc, slots, ks[:1].expand(ks.shape), vs, backend=impl)
    assert same_bytes(kw, before)


def test_interleaved_k_and_v_pages_are_accepted():
    """vLLM's layout: a block's K page and V page side by side in one allocation — extents
    interleave, bytes do not: accepted, and the write lands in the right pages."""
    NB, Hkv, D, bs = 6, 2, 64, 16
    raw = torch.zeros(NB, 2, bs * Hkv * D, dtype=torch.uint8, device=DEVICE)
    page = bs * Hkv * D
    kc = raw.as_strided((NB, Hkv, D // 16, bs, 16), (2 * page, bs * D, bs * 16, 16, 1), 0).view(torch.float8_e4m3fn)
    vc = raw.as_strided((NB, Hkv, bs // 16, D, 16), (2 * page, bs * D, 16 * D, 16, 1), page).view(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=DEVICE)
    key = torch.ones(2, Hkv, D).bfloat16().to(DEVICE)
    write_kv(key, -key, kc, vc, torch.tensor([0, 17], device=DEVICE), one, one, backend="torch")
    assert (kc[0, :, :, 0].float() == 1).all() and (vc[1, :, 0, :, 1].float() == -1).all()


# --- 5. smaller items ---------------------------------------------------------------------------
@pytest.mark.parametrize("prefill", [False, True])
def test_meta_tensors_raise_value_error(prefill):
    c = case(query_lengths=[2, 5, 1] if prefill else None)
    kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in c.kwargs.items()}
    with pytest.raises(ValueError, match="query: expected a tensor with data, got one on the meta device"):
        (pa_prefill if prefill else pa_decode)(**kw, backend="torch")
    with pytest.raises(ValueError, match="key: expected a tensor with data"):
        write_kv(kw["query"][:, :2], kw["query"][:, :2], kw["key_cache"], kw["value_cache"],
                 torch.zeros(kw["query"].shape[0], dtype=torch.int32, device="meta"), kw["key_scale"],
                 kw["value_scale"],
                 backend="torch")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [2**31 - 1, 2**63, 2**64, 10**30])
def test_huge_sliding_window_is_no_window(impl, window):
    c = case()
    assert torch.equal(c.call(impl, out=None, sliding_window=window), c.call(impl, out=None, sliding_window=0))


def test_device_mismatch_names_the_anchor_argument(monkeypatch):
    """PA has no ``x``: the message names ``query`` (decode/prefill) or ``key`` (write_kv)."""
    import pa_backend.contract as contract

    seen = []
    real = contract.checked_tensor
    # checks are memoized on addresses and shapes: an earlier test's buffers may be at the same addresses
    monkeypatch.setattr(contract, "_CALL_MEMO", type(contract._CALL_MEMO)())
    monkeypatch.setattr(contract, "checked_tensor",
                        lambda t, name, device, dtypes, anchor=None:
                        seen.append(anchor) or real(t, name, device, dtypes, anchor=anchor))
    c = case()  # its cache is filled through write_kv: anchored at key
    assert set(seen) - {None} == {"key"}
    seen.clear()
    pa_decode(**c.kwargs, backend="torch")
    assert set(seen) - {None} == {"query"}  # None: the query itself
    with pytest.raises(ValueError,
                       match=r"block_tables: expected a tensor on meta \(the device of query\), got one on cpu"):
        real(torch.zeros(2, dtype=torch.int32), "block_tables", torch.device("meta"), (torch.int32,), anchor="query")


def test_block_id_past_the_cache_raises_in_the_reference():
    c = case()
    kw = c.kwargs
    bt = kw["block_tables"].clone()
    bt[1, 0] = kw["key_cache"].shape[0] + 3  # inside sequence 1's extent
    before = snap(kw)
    with pytest.raises(ValueError, match="block_tables: sequence 1 names a block outside"):
        pa_decode(**dict(kw, block_tables=bt), backend="torch")
    assert same_bytes(kw, before)


# --- 6. caches stored KV-heads-outermost: head offsets past 2^31 ----------------------------------
HEAD_MAJOR = dict(Hkv=3, NB=1_100_000, D=64, bs=16)  # head stride 1.13e9 bytes (< 2^31), head 2 at 2.25e9


def head_major_caches(Hkv, NB, D, bs):
    """[NB, Hkv, ...] FP8 caches whose storage is head-major; only blocks 0-1 are touched (sentinel 448), so the
    3.4 GB of each stays virtual."""
    kb = torch.empty((Hkv, NB, D // 16, bs, 16), dtype=torch.uint8, device=DEVICE)
    vb = torch.empty((Hkv, NB, D, bs), dtype=torch.uint8, device=DEVICE)
    for b in (kb, vb):
        b[:, :2].fill_(0x7E)
    return kb.view(torch.float8_e4m3fn).permute(1, 0, 2, 3, 4), vb.view(torch.float8_e4m3fn).permute(1, 0, 2, 3)


@pytest.mark.parametrize("impl", IMPLS)
def test_head_offsets_past_int32(impl):
    """A legal layout whose head stride times Hkv passes 2^31 elements: the Triton kernels offset heads in
    int64 (they wrapped to 1.8 GB before the cache: a write outside it, or a crash)."""
    Hkv, NB, D, bs = HEAD_MAJOR.values()
    kc, vc = head_major_caches(Hkv, NB, D, bs)
    assert kc.stride(1) < 2**31 <= (Hkv - 1) * kc.stride(1)
    ref_k = torch.full((2, Hkv, D // 16, bs, 16), 0x7E, dtype=torch.uint8, device=DEVICE).view(kc.dtype)
    ref_v = torch.full((2, Hkv, D, bs), 0x7E, dtype=torch.uint8, device=DEVICE).view(kc.dtype)
    ks, vs = torch.tensor(0.02, device=DEVICE), torch.tensor(0.015, device=DEVICE)
    g = torch.Generator().manual_seed(5)
    key, value = (torch.randn(20, Hkv, D, generator=g).bfloat16().to(DEVICE) for _ in range(2))
    slots = torch.arange(20, dtype=torch.int64, device=DEVICE)  # blocks 0 and 1
    write_kv(key, value, kc, vc, slots, ks, vs, backend=impl)
    write_kv(key, value, ref_k, ref_v, slots, ks, vs, backend="torch")
    assert torch.equal(kc[:2].contiguous().view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc[:2].contiguous().view(torch.uint8), ref_v.view(torch.uint8))
    q = torch.randn(1, 2 * Hkv, D, generator=g).bfloat16().to(DEVICE)
    bt = torch.tensor([[0, 1, 7, NB - 1]], dtype=torch.int32, device=DEVICE)  # past the context: never read
    cl = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    got = pa_decode(q, kc, vc, bt, cl, ks, vs, backend=impl)
    want = pa_decode(q, ref_k, ref_v, bt[:, :2], cl, ks, vs, backend="torch")
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


def test_a_block_slice_past_int32_is_rejected():
    """Offsets inside one (block, KV head) slice are int32 in the kernels: a layout whose slice spans more is
    refused before anything is written."""
    base = torch.empty(3 * 800_000_000 + 4096, dtype=torch.uint8, device=DEVICE)  # virtual: never touched
    kc = base.as_strided((1, 1, 4, 16, 16), (4096, 4096, 800_000_000, 16, 1)).view(torch.float8_e4m3fn)
    vc = torch.zeros((1, 1, 64, 16), dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    s = torch.tensor(1.0, device=DEVICE)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"key_cache: one \(block, KV head\) slice spans \d+ elements, past the int32"):
        write_kv(x, x, kc, vc, torch.zeros(1, dtype=torch.int64, device=DEVICE), s, s, backend="torch")
    with pytest.raises(ValueError, match=r"key_cache: one \(block, KV head\) slice spans"):
        pa_decode(x, kc, vc, torch.zeros((1, 1), dtype=torch.int32, device=DEVICE),
                  torch.ones(1, dtype=torch.int32, device=DEVICE), s, s, backend="torch")


# --- 6. token positions near int32's edges (found by review; each crashed the interpreter before) ------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("window", [2**31 - 3, 2**31 - 2])
def test_window_near_int32_with_rows_that_see_nothing(impl, prefill, window):
    """A window just under 2^31 and rows with nothing to attend (a padded decode sequence of context 0 and
    4 query rows; 200 prefill rows over 100 tokens): ctx - rows + 1 - window wrapped in int32 and the tile
    loop read the block table 512 MiB before its row. Any window at least as wide as the table is no window."""
    if prefill:
        c = make_pa_case([100], query_lengths=[200], Hq=1, Hkv=1, D=64, seed=3, device=DEVICE)
    else:
        c = make_pa_case([0, 20], query_length=4, Hq=1, Hkv=1, D=64, seed=3, device=DEVICE)
    before = snap(c.kwargs)
    assert torch.equal(c.call(impl, out=None, sliding_window=window), c.call(impl, out=None, sliding_window=0))
    table_tokens = c.kwargs["block_tables"].shape[1] * c.kwargs["value_cache"].shape[-1]
    assert torch.equal(c.call(impl, out=None, sliding_window=table_tokens), c.call(impl, out=None, sliding_window=0))
    assert same_bytes(c.kwargs, before)


@pytest.mark.parametrize("ctx0,ql,window", [(2**31 - 1, 1, 64), (2**31 - 1, 2, 1817), (-2**31 + 767, 3, 2209),
                                            (-2**31, 1, 128)])
@pytest.mark.parametrize("num_partitions", [None, 4, 16])
def test_context_lengths_near_int32_stay_inside_the_table(ctx0, ql, window, num_partitions):
    """The data of context_lengths is not validated (no host read): a stale or corrupt length next to
    int32's edges must not move a load outside the table (start + partition length wrapped and the kernel
    read block ids far outside it). Lengths are clamped to [0, the table row's tokens] where the kernels
    read them: a negative one gives zero rows, one past the table reads as the table's width."""
    if not REGISTRY.get("triton").is_available()[0]:
        pytest.skip("triton not usable here")
    c = make_pa_case([40, 20], query_length=ql, Hq=2, Hkv=1, D=64, seed=4, device=DEVICE)
    kw = dict(c.kwargs)
    kw["context_lengths"] = kw["context_lengths"].clone()
    kw["context_lengths"][0] = ctx0
    before = snap(kw)
    out = pa_decode(**dict(kw, out=None, sliding_window=window, num_partitions=num_partitions), backend="triton")
    assert torch.isfinite(out).all()
    if ctx0 < 0:
        assert not out[:ql].any()
    want = pa_decode(**dict(c.kwargs, out=None, sliding_window=window, num_partitions=num_partitions),
                     backend="triton")
    if ctx0 > 0:  # read as the table's width (the same split and positions)
        row = dict(c.kwargs, context_lengths=c.kwargs["context_lengths"].clone())
        row["context_lengths"][0] = c.kwargs["block_tables"].shape[1] * c.kwargs["key_cache"].shape[3]
        assert torch.equal(out[:ql], pa_decode(**dict(row, out=None, sliding_window=window,
                                                      num_partitions=num_partitions), backend="triton")[:ql])
    assert torch.equal(out[ql:], want[ql:])  # the other sequence is untouched by the bad one
    assert same_bytes(kw, before)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_query_row_past_int32_is_rejected(impl):
    """A query laid out heads-outermost with head stride 2^30: head 2 starts 2^31 elements into its row.
    The kernel offsets heads inside a row in int32 (it wrapped to 4 GiB before the query, a wrong answer
    where that memory is mapped): such a layout is refused before anything runs."""
    S = 2**30
    c = make_pa_case([20], query_length=1, Hq=3, Hkv=1, D=64, seed=3, device=DEVICE)
    big = torch.empty(4 * S + 64, dtype=torch.bfloat16, device=DEVICE)  # 8 GiB, virtual on CPU: never touched
    q = big.as_strided((1, 3, 64), (64, S, 1), 2 * S)
    before = snap(c.kwargs)
    with pytest.raises(ValueError, match=r"query: one token's row \(all heads\) spans \d+ elements, past the int32"):
        pa_decode(**dict(c.kwargs, query=q, out=None), backend=impl)
    assert same_bytes(c.kwargs, before)
    del big
    q = torch.empty(3, 1, 64, dtype=torch.bfloat16, device=DEVICE).transpose(0, 1)  # heads-outermost, small: fine
    q.copy_(c.kwargs["query"])
    assert torch.equal(pa_decode(**dict(c.kwargs, query=q, out=None), backend=impl),
                       pa_decode(**dict(c.kwargs, out=None), backend=impl))


def test_a_table_wider_than_2_30_tokens_is_rejected():
    c = case()
    kw = dict(c.kwargs)
    bs = kw["value_cache"].shape[-1]
    kw["block_tables"] = torch.empty((3, (1 << 30) // bs + 1), dtype=torch.int32, device=DEVICE)  # never read
    before = snap(kw)
    with pytest.raises(ValueError, match=r"block_tables: \d+ blocks of \d+ tokens = \d+ tokens per sequence; at most "
                                         r"1073741824"):
        pa_decode(**kw, backend="torch")
    assert same_bytes(kw, before)
