"""FlyDSLAttnBackend against real SGLang 0.5.23 objects (pools, ForwardBatch, RadixAttention) and
SGLang's own torch_native backend. CPU: the ops run with backend="torch" (the reference).

Run: PYTHONPATH=integration_tests/stubs:. /work/venv-sgl/bin/python -m pytest -q integration_tests/sglang
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

try:
    import sglang.srt.layers.attention.base_attn_backend  # noqa: F401
    import sglang.srt.mem_cache.memory_pool  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang 0.5.23 is not importable here ({type(exc).__name__}: {exc}); build an environment with "
                "`bash integration_tests/setup-cpu-env.sh sglang DIR` and run DIR/bin/python -m pytest with "
                "PYTHONPATH=integration_tests/stubs:. (docs/serving.md)", allow_module_level=True)

import pa_backend.sglang as pas  # noqa: E402
from integration_tests.sglang import harness as H  # noqa: E402
from pa_backend.sglang_backend import FlyDSLAttnBackend  # noqa: E402
from pa_backend.sglang_pool import FlyDSLMHATokenToKVPool  # noqa: E402

# FP8 KV: both sides hold identical FP8 bytes (checked below), so the outputs differ only by the
# order of fp32 vs bf16 accumulation and the final bf16 rounding.
ATOL, RTOL = 2e-2, 2e-2

CASES = {
    "decode": dict(mode="decode", prefix_lens=(14, 15, 40, 1)),
    "extend": dict(mode="extend", prefix_lens=(0, 8, 17, 33), extend_lens=(15, 8, 3, 20)),
    "mixed": dict(mode="mixed", prefix_lens=(20, 5, 0, 70), extend_lens=(1, 1, 7, 1)),
}


def _close(a, b, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def _live_slots(fx):
    c = fx.case
    return sorted(fx.slots[r][pos] for r in range(c.bs) for pos in range(c.seq_lens[r]))


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("mode", ["decode", "extend", "mixed"])
def test_matches_torch_native(mode, page_size):
    case = H.Case(page_size=page_size, seed=zlib.crc32(f"{mode}/{page_size}".encode()) % 1000, **CASES[mode])
    fx = H.build_fixture(case)
    out = H.run_side(fx.flydsl, fx.q, fx.k, fx.v)
    ref = H.run_side(fx.ref, fx.q, fx.k, fx.v)
    assert out[0].shape == (sum(case.input_lens), case.num_heads * case.head_dim)
    for layer_idx, (a, b) in enumerate(zip(out, ref)):
        _close(a, b)
        # same FP8 bytes in both pools at every live slot (prefix + the tokens this forward wrote)
        ka, va = H.slot_bytes(fx.flydsl.runner.token_to_kv_pool, layer_idx)
        kb, vb = H.slot_bytes(fx.ref.runner.token_to_kv_pool, layer_idx)
        live = torch.tensor(_live_slots(fx))
        assert torch.equal(ka[live], kb[live]) and torch.equal(va[live], vb[live])
        # nothing else was written (page 0 included: no padded rows here)
        mask = torch.ones(ka.shape[0], dtype=torch.bool)
        mask[live] = False
        assert int(ka[mask].count_nonzero()) == 0 and int(va[mask].count_nonzero()) == 0
    # and against an independent dequantize-and-softmax reference over the flydsl pool
    _close(out[0], H.fp8_reference_attention(case, fx.flydsl, fx.q))


def test_eager_decode_steps_reuse_the_batch_buffers():
    """Eager decode batches write their block tables and context lengths into the backend's persistent
    buffers (the per-layer argument checks are memoized on addresses: a fresh tensor per step made every
    layer check again), and each step still matches torch_native."""
    case = H.Case(page_size=16, seed=3, **CASES["decode"])
    fx = H.build_fixture(case)
    ref = H.run_side(fx.ref, fx.q, fx.k, fx.v)
    be = fx.flydsl.backend
    seen = []
    for _ in range(2):  # two steps of the same batch shape (the K/V writes land on the same slots again)
        out = H.run_side(fx.flydsl, fx.q, fx.k, fx.v)
        md = be.forward_metadata
        seen.append((md.block_tables.data_ptr(), md.context_lens.data_ptr()))
        assert md.block_tables.data_ptr() == be._eager_block_tables.data_ptr()
        for a, b in zip(out, ref):
            _close(a, b)
    assert seen[0] == seen[1]


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_sliding_window_matches_torch_native(mode):
    case = H.Case(page_size=16, sliding_window_size=7, seed=5, **CASES[mode])
    fx = H.build_fixture(case, num_layers=1)
    out = H.run_side(fx.flydsl, fx.q, fx.k, fx.v)
    ref = H.run_side(fx.ref, fx.q, fx.k, fx.v)
    _close(out[0], ref[0])
    _close(out[0], H.fp8_reference_attention(case, fx.flydsl, fx.q))


def test_sinks_kwarg():
    case = H.Case(page_size=16, seed=9, **CASES["mixed"])
    fx = H.build_fixture(case, num_layers=1, with_sinks=True)
    out = H.run_side(fx.flydsl, fx.q, fx.k, fx.v, sinks=fx.sinks)
    _close(out[0], H.fp8_reference_attention(case, fx.flydsl, fx.q, sinks=fx.sinks))
    no_sink = H.fp8_reference_attention(case, fx.flydsl, fx.q)
    assert (out[0].float() - no_sink).abs().max() > 1e-2  # the sinks did change the result


@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("bad", ["sinks", "query"])
def test_refused_layer_call_leaves_the_pool_untouched(mode, bad):
    """A layer call the plan refuses (sinks of the wrong length, a query short of the batch's rows)
    raises ValueError before the step's new K/V reach the pool: the write runs only once every argument
    is checked."""
    case = H.Case(page_size=16, seed=4, **CASES[mode])
    fx = H.build_fixture(case, num_layers=1, with_sinks=True)
    pool = fx.flydsl.runner.token_to_kv_pool
    before = tuple(t.clone() for t in H.slot_bytes(pool, 0))
    q, kw = fx.q, {"sinks": fx.sinks}
    if bad == "sinks":
        kw = {"sinks": torch.cat([fx.sinks, fx.sinks[:1]])}
    else:
        q = q[:-1]
    with pytest.raises(ValueError, match=bad):
        H.run_side(fx.flydsl, q, fx.k, fx.v, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, H.slot_bytes(pool, 0)))
    H.run_side(fx.flydsl, fx.q, fx.k, fx.v, sinks=fx.sinks)  # the same call with right arguments writes
    assert not all(torch.equal(a, b) for a, b in zip(before, H.slot_bytes(pool, 0)))


def test_per_tensor_scales_write_and_read():
    """Layer k_scale / v_scale (as the FP8 checkpoint loader sets them): the pool stores x / scale,
    attention multiplies by scale; the caller's K/V are not modified."""
    case = H.Case(page_size=16, seed=3, **CASES["extend"])
    side, slots = H.build_side(case, "flydsl", num_layers=1)
    layer = side.layers[0]
    layer.k_scale = torch.nn.Parameter(torch.tensor(0.25), requires_grad=False)
    layer.v_scale = torch.nn.Parameter(torch.tensor(4.0), requires_grad=False)
    layer.k_scale_float, layer.v_scale_float = 0.25, 4.0
    fx = H.build_fixture(case, num_layers=1)  # for inputs only
    k, v = fx.k.clone(), fx.v.clone()
    out = H.run_side(side, fx.q, k, v)
    assert torch.equal(k, fx.k) and torch.equal(v, fx.v)
    pool = side.runner.token_to_kv_pool
    kc, vc = pool.caches(0)
    loc = side.forward_batch.out_cache_loc
    P = case.page_size
    got_k = kc[loc // P, :, :, loc % P, :].reshape(len(loc), -1).float()
    want_k = (fx.k.float() / 0.25).to(H.FP8).float()
    assert torch.equal(got_k, want_k)
    got_v = vc[loc // P, :, (loc % P) // 16, :, loc % 16].reshape(len(loc), -1).float()
    assert torch.equal(got_v, (fx.v.float() / 4.0).to(H.FP8).float())
    _close(out[0], H.fp8_reference_attention(case, side, fx.q), atol=8e-2, rtol=4e-2)


# ------------------------------------------------------------------------------------------
# CUDA-graph metadata: capture then replay of a padded batch (host side; the graph itself is the
# GPU test below)


def test_cuda_graph_capture_then_padded_replay():
    live = H.Case(mode="decode", page_size=16, prefix_lens=(20, 37), seed=11)
    max_bs = 4
    side, slots = H.build_side(live, "flydsl", num_reqs=max_bs + 1)
    ref, _ = H.build_side(live, "torch_native", num_reqs=max_bs + 1, slots=slots)
    g = torch.Generator().manual_seed(4)
    npre = sum(live.prefix_lens)
    prefix = [(torch.randn(npre, H.HKV, H.HEAD_DIM, generator=g).bfloat16(),
               torch.randn(npre, H.HKV, H.HEAD_DIM, generator=g).bfloat16()) for _ in side.layers]
    H.populate_prefix(side, live, slots, prefix)
    H.populate_prefix(ref, live, slots, prefix)
    be = side.backend
    assert be.get_cuda_graph_seq_len_fill_value() == 1
    be.init_cuda_graph_state(max_bs, max_bs)
    bt_buf, cl_buf = be.cuda_graph_block_tables, be.cuda_graph_context_lens

    # capture: SGLang zeroes req_pool_indices / out_cache_loc and fills seq_lens with the fill value
    cap = H.decode_batch(side.runner, [0] * max_bs, [1] * max_bs, [0] * max_bs, "cpu")
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    md = be.forward_metadata
    assert md.block_tables.data_ptr() == bt_buf.data_ptr() and md.context_lens.data_ptr() == cl_buf.data_ptr()
    assert md.block_tables.shape == (max_bs, be.max_blocks)
    assert int(md.block_tables.abs().sum()) == 0 and md.context_lens.tolist() == [1] * max_bs
    # the warmup runs (eager, what capture records): padded rows read/write page 0 only
    pool = side.runner.token_to_kv_pool
    before = [tuple(t.clone() for t in H.slot_bytes(pool, i)) for i in range(len(side.layers))]
    qc = torch.randn(max_bs, H.HQ * H.HEAD_DIM, generator=g).bfloat16()
    kvc = torch.randn(max_bs, H.HKV * H.HEAD_DIM, generator=g).bfloat16()
    warm = H.run_side(H.Side(side.runner, be, side.layers, cap), qc, kvc, kvc, init=False)
    assert all(torch.isfinite(o.float()).all() for o in warm)
    for i in range(len(side.layers)):
        for a, b in zip(before[i], H.slot_bytes(pool, i)):
            changed = (a != b).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) <= {0}, changed  # only slot 0 (SGLang's padding target)

    # replay: 2 live rows padded to 4 (rows 0, seq_len 1, loc 0)
    rows = [1, 2, 0, 0]
    seq = list(live.seq_lens) + [1, 1]
    locs = [slots[0][live.seq_lens[0] - 1], slots[1][live.seq_lens[1] - 1], 0, 0]
    rep = H.decode_batch(side.runner, rows, seq, locs, "cpu")
    be.init_forward_metadata_out_graph(H.replay_view(rep, num_padding=2))
    md = be.forward_metadata
    assert md.block_tables.data_ptr() == bt_buf.data_ptr() and md.context_lens.data_ptr() == cl_buf.data_ptr()
    assert be.cuda_graph_block_tables is bt_buf and be.cuda_graph_context_lens is cl_buf
    P = live.page_size
    for r in range(2):
        npages = -(-live.seq_lens[r] // P)
        assert md.block_tables[r, :npages].tolist() == [slots[r][j * P] // P for j in range(npages)]
    assert int(md.block_tables[2:].abs().sum()) == 0 and md.context_lens.tolist() == seq

    # the graph body, run eagerly on the replay metadata (no init_forward_metadata)
    before = [tuple(t.clone() for t in H.slot_bytes(pool, i)) for i in range(len(side.layers))]
    q = torch.randn(max_bs, H.HQ * H.HEAD_DIM, generator=g).bfloat16()
    k = torch.randn(max_bs, H.HKV * H.HEAD_DIM, generator=g).bfloat16()
    v = torch.randn(max_bs, H.HKV * H.HEAD_DIM, generator=g).bfloat16()
    out = H.run_side(H.Side(side.runner, be, side.layers, rep), q, k, v, init=False)
    ref_fb = H.decode_batch(ref.runner, rows[:2], seq[:2], locs[:2], "cpu")
    want = H.run_side(H.Side(ref.runner, ref.backend, ref.layers, ref_fb), q[:2], k[:2], v[:2])
    for i, (o, w) in enumerate(zip(out, want)):
        _close(o[:2], w)
        assert torch.isfinite(o.float()).all()
        after = H.slot_bytes(pool, i)
        for a, b in zip(before[i], after):
            changed = set((a != b).any(dim=1).nonzero().flatten().tolist())
            assert changed <= {0, locs[0], locs[1]}, changed
            assert {locs[0], locs[1]} <= changed
        # live rows' new K/V are the FP8 of the inputs, same bytes as SGLang's own pool wrote
        ka, va = after
        kb, vb = H.slot_bytes(ref.runner.token_to_kv_pool, i)
        assert torch.equal(ka[locs[:2]], kb[locs[:2]]) and torch.equal(va[locs[:2]], vb[locs[:2]])
        # page 0: only slot 0 (the padded writes) may ever be non-zero
        assert int(ka[1:P].count_nonzero()) == 0 and int(va[1:P].count_nonzero()) == 0


# ------------------------------------------------------------------------------------------
# speculative decoding: TARGET_VERIFY (EAGLE chain, topk 1) batches of n draft tokens per request


def _verify_fixture(prefix_lens, n, page_size, seed, num_reqs=None):
    """flydsl side + torch_native side over the same cached prefix; the reference runs the drafts as an
    EXTEND of n tokens (a chain's verify is exactly causal extend attention)."""
    case = H.Case(mode="extend", page_size=page_size, prefix_lens=prefix_lens, extend_lens=(n,) * len(prefix_lens),
                  seed=seed)
    fx_num = num_reqs or case.bs + 1
    fly, slots = H.build_side(case, "flydsl", num_reqs=fx_num)
    ref, _ = H.build_side(case, "torch_native", num_reqs=fx_num, slots=slots)
    g = torch.Generator().manual_seed(seed)
    npre = sum(prefix_lens)
    prefix = [(torch.randn(npre, H.HKV, H.HEAD_DIM, generator=g).bfloat16(),
               torch.randn(npre, H.HKV, H.HEAD_DIM, generator=g).bfloat16()) for _ in fly.layers]
    H.populate_prefix(fly, case, slots, prefix)
    H.populate_prefix(ref, case, slots, prefix)
    locs = [slots[r][p + i] for r, p in enumerate(prefix_lens) for i in range(n)]
    return case, fly, ref, slots, locs, g


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_target_verify_matches_torch_native_extend(n, page_size):
    prefix_lens = (14, 33, 1, 47)
    case, fly, ref, slots, locs, g = _verify_fixture(prefix_lens, n, page_size, seed=30 + n)
    T = n * case.bs
    q = torch.randn(T, H.HQ * H.HEAD_DIM, generator=g).bfloat16()
    k = torch.randn(T, H.HKV * H.HEAD_DIM, generator=g).bfloat16()
    v = torch.randn(T, H.HKV * H.HEAD_DIM, generator=g).bfloat16()
    rows = [r + 1 for r in range(case.bs)]
    fb = H.decode_batch(fly.runner, rows, list(prefix_lens), locs, "cpu", n=n)
    assert fb.forward_mode.is_target_verify()
    verify = H.Side(fly.runner, fly.backend, fly.layers, fb)
    pool = fly.runner.token_to_kv_pool
    before = [tuple(t.clone() for t in H.slot_bytes(pool, i)) for i in range(len(fly.layers))]
    out = H.run_side(verify, q, k, v)
    md = fly.backend.forward_metadata
    assert md.query_length == n and md.query_start_loc is None
    assert md.context_lens.tolist() == [p + n for p in prefix_lens]
    want = H.run_side(ref, q, k, v)
    for i, (o, w) in enumerate(zip(out, want)):
        _close(o, w)
        after = H.slot_bytes(pool, i)
        for a, b in zip(before[i], after):
            assert set((a != b).any(dim=1).nonzero().flatten().tolist()) <= set(locs)
        kb, vb = H.slot_bytes(ref.runner.token_to_kv_pool, i)
        assert torch.equal(after[0][locs], kb[locs]) and torch.equal(after[1][locs], vb[locs])
    _close(out[0], H.fp8_reference_attention(case, verify, q))


def test_target_verify_rejects_draft_tree():
    case, fly, _, slots, locs, g = _verify_fixture((5, 9), 3, 16, seed=3)
    fb = H.decode_batch(fly.runner, [1, 2], [5, 9], locs, "cpu", n=3, topk=2)
    with pytest.raises(NotImplementedError, match="topk"):
        fly.backend.init_forward_metadata(fb)


def test_cuda_graph_target_verify_capture_then_padded_replay():
    n, max_bs, P = 3, 4, 16
    prefix_lens = (20, 37)
    case, fly, ref, slots, locs, g = _verify_fixture(prefix_lens, n, P, seed=12, num_reqs=max_bs + 1)
    be = fly.backend
    be.init_cuda_graph_state(max_bs, max_bs * n)
    assert be.cuda_graph_query_length == n
    bt_buf, cl_buf = be.cuda_graph_block_tables, be.cuda_graph_context_lens
    with pytest.raises(NotImplementedError, match="query tokens per request"):
        be.init_cuda_graph_state(max_bs, max_bs * 5)
    fill = be.get_cuda_graph_seq_len_fill_value()
    cap = H.decode_batch(fly.runner, [0] * max_bs, [fill] * max_bs, [0] * (max_bs * n), "cpu", n=n)
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    md = be.forward_metadata
    assert md.block_tables.data_ptr() == bt_buf.data_ptr() and md.context_lens.data_ptr() == cl_buf.data_ptr()
    assert md.query_length == n and md.context_lens.tolist() == [fill + n] * max_bs

    rows = [1, 2, 0, 0]
    seq = list(prefix_lens) + [fill, fill]
    plocs = locs + [0] * (2 * n)
    rep = H.decode_batch(fly.runner, rows, seq, plocs, "cpu", n=n)
    pool = fly.runner.token_to_kv_pool
    before = [tuple(t.clone() for t in H.slot_bytes(pool, i)) for i in range(len(fly.layers))]
    be.init_forward_metadata_out_graph(H.replay_view(rep, num_padding=2))
    md = be.forward_metadata
    assert md.block_tables.data_ptr() == bt_buf.data_ptr() and md.context_lens.tolist() == [p + n for p in seq]
    q = torch.randn(max_bs * n, H.HQ * H.HEAD_DIM, generator=g).bfloat16()
    k = torch.randn(max_bs * n, H.HKV * H.HEAD_DIM, generator=g).bfloat16()
    v = torch.randn(max_bs * n, H.HKV * H.HEAD_DIM, generator=g).bfloat16()
    out = H.run_side(H.Side(fly.runner, be, fly.layers, rep), q, k, v, init=False)
    want = H.run_side(ref, q[:2 * n], k[:2 * n], v[:2 * n])
    for i, (o, w) in enumerate(zip(out, want)):
        assert torch.isfinite(o.float()).all()
        _close(o[:2 * n], w)
        after = H.slot_bytes(pool, i)
        for a, b in zip(before[i], after):
            assert set((a != b).any(dim=1).nonzero().flatten().tolist()) <= set(locs) | {0}
        assert int(after[0][1:P].count_nonzero()) == 0 and int(after[1][1:P].count_nonzero()) == 0


# ------------------------------------------------------------------------------------------
# pool: hook, layout, moves


def test_kv_pool_hook_selects_pool_only_for_flydsl():
    from types import SimpleNamespace

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.runtime_context import get_context

    pas.install_kv_pool_hook()
    assert pas.install_kv_pool_hook() is False  # idempotent
    resolve = KVCacheConfigurator._resolve_kv_pool_class
    target, draft = SimpleNamespace(is_draft_worker=False), SimpleNamespace(is_draft_worker=True)
    get_context().override_server_args(attention_backend="flydsl", kv_cache_dtype="fp8_e4m3").install()
    try:
        assert resolve(target, kind="mha", default=MHATokenToKVPool) is FlyDSLMHATokenToKVPool
        assert resolve(target, kind="mla", default=MLATokenToKVPool) is MLATokenToKVPool
        # a speculative draft worker runs on its own backend over SGLang's pool
        assert resolve(draft, kind="mha", default=MHATokenToKVPool) is MHATokenToKVPool
    finally:
        get_context().override_server_args(attention_backend="torch_native").install()
    assert resolve(target, kind="mha", default=MHATokenToKVPool) is MHATokenToKVPool


def test_pool_layout_and_page_aware_moves():
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout

    Pool = FlyDSLMHATokenToKVPool
    pool = Pool(size=4 * 16, page_size=16, dtype=H.FP8, head_num=2, head_dim=64, layer_num=2, device="cpu",
                enable_memory_saver=False, enable_alt_stream=False)
    assert pool.kv_cache_layout == "vectorized_5d"
    assert tuple(pool.k_buffer[0].shape) == (5, 2, 4, 16, 16) and pool.k_buffer[0].dtype == torch.uint8
    assert tuple(pool.v_buffer[0].shape) == (5, 2, 1, 64, 16)
    assert pool.get_key_buffer(0).dtype == H.FP8
    assert pool._mha_buffers().layout == KVBufferLayout.VECTORIZED_5D
    layer = H.make_layers(H.Case(mode="decode", page_size=16, prefix_lens=(1,)), 2)[1]
    k = torch.randn(3, 2, 64).bfloat16()
    v = torch.randn(3, 2, 64).bfloat16()
    pool.set_kv_buffer(layer, torch.tensor([17, -1, 40]), k, v)  # -1 skipped
    kb, vb = H.slot_bytes(pool, 1)
    assert int(kb[[i for i in range(kb.shape[0]) if i not in (17, 40)]].count_nonzero()) == 0
    assert torch.equal(kb[17], k[0].to(H.FP8).view(torch.uint8).reshape(-1))
    assert torch.equal(vb[40], v[2].to(H.FP8).view(torch.uint8).reshape(-1))
    pool.move_kv_cache(torch.tensor([63, 33]), torch.tensor([17, 40]))
    kb2, vb2 = H.slot_bytes(pool, 1)
    assert torch.equal(kb2[63], kb[17]) and torch.equal(vb2[33], vb[40])
    cpu = pool.get_cpu_copy([17, 40])
    pool2 = Pool(size=4 * 16, page_size=16, dtype=H.FP8, head_num=2, head_dim=64, layer_num=2, device="cpu",
                 enable_memory_saver=False, enable_alt_stream=False)
    pool2.load_cpu_copy(cpu, [17, 40])
    for i in range(2):
        assert all(torch.equal(a[[17, 40]], b[[17, 40]]) for a, b in zip(H.slot_bytes(pool, i),
                                                                          H.slot_bytes(pool2, i)))


@pytest.mark.parametrize("page", [16, 64, 128])
def test_pool_raw_writes_skip_outside_slots_and_check_before_writing(page):
    """Quantized K/V bytes (a transfer) go into the pool like activations do: a location outside the pool is
    skipped (it raised after K was written), and a K/V pair of mixed kinds is refused before either is written."""
    Pool = FlyDSLMHATokenToKVPool
    pool = Pool(size=4 * page, page_size=page, dtype=H.FP8, head_num=2, head_dim=64, layer_num=1, device="cpu",
                enable_memory_saver=False, enable_alt_stream=False)
    layer = H.make_layers(H.Case(mode="decode", page_size=16, prefix_lens=(1,)), 1)[0]
    slots = pool.num_blocks() * page
    g = torch.Generator().manual_seed(2)
    k = (torch.randn(3, 2, 64, generator=g) * 4).to(H.FP8)
    v = (torch.randn(3, 2, 64, generator=g) * 4).to(H.FP8)
    pool.set_kv_buffer(layer, torch.tensor([5, slots, -1]), k, v)
    kb, vb = H.slot_bytes(pool, 0)
    assert torch.equal(kb[5], k[0].view(torch.uint8).reshape(-1))
    assert torch.equal(vb[5], v[0].view(torch.uint8).reshape(-1))
    assert int(kb.count_nonzero()) == int(kb[5].count_nonzero())  # nothing else written
    before = [t.clone() for t in H.slot_bytes(pool, 0)]
    with pytest.raises(ValueError, match="cache_v is torch.bfloat16 while the other is quantized"):
        pool.set_kv_buffer(layer, torch.tensor([6, 7]), k[:2], v[:2].to(torch.bfloat16))
    with pytest.raises(ValueError, match="2 locations for 3 K and 3 V rows"):
        pool.set_kv_buffer(layer, torch.tensor([6, 7]), k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, H.slot_bytes(pool, 0)))


# ------------------------------------------------------------------------------------------
# construction errors


def _runner_kwargs(**over):
    kw = dict(backend_name="flydsl", page_size=16, device="cpu", dtype=torch.bfloat16, kv_dtype=H.FP8, num_reqs=2,
              max_context_len=64, num_heads=8, num_kv_heads=2, head_dim=64, layer_num=1, pool_cls=None)
    kw.update(over)
    kw["pool_cls"] = kw["pool_cls"] or FlyDSLMHATokenToKVPool
    return kw


@pytest.mark.parametrize("over, flag", [
    (dict(page_size=32), "--page-size"),
    (dict(kv_dtype=torch.bfloat16), "--kv-cache-dtype"),
    (dict(head_dim=96), "head_dim"),
])
def test_unsupported_config_rejected(over, flag):
    with pytest.raises(ValueError, match=flag) as ei:
        H._mock_runner_class()(**_runner_kwargs(**over))
    assert "working combination" in str(ei.value)


def test_backend_rejects_mla_and_foreign_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    runner = H._mock_runner_class()(**_runner_kwargs())
    runner.use_mla_backend = True
    with pytest.raises(ValueError, match="MLA"):
        FlyDSLAttnBackend(runner, pa_impl="torch")
    runner = H._mock_runner_class()(**_runner_kwargs(pool_cls=MHATokenToKVPool))
    with pytest.raises(ValueError, match="install_kv_pool_hook"):
        FlyDSLAttnBackend(runner, pa_impl="torch")
    runner = H._mock_runner_class()(**_runner_kwargs())
    runner.dtype = torch.float32
    with pytest.raises(ValueError, match="--dtype"):
        FlyDSLAttnBackend(runner, pa_impl="torch")


@pytest.mark.parametrize("what", ["logit_cap", "cross", "encoder", "embedding"])
def test_unsupported_models_rejected_at_start_up(what):
    """Soft-capping, cross-attention, encoder-only and bidirectional embedding models fail when the
    backend is built (after the model is loaded), not at the first request."""
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

    runner = H._mock_runner_class()(**_runner_kwargs())
    kw = dict(num_heads=8, head_dim=64, scaling=0.125, num_kv_heads=2, layer_id=0)
    if what == "logit_cap":
        kw["logit_cap"] = 30.0
    elif what == "cross":
        kw["is_cross_attention"] = True
    elif what in ("encoder", "embedding"):
        kw["attn_type"] = AttentionType.ENCODER_ONLY
    runner.model.attn = RadixAttention(**kw)
    if what == "embedding":
        runner.is_generation = False
    match = {"logit_cap": "soft-capping", "cross": "cross-attention", "encoder": "non-causal",
             "embedding": "non-causal"}[what]
    with pytest.raises(ValueError, match=match) as ei:
        FlyDSLAttnBackend(runner, pa_impl="torch")
    assert "--attention-backend triton" in str(ei.value)


def test_causal_embedding_model_is_accepted():
    """An embedding model whose layers are causal decoder layers (a decoder LLM with --is-embedding, which
    SGLang runs as extend batches: the path test_matches_torch_native checks) starts; the backend's forward
    does not depend on ``is_generation``."""
    from sglang.srt.layers.radix_attention import RadixAttention

    runner = H._mock_runner_class()(**_runner_kwargs())
    runner.model.attn = RadixAttention(num_heads=8, head_dim=64, scaling=0.125, num_kv_heads=2, layer_id=0)
    runner.is_generation = False
    assert isinstance(FlyDSLAttnBackend(runner, pa_impl="torch"), FlyDSLAttnBackend)


def test_import_does_not_pull_sglang():
    code = ("import sys, pa_backend, pa_backend.sglang; "
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
            "assert not bad, bad[:5]")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ------------------------------------------------------------------------------------------
# GPU: real CUDA-graph capture + replays of the backend's decode (Triton ops) == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 3], ids=["decode", "target_verify3"])
def test_cuda_graph_decode_replays_equal_eager_gpu(n):
    """Real torch.cuda.CUDAGraph capture of the backend's forward (Triton ops), 3 padded replays
    equal to eager; n = 1 decode, n = 3 an EAGLE target-verify chain of 3 draft tokens."""
    dev = "cuda"
    max_bs, P = 4, 16
    live = H.Case(mode="decode", page_size=P, prefix_lens=(20, 37, 5), seed=21)
    side, slots = H.build_side(live, "flydsl", device=dev, num_reqs=max_bs + 1, pa_impl="triton")
    be, runner, layers = side.backend, side.runner, side.layers
    g = torch.Generator().manual_seed(8)
    npre = sum(live.prefix_lens)
    prefix = [(torch.randn(npre, H.HKV, H.HEAD_DIM, generator=g).bfloat16().to(dev),
               torch.randn(npre, H.HKV, H.HEAD_DIM, generator=g).bfloat16().to(dev)) for _ in layers]
    H.populate_prefix(side, live, slots, prefix)
    be.init_cuda_graph_state(max_bs, max_bs * n)

    # static inputs (what the graph runner owns); capture values: rows 0, seq_len 1, loc 0
    q_s = torch.zeros(max_bs * n, H.HQ * H.HEAD_DIM, dtype=torch.bfloat16, device=dev)
    k_s = torch.zeros(max_bs * n, H.HKV * H.HEAD_DIM, dtype=torch.bfloat16, device=dev)
    v_s = torch.zeros_like(k_s)
    fb = H.decode_batch(runner, [0] * max_bs, [1] * max_bs, [0] * (max_bs * n), dev, n=n)
    be.init_forward_metadata_out_graph(fb, in_capture=True)

    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    def body():
        return [layer(q_s, k_s, v_s, fb) for layer in layers]

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=be)):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warmup: compile kernels outside the capture
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = body()
        torch.cuda.synchronize()

        for step in range(3):
            n_live = 2 + step % 2  # 2 or 3 live rows, padded to 4
            # seq: tokens before this step's n new ones (decode: SGLang's seq_lens include the new token)
            before = [live.prefix_lens[r] + step * n for r in range(n_live)]
            seq = [b + 1 for b in before] if n == 1 else before
            locs = [slots[r][b + i] for r, b in enumerate(before) for i in range(n)]
            rows = [r + 1 for r in range(n_live)]
            pad = max_bs - n_live
            q = torch.randn(max_bs * n, q_s.shape[1], generator=g).bfloat16().to(dev)
            k = torch.randn(max_bs * n, k_s.shape[1], generator=g).bfloat16().to(dev)
            v = torch.randn(max_bs * n, k_s.shape[1], generator=g).bfloat16().to(dev)
            q_s.copy_(q), k_s.copy_(k), v_s.copy_(v)
            fb.req_pool_indices.copy_(torch.tensor(rows + [0] * pad, device=dev))
            fb.seq_lens.copy_(torch.tensor(seq + [1] * pad, device=dev))
            fb.out_cache_loc.copy_(torch.tensor(locs + [0] * (pad * n), device=dev))
            be.init_forward_metadata_out_graph(H.replay_view(fb, num_padding=pad))
            graph.replay()
            torch.cuda.synchronize()
            got = [o[:n_live * n].clone() for o in outs]

            # eager, same padded batch, fresh metadata (rewrites the same K/V bytes)
            efb = H.decode_batch(runner, rows + [0] * pad, seq + [1] * pad, locs + [0] * (pad * n), dev, n=n)
            be.init_forward_metadata(efb)
            eager = [layer(q.clone(), k.clone(), v.clone(), efb) for layer in layers]
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(got, eager)):
                torch.testing.assert_close(a.float(), b[:n_live * n].float(), atol=1e-3, rtol=1e-3)
            # and both against the dequantize reference over the pool
            case = H.Case(mode="extend", page_size=P, prefix_lens=tuple(before), extend_lens=(n,) * n_live, seed=0)
            ref_side = H.Side(runner, be, layers, H.decode_batch(runner, rows, seq, locs, dev, n=n))
            ref = H.fp8_reference_attention(case, ref_side, q[:n_live * n])
            _close(got[0], ref)


# ------------------------------------------------------------------------------------------
# GPU: one plan per batch; the layers of a step do not sync the host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["decode", "mixed"])  # mixed: decode + extend rows, the prefill plan
def test_one_plan_per_batch_multi_layer_step_does_not_sync_gpu(mode):
    """init_forward_metadata makes the batch's one plan; a layer's forward (K/V write through the pool,
    the plan's run; Triton ops) then only launches. After the first layer (launch state: may sync), a
    4-layer step, each layer with its own cache, K/V and query, runs under
    torch.cuda.set_sync_debug_mode("error") (a host sync raises) on that one plan, and every layer
    matches the dequantize reference over its own cache."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    dev = "cuda"
    case = H.Case(page_size=16, seed=17, **CASES[mode])
    side, slots = H.build_side(case, "flydsl", device=dev, num_layers=4, pa_impl="triton")
    be, fb = side.backend, side.forward_batch
    g = torch.Generator().manual_seed(case.seed)
    npre, T = sum(case.prefix_lens), sum(case.input_lens)
    H.populate_prefix(side, case, slots, [tuple(torch.randn(npre, H.HKV, H.HEAD_DIM, generator=g).bfloat16().to(dev)
                                                for _ in range(2)) for _ in side.layers])
    # every host-to-device copy before the checked step: per layer q [T, Hq*D], k and v [T, Hkv*D]
    ins = [tuple(torch.randn(T, h * H.HEAD_DIM, generator=g).bfloat16().to(dev) for h in (H.HQ, H.HKV, H.HKV))
           for _ in side.layers]
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=be)):
        be.init_forward_metadata(fb)
        plan = be.forward_metadata.plan
        assert plan.is_decode == (mode == "decode")
        side.layers[0](*(t.clone() for t in ins[0]), fb)  # first layer: launch state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [layer(q, k, v, fb) for layer, (q, k, v) in zip(side.layers, ins)]  # one step
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert be.forward_metadata.plan is plan and len(plan.state) == 1  # one plan, one launch state
    for i, (o, (q, _, _)) in enumerate(zip(outs, ins)):
        _close(o, H.fp8_reference_attention(case, side, q, layer_idx=i))


def test_host_time_script_times_the_adapters_layer_path():
    """integration_tests/sglang/host_time.py (a measurement, not a timed test): every timed layer call went
    through RadixAttention's forward, the pool's write and the plan down to the ops' dispatch (the null
    implementation counts)."""
    from integration_tests.sglang import host_time

    r = host_time.adapter_host_time(layers=20, B=2, context=40, table_tokens=256)
    assert r["calls"] == {"write_kv": 20, "pa_decode": 20}
    assert r["layer"] > 0 and r["metadata"] > 0
