"""FlyDSLAttentionBackend / MetadataBuilder / Impl on real vLLM 0.33.0 objects: the backend's spec and
caches allocated by vLLM's ``allocate_kv_cache`` (LBHNC, LHBNC, a padded hybrid-style page), real
``CommonAttentionMetadata`` with a random block permutation (block 0 = null block), the builder's
decode / spec-decode / prefill / mixed decisions, ``build_for_cudagraph_capture`` and padded batches,
``do_kv_cache_update`` + ``forward`` against SDPA over the dequantized K/V. CPU: the ops run on the
reference (``pa_impl="torch"``); the GPU test at the end runs the Triton kernels under a CUDA graph.

Run: VLLM_TARGET_DEVICE=cpu /work/venv-vllm/bin/python -m pytest -q integration_tests/vllm
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("vllm")

import pa_backend.vllm as pav  # noqa: E402
from integration_tests.vllm import attn_harness as H  # noqa: E402

ATOL, RTOL = 2e-2, 2e-2
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.tiny_llama_dir(tmp_path_factory.mktemp("llama"))


def _builder(model_dir, spec, full_graphs=False):
    from vllm.config import set_current_vllm_config

    vc = H.vllm_config(model_dir, block_size=spec.block_size, full_graphs=full_graphs)
    with set_current_vllm_config(vc):
        return pav.FlyDSLAttentionMetadataBuilder(spec, LAYERS, vc, torch.device("cpu")), vc


def test_spec_and_cache_views_follow_the_tensor():
    spec = H.backend_spec(block_size=16)
    assert (spec.num_head_slots, spec.state_content_bytes) == (2, H.HKV * H.D)
    assert spec.page_size_bytes == 2 * 16 * H.HKV * H.D
    for layout in ("LBHNC", "LHBNC"):
        caches = H.allocate(spec, 6, LAYERS, layout)
        kv = caches[LAYERS[1]]
        assert tuple(kv.shape) == (6, 2, 16, H.HKV * H.D) and kv.dtype == torch.uint8
        kc, vc = pav.kv_cache_views(kv, H.HKV, H.D, H.FP8)
        assert tuple(kc.shape) == (6, H.HKV, H.D // 16, 16, 16) and tuple(vc.shape) == (6, H.HKV, 1, H.D, 16)
        assert kc.stride(0) == kv.stride(0) and vc.stride(0) == kv.stride(0)
        # block 3's K page is the bytes of kv[3, 0], its V page those of kv[3, 1]
        kv[3].view(torch.uint8).copy_(torch.arange(kv[3].numel(), dtype=torch.int64).remainder(251)
                                      .to(torch.uint8).view(kv[3].shape))
        assert torch.equal(kc[3].view(torch.uint8).flatten(), kv[3, 0].view(torch.uint8).flatten())
        assert torch.equal(vc[3].view(torch.uint8).flatten(), kv[3, 1].view(torch.uint8).flatten())
    # a page padded to a larger size (hybrid models): the block stride grows, the views follow it
    padded = H.backend_spec(block_size=16, page_size_padded=spec.page_size_bytes + 4096)
    kv = H.allocate(padded, 4, LAYERS[:1], "LBHNC")[LAYERS[0]]
    kc, vc = pav.kv_cache_views(kv, H.HKV, H.D, H.FP8)
    assert kc.stride(0) == kv.stride(0) == padded.page_size_bytes


def test_token_major_layout_rejected_with_the_fix():
    spec = H.backend_spec(block_size=16)
    kv = H.allocate(spec, 4, LAYERS[:1], "LBNHC")[LAYERS[0]]
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBHNC"):
        pav.kv_cache_views(kv, H.HKV, H.D, H.FP8)
    assert pav.FlyDSLAttentionBackend.supported_kv_cache_layouts()[0].name == "LBHNC"


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])  # cuda: the Triton kernels
@pytest.mark.parametrize("bs", [16, 48])
@pytest.mark.parametrize("name, prefix, query, expect_ql", [
    ("decode", (14, 33, 0, 47), (1, 1, 1, 1), 1),
    ("spec_decode", (14, 33, 5, 47), (3, 3, 3, 3), 3),
    ("prefill", (0, 0, 0), (15, 8, 20), 0),
    ("mixed", (20, 5, 0, 70), (1, 1, 7, 1), 0),
    ("chunked", (32, 0), (16, 16), 0),
])
def test_builder_and_forward_match_sdpa(model_dir, name, prefix, query, expect_ql, bs, dev, monkeypatch):
    spec = H.backend_spec(block_size=bs)
    builder, _ = _builder(model_dir, spec)
    b = H.Batch(prefix_lens=prefix, query_lens=query, block_size=bs, num_blocks=40, seed=zlib.crc32(name.encode()) % 97)
    rows = H.block_rows(b, max_blocks=8)
    cam = H.common_metadata(b, rows, device=dev)
    md = builder.build(0, cam)
    assert md.query_length == expect_ql
    # the routing: one plan per step, decode (pa_decode's kernels) for uniform batches, else prefill
    assert md.plan.is_decode == bool(expect_ql) and md.plan.num_seqs == cam.num_reqs
    g = torch.Generator().manual_seed(7)
    k_all, v_all = H.random_kv(b, g)
    ks, vs = 0.5, 0.25
    impl = H.make_impl(pa_impl="triton" if dev == "cuda" else "torch")
    layer = H.layer_with_scales(ks, vs, device=dev)
    caches = H.allocate(spec, b.num_blocks, LAYERS, "LBHNC", device=dev)
    kv = caches[LAYERS[0]]
    other = caches[LAYERS[1]].view(torch.uint8).clone()
    H.write_prefix(impl, layer, kv, b, rows, k_all, v_all, device=dev)
    k_new, v_new = (t.to(dev) for t in H.new_tokens(b, k_all, v_all))
    impl.do_kv_cache_update(layer, k_new, v_new, kv, cam.slot_mapping)
    T = cam.num_actual_tokens
    q = torch.randn(T, H.HQ, H.D, generator=g).bfloat16()
    out = torch.full((T, H.HQ, H.D), float("nan"), dtype=torch.bfloat16, device=dev)
    impl.forward(layer, q.to(dev), k_new, v_new, kv, md, out)
    want = H.sdpa_reference(q, k_all, v_all, b, H.D ** -0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float().cpu(), want, atol=ATOL, rtol=RTOL)
    # only live slots were written: the rest (block 0 included) still holds the sentinel; layer 1 untouched
    sb = H.slot_bytes(kv, bs).cpu()
    dead = torch.ones(sb.shape[0], dtype=torch.bool)
    dead[H.live_slots(b, rows)] = False
    assert bool((sb[dead] == H.SENTINEL_BYTE).all())
    assert torch.equal(caches[LAYERS[1]].view(torch.uint8), other)


def test_sliding_window_and_sinks_match_sdpa(model_dir):
    bs = 16
    spec = H.backend_spec(block_size=bs)
    builder, _ = _builder(model_dir, spec)
    g = torch.Generator().manual_seed(3)
    sinks = torch.randn(H.HQ, generator=g)
    for prefix, query in (((40, 9, 70), (1, 1, 1)), ((30, 0), (5, 12))):
        b = H.Batch(prefix_lens=prefix, query_lens=query, block_size=bs, num_blocks=24, seed=len(prefix))
        rows = H.block_rows(b, max_blocks=6)
        cam = H.common_metadata(b, rows)
        md = builder.build(0, cam)
        k_all, v_all = H.random_kv(b, g)
        impl, layer = H.make_impl(sliding_window=8, sinks=sinks.bfloat16()), H.layer_with_scales()
        impl.process_weights_after_loading(torch.bfloat16)
        kv = H.allocate(spec, b.num_blocks, LAYERS[:1], "LHBNC")[LAYERS[0]]
        H.write_prefix(impl, layer, kv, b, rows, k_all, v_all)
        k_new, v_new = H.new_tokens(b, k_all, v_all)
        impl.do_kv_cache_update(layer, k_new, v_new, kv, cam.slot_mapping)
        q = torch.randn(cam.num_actual_tokens, H.HQ, H.D, generator=g).bfloat16()
        out = torch.empty_like(q)
        impl.forward(layer, q, k_new, v_new, kv, md, out)
        want = H.sdpa_reference(q, k_all, v_all, b, H.D ** -0.5, sliding_window=8,
                                sinks=sinks.bfloat16().float())
        torch.testing.assert_close(out.float(), want, atol=ATOL, rtol=RTOL)


def test_sinks_follow_the_live_parameter(model_dir):
    """vLLM keeps the sinks as a model-dtype parameter and may change it in place (a weight sync) or
    reload it: the next forward uses the new values, through one fp32 buffer whose address a captured
    graph can keep."""
    bs = 16
    spec = H.backend_spec(block_size=bs)
    builder, _ = _builder(model_dir, spec)
    g = torch.Generator().manual_seed(3)
    sinks = torch.nn.Parameter(torch.randn(H.HQ, generator=g).bfloat16(), requires_grad=False)
    b = H.Batch(prefix_lens=(40, 9), query_lens=(1, 1), block_size=bs, num_blocks=24, seed=1)
    rows = H.block_rows(b, max_blocks=6)
    cam = H.common_metadata(b, rows)
    md = builder.build(0, cam)
    k_all, v_all = H.random_kv(b, g)
    impl, layer = H.make_impl(sinks=sinks), H.layer_with_scales()
    impl.process_weights_after_loading(torch.bfloat16)
    kv = H.allocate(spec, b.num_blocks, LAYERS[:1])[LAYERS[0]]
    H.write_prefix(impl, layer, kv, b, rows, k_all, v_all)
    k_new, v_new = H.new_tokens(b, k_all, v_all)
    impl.do_kv_cache_update(layer, k_new, v_new, kv, cam.slot_mapping)
    q = torch.randn(2, H.HQ, H.D, generator=g).bfloat16()

    def check():
        out = torch.full_like(q, float("nan"))
        impl.forward(layer, q, k_new, v_new, kv, md, out)
        want = H.sdpa_reference(q, k_all, v_all, b, H.D ** -0.5, sinks=sinks.detach().float())
        torch.testing.assert_close(out.float(), want, atol=ATOL, rtol=RTOL)

    check()
    address = impl._sinks_f32.data_ptr()
    with torch.no_grad():
        sinks.copy_(torch.full_like(sinks, 5.0))  # large sinks: most of each row's weight goes to the sink
    check()
    impl.process_weights_after_loading(torch.bfloat16)  # a reload
    with torch.no_grad():
        sinks.copy_(torch.randn(H.HQ, generator=g).bfloat16())
    check()
    assert impl._sinks_f32.data_ptr() == address


def test_decode_plan_is_reused_across_steps_on_the_runner_buffers(model_dir):
    """The runner refills the same persistent buffers every step: the builder makes one decode plan per
    (requests, context bound) and reuses it (the kernels read tables and lengths on the device), so a
    later step with other contexts and other blocks still matches SDPA; another request count, another
    power-of-two context bound, a prefill step or other buffers get other plans."""
    import dataclasses

    bs, cols = 16, 8
    spec = H.backend_spec(block_size=bs)
    builder, _ = _builder(model_dir, spec)
    bt_buf = torch.zeros(6, cols, dtype=torch.int32)  # the runner's persistent buffers (max_num_seqs 6)
    sl_buf = torch.zeros(6, dtype=torch.int32)

    def step(b, rows):
        cam = H.common_metadata(b, rows)
        R = cam.num_reqs
        bt_buf[:R].copy_(cam.block_table_tensor)
        sl_buf[:R].copy_(cam.seq_lens)
        return dataclasses.replace(cam, block_table_tensor=bt_buf[:R], seq_lens=sl_buf[:R]), b, rows

    impl, layer = H.make_impl(), H.layer_with_scales(0.5, 0.25)
    plans = []
    for seed, prefix in ((1, (20, 70)), (2, (90, 3)), (3, (33, 40))):  # max_seq_len 71, 91, 41: bound 128 / 128 / 64
        b = H.Batch(prefix_lens=prefix, query_lens=(1, 1), block_size=bs, num_blocks=30, seed=seed)
        cam, b, rows = step(b, H.block_rows(b, cols))
        md = builder.build(0, cam)
        assert md.query_length == 1
        plans.append(md.plan)
        g = torch.Generator().manual_seed(seed)
        k_all, v_all = H.random_kv(b, g)
        kv = H.allocate(spec, b.num_blocks, LAYERS[:1])[LAYERS[0]]
        H.write_prefix(impl, layer, kv, b, rows, k_all, v_all)
        k_new, v_new = H.new_tokens(b, k_all, v_all)
        impl.do_kv_cache_update(layer, k_new, v_new, kv, cam.slot_mapping)
        q = torch.randn(2, H.HQ, H.D, generator=g).bfloat16()
        out = torch.full((2, H.HQ, H.D), float("nan"), dtype=torch.bfloat16)
        impl.forward(layer, q, k_new, v_new, kv, md, out)
        want = H.sdpa_reference(q, k_all, v_all, b, H.D ** -0.5, k_scale=0.5, v_scale=0.25)
        torch.testing.assert_close(out.float(), want, atol=ATOL, rtol=RTOL)
    assert plans[1] is plans[0] and plans[2] is not plans[0]  # same bound (128) reused; 64 is another plan
    assert plans[0].max_context == 128 and plans[2].max_context == 64
    three = H.Batch(prefix_lens=(20, 70, 5), query_lens=(1, 1, 1), block_size=bs, num_blocks=30, seed=4)
    assert builder.build(0, step(three, H.block_rows(three, cols))[0]).plan is not plans[0]
    first = H.Batch(prefix_lens=(20, 70), query_lens=(1, 1), block_size=bs, num_blocks=30, seed=1)
    assert builder.build(0, H.common_metadata(first, H.block_rows(first, cols))).plan is not plans[0]  # other buffers
    mixed = H.Batch(prefix_lens=(20, 70), query_lens=(3, 1), block_size=bs, num_blocks=30, seed=5)
    md = builder.build(0, step(mixed, H.block_rows(mixed, cols))[0])
    assert not md.plan.is_decode and md.plan is not plans[0]
    # back on the runner's buffers: planned once more (the fresh tables above replaced its entry), then reused
    again = builder.build(0, step(first, H.block_rows(first, cols))[0]).plan
    assert builder.build(0, step(first, H.block_rows(first, cols))[0]).plan is again


def test_decode_plans_of_fresh_tables_do_not_pile_up(model_dir):
    """Tables and lengths made afresh every step (vLLM's chunked local attention builds its virtual batches
    that way, Llama-4): each step is planned on its own tensors, and the builder keeps one plan per shape
    (holding the last step's tensors), not one per step."""
    bs, cols = 16, 8
    builder, _ = _builder(model_dir, H.backend_spec(block_size=bs))
    b = H.Batch(prefix_lens=(20, 70), query_lens=(1, 1), block_size=bs, num_blocks=30, seed=1)
    rows = H.block_rows(b, cols)
    for _ in range(40):
        cam = H.common_metadata(b, rows)  # new tensors every step
        plan = builder.build(0, cam).plan
        assert plan.batch.block_tables.data_ptr() == cam.block_table_tensor.data_ptr()
        assert plan.batch.context_lengths.data_ptr() == cam.seq_lens.data_ptr()
    assert len(builder._plans) == 1


def test_non_causal_attention_is_refused(model_dir):
    """A prefix-LM decoder (vLLM's PrefillPrefixLMAttention) validates as a plain decoder: its spec says
    non_causal (refused when the builder is made, at start-up) and its builds ask for causal=False (refused,
    never computed causally)."""
    import dataclasses

    spec = H.backend_spec(block_size=16)
    with pytest.raises(ValueError, match="non-causally.*TRITON_ATTN"):
        _builder(model_dir, dataclasses.replace(spec, non_causal=True))
    builder, _ = _builder(model_dir, spec)
    b = H.Batch(prefix_lens=(0,), query_lens=(12,), block_size=16, num_blocks=4)
    cam = H.common_metadata(b, H.block_rows(b, 4))
    with pytest.raises(NotImplementedError, match="non-causal"):
        builder.build(0, dataclasses.replace(cam, causal=False))
    assert builder.build(0, cam).plan is not None



@pytest.mark.parametrize("ql", [1, 2])
def test_cudagraph_capture_metadata_and_padded_batch(model_dir, ql):
    """What the FULL-graph runner does: capture metadata on a uniform batch (seq_lens forced to 1), then a
    padded step (requests with query 0, seq_len 0, null block 0, slots -1): live rows right, padded rows
    finite and harmless, only live slots written."""
    from vllm.v1.attention.backend import AttentionCGSupport

    bs = 16
    spec = H.backend_spec(block_size=bs)
    builder, vc = _builder(model_dir, spec, full_graphs=True)
    assert builder.get_cudagraph_support(vc, spec) == AttentionCGSupport.UNIFORM_BATCH
    cap = H.Batch(prefix_lens=(0,) * 4, query_lens=(ql,) * 4, block_size=bs, num_blocks=30, seed=1)
    cam = H.common_metadata(cap, H.block_rows(cap, 6))
    md = builder.build_for_cudagraph_capture(cam)
    assert md.query_length == ql and md.seq_lens.tolist() == [1] * 4
    assert md.seq_lens.data_ptr() == cam.seq_lens.data_ptr()  # the runner's persistent buffer, filled in place
    assert md.block_tables.data_ptr() == cam.block_table_tensor.data_ptr()

    live = H.Batch(prefix_lens=(20, 37), query_lens=(ql, ql), block_size=bs, num_blocks=30, seed=2, pad_reqs=2)
    rows = H.block_rows(live, 6)
    cam = H.common_metadata(live, rows)
    md = builder.build(0, cam)
    assert md.query_length == ql and md.num_reqs == 4 and md.num_actual_tokens == 4 * ql
    g = torch.Generator().manual_seed(5)
    k_all, v_all = H.random_kv(live, g)
    impl, layer = H.make_impl(), H.layer_with_scales(0.5, 0.5)
    kv = H.allocate(spec, live.num_blocks, LAYERS[:1])[LAYERS[0]]
    H.write_prefix(impl, layer, kv, live, rows, k_all, v_all)
    k_new, v_new = H.new_tokens(live, k_all, v_all)
    pad = torch.randn(2 * ql, H.HKV, H.D, generator=g).bfloat16()
    impl.do_kv_cache_update(layer, torch.cat([k_new, pad]), torch.cat([v_new, pad]), kv, cam.slot_mapping)
    q = torch.randn(4 * ql, H.HQ, H.D, generator=g).bfloat16()
    out = torch.full((4 * ql, H.HQ, H.D), float("nan"), dtype=torch.bfloat16)
    impl.forward(layer, q, torch.cat([k_new, pad]), torch.cat([v_new, pad]), kv, md, out)
    want = H.sdpa_reference(q, k_all, v_all, live, H.D ** -0.5, k_scale=0.5, v_scale=0.5)
    torch.testing.assert_close(out[:2 * ql].float(), want, atol=ATOL, rtol=RTOL)
    assert bool(torch.isfinite(out.float()).all())
    sb = H.slot_bytes(kv, bs)
    dead = torch.ones(sb.shape[0], dtype=torch.bool)
    dead[H.live_slots(live, rows)] = False
    assert bool((sb[dead] == H.SENTINEL_BYTE).all())  # block 0 and every other unassigned slot untouched


def test_graph_support_drops_for_long_speculation(model_dir):
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    spec = H.backend_spec()
    _, vc = _builder(model_dir, spec)
    vc2 = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4))
    cls = pav.FlyDSLAttentionMetadataBuilder
    assert cls.get_cudagraph_support(vc2, spec) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    vc3 = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3))
    assert cls.get_cudagraph_support(vc3, spec) == AttentionCGSupport.UNIFORM_BATCH
    builder, _ = _builder(model_dir, spec, full_graphs=True)
    mixed = H.Batch(prefix_lens=(5, 0), query_lens=(1, 4), block_size=16, num_blocks=10)
    with pytest.raises(NotImplementedError, match="uniform"):
        builder.build_for_cudagraph_capture(H.common_metadata(mixed, H.block_rows(mixed, 2)))


@pytest.mark.parametrize("backend_name, n, parallel, rocm, refused", [
    ("FLYDSL", 2, False, True, True),
    ("CUSTOM", 3, False, True, True),
    ("FLYDSL", 1, False, True, False),  # one draft token: vLLM skips its check
    ("FLYDSL", 3, True, True, False),  # parallel drafting: skipped too
    ("FLYDSL", 3, False, False, False),  # CUDA: no allow-list
    ("TRITON_ATTN", 3, False, True, False),  # the draft on vLLM's own backend
])
def test_draft_model_on_flydsl_drafting_several_tokens_on_rocm_is_refused_at_start_up(
        model_dir, monkeypatch, backend_name, n, parallel, rocm, refused):
    """vLLM 0.33's ROCm drafter accepts only its own backends' metadata for sequential multi-token drafts
    (llm_base_proposer.py, allowed_attn_types): a draft on FLYDSL failed at the first drafting step."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from flydsl_backends.plugins import register_vllm

    register_vllm()
    spec = H.backend_spec()
    vc = H.vllm_config(model_dir, block_size=spec.block_size)
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self=None: rocm)
    vc.speculative_config = SimpleNamespace(attention_backend=AttentionBackendEnum[backend_name],
                                            num_speculative_tokens=n, parallel_drafting=parallel)
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vc):
        if refused:
            with pytest.raises(ValueError, match="attention_backend unset"):
                pav.FlyDSLAttentionMetadataBuilder(spec, LAYERS, vc, torch.device("cpu"))
        else:
            pav.FlyDSLAttentionMetadataBuilder(spec, LAYERS, vc, torch.device("cpu"))


def test_profiling_run_and_unsupported_impl_args():
    impl = H.make_impl()
    out = torch.full((3, H.HQ, H.D), float("nan"), dtype=torch.bfloat16)
    impl.forward(H.layer_with_scales(), out, None, None, torch.empty(0), None, out)
    assert bool((out == 0).all())
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8"):
        pav.FlyDSLAttentionImpl(H.HQ, H.D, 0.125, H.HKV, None, None, "auto")
    with pytest.raises(ValueError, match="GQA"):
        pav.FlyDSLAttentionImpl(34, H.D, 0.125, 2, None, None, "fp8")
    with pytest.raises(ValueError, match="ALiBi"):
        pav.FlyDSLAttentionImpl(H.HQ, H.D, 0.125, H.HKV, [0.1] * H.HQ, None, "fp8")
    with pytest.raises(ValueError, match="decoder"):
        pav.FlyDSLAttentionImpl(H.HQ, H.D, 0.125, H.HKV, None, None, "fp8", None, "encoder")
    with pytest.raises(ValueError, match="kv_cache"):
        pav.kv_cache_views(torch.zeros(4, 3, 16, 128, dtype=torch.uint8), H.HKV, H.D, H.FP8)


def test_uniform_query_length_rules():
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    assert pav.uniform_query_length(t([0, 1, 2, 3]), 3, 3, 1) == 1
    assert pav.uniform_query_length(t([0, 1, 2, 3, 3]), 4, 4, 1) == 1  # one padded request
    assert pav.uniform_query_length(t([0, 2, 4, 4, 4]), 4, 8, 2) == 2
    assert pav.uniform_query_length(t([0, 1, 3]), 2, 3, 2) == 0  # ragged
    assert pav.uniform_query_length(t([0, 5, 10]), 2, 10, 5) == 0  # past pa_decode's query_length limit
    assert pav.uniform_query_length(t([0, 0, 1]), 2, 2, 1) == 0  # a zero-length request before a live one


def test_package_import_does_not_pull_vllm():
    """The package and the plugin module import no vLLM (the adapter module does, when vLLM resolves the
    backend's path)."""
    import subprocess
    import sys

    code = ("import sys; import pa_backend, flydsl_backends.plugins; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'triton', 'flydsl')]; "
            "assert not bad, bad[:5]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------------------------
# GPU: real CUDA-graph capture of do_kv_cache_update + forward (Triton ops), padded replays == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ql", [1, 3], ids=["decode", "spec_decode3"])
def test_cuda_graph_replays_equal_eager_gpu(model_dir, ql):
    from vllm.config import set_current_vllm_config

    dev, bs, max_reqs = "cuda", 16, 4
    spec = H.backend_spec(block_size=bs)
    vc = H.vllm_config(model_dir, block_size=bs, full_graphs=True)
    with set_current_vllm_config(vc):
        builder = pav.FlyDSLAttentionMetadataBuilder(spec, LAYERS, vc, torch.device(dev))
    caches = H.allocate(spec, 40, LAYERS, "LBHNC", device=dev)
    impl, layer = H.make_impl(pa_impl="triton"), H.layer_with_scales(0.5, 0.5, device=dev)
    g = torch.Generator().manual_seed(9)
    prefix = (20, 37, 5)
    steps = 3
    full = H.Batch(prefix_lens=prefix, query_lens=(ql * steps,) * 3, block_size=bs, num_blocks=40, seed=4)
    rows = H.block_rows(full, 8)
    k_all, v_all = H.random_kv(full, g)
    for kv in caches.values():
        H.write_prefix(impl, layer, kv, H.Batch(prefix, (0,) * 3, bs, 40), rows, k_all, v_all, device=dev)

    # the runner's persistent buffers (capture: uniform batch, seq_lens 1)
    T = max_reqs * ql
    cap = H.common_metadata(H.Batch((0,) * max_reqs, (ql,) * max_reqs, bs, 40), [[0] * 8] * max_reqs, device=dev)
    q_s = torch.zeros(T, H.HQ, H.D, dtype=torch.bfloat16, device=dev)
    k_s = torch.zeros(T, H.HKV, H.D, dtype=torch.bfloat16, device=dev)
    v_s = torch.zeros_like(k_s)
    outs = [torch.zeros(T, H.HQ, H.D, dtype=torch.bfloat16, device=dev) for _ in LAYERS]
    md = builder.build_for_cudagraph_capture(cap)
    cap.slot_mapping.fill_(-1)

    def body():
        for name, o in zip(LAYERS, outs):
            impl.do_kv_cache_update(layer, k_s, v_s, caches[name], cap.slot_mapping)
            impl.forward(layer, q_s, k_s, v_s, caches[name], md, o)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()

    for step in range(steps):
        n_live = 3  # every request advances each step (the reference reads all its tokens); 1 padded request
        b = H.Batch(prefix_lens=tuple(p + step * ql for p in prefix[:n_live]), query_lens=(ql,) * n_live,
                    block_size=bs, num_blocks=40, pad_reqs=max_reqs - n_live)
        live_rows = rows[:n_live]
        step_cam = H.common_metadata(b, live_rows, device=dev)
        for dst, src in ((cap.query_start_loc, step_cam.query_start_loc), (cap.seq_lens, step_cam.seq_lens),
                         (cap.block_table_tensor, step_cam.block_table_tensor),
                         (cap.slot_mapping, step_cam.slot_mapping)):
            dst.copy_(src)
        cap.query_start_loc_cpu.copy_(step_cam.query_start_loc_cpu)
        md2 = builder.build(0, cap)  # what the runner does every step: same buffers, same decision
        assert md2.query_length == ql and md2.seq_lens.data_ptr() == md.seq_lens.data_ptr()
        q = torch.randn(T, H.HQ, H.D, generator=g).bfloat16()
        knew, vnew = H.new_tokens(b, [k_all[r] for r in range(n_live)], [v_all[r] for r in range(n_live)])
        pad = torch.zeros((T - knew.shape[0], H.HKV, H.D), dtype=torch.bfloat16)
        q_s.copy_(q), k_s.copy_(torch.cat([knew, pad])), v_s.copy_(torch.cat([vnew, pad]))
        graph.replay()
        torch.cuda.synchronize()
        got = [o[:n_live * ql].clone() for o in outs]
        eager = torch.empty_like(outs[0])
        for name, o in zip(LAYERS, got):
            impl.do_kv_cache_update(layer, k_s, v_s, caches[name], step_cam.slot_mapping)
            impl.forward(layer, q_s, k_s, v_s, caches[name], builder.build(0, step_cam), eager)
            torch.testing.assert_close(o.float(), eager[:n_live * ql].float(), atol=1e-3, rtol=1e-3)
        want = H.sdpa_reference(q, k_all[:n_live], v_all[:n_live], b, H.D ** -0.5, k_scale=0.5, v_scale=0.5)
        torch.testing.assert_close(got[0].float().cpu(), want, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------
# GPU: one plan per batch; the layers of a step do not sync the host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, prefix, query", [
    ("decode", (14, 33, 5, 47), (1, 1, 1, 1)),  # the decode plan
    ("mixed", (20, 5, 0, 70), (1, 1, 7, 1)),  # decode + prefill rows: the prefill plan
])
def test_one_plan_per_batch_multi_layer_step_does_not_sync_gpu(model_dir, name, prefix, query):
    """The builder makes the batch's one plan; a layer's do_kv_cache_update + forward then only launches
    (Triton ops). After the first layer (launch state: may sync), a 4-layer step, each layer with its own
    cache, K/V and query, runs under torch.cuda.set_sync_debug_mode("error") (a host sync raises) and
    every layer matches SDPA over its own K/V."""
    dev, bs = "cuda", 16
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    spec = H.backend_spec(block_size=bs)
    builder, _ = _builder(model_dir, spec)
    b = H.Batch(prefix_lens=prefix, query_lens=query, block_size=bs, num_blocks=40, seed=6)
    rows = H.block_rows(b, max_blocks=8)
    cam = H.common_metadata(b, rows, device=dev)
    md = builder.build(0, cam)
    assert md.plan.is_decode == (name == "decode")
    impl, layer = H.make_impl(pa_impl="triton"), H.layer_with_scales(0.5, 0.25, device=dev)
    caches = H.allocate(spec, b.num_blocks, names, "LBHNC", device=dev)
    g = torch.Generator().manual_seed(13)
    T = cam.num_actual_tokens
    args, wants = [], []
    for n in names:  # every host-to-device copy before the checked step
        k_all, v_all = H.random_kv(b, g)
        H.write_prefix(impl, layer, caches[n], b, rows, k_all, v_all, device=dev)
        k_new, v_new = (t.to(dev) for t in H.new_tokens(b, k_all, v_all))
        q = torch.randn(T, H.HQ, H.D, generator=g).bfloat16()
        out = torch.full((T, H.HQ, H.D), float("nan"), dtype=torch.bfloat16, device=dev)
        args.append((q.to(dev), k_new, v_new, caches[n], out))
        wants.append(H.sdpa_reference(q, k_all, v_all, b, H.D ** -0.5, k_scale=0.5, v_scale=0.25))

    def attention_layer(q, k, v, kv, out):  # what vLLM runs per attention layer
        impl.do_kv_cache_update(layer, k, v, kv, cam.slot_mapping)
        impl.forward(layer, q, k, v, kv, md, out)

    attention_layer(*args[0])  # first layer: launch state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for a in args:  # one step: every layer on the batch's metadata and plan
            attention_layer(*a)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(md.plan.state) == 1  # one launch state, made by the first layer, run by all
    for (*_, out), want in zip(args, wants):
        torch.testing.assert_close(out.float().cpu(), want, atol=ATOL, rtol=RTOL)


def test_host_time_script_times_the_adapters_layer_path():
    """integration_tests/vllm/host_time.py (a measurement, not a timed test): every timed layer call went
    through do_kv_cache_update and forward down to the ops' dispatch (the null implementation counts)."""
    from integration_tests.vllm import host_time

    r = host_time.adapter_host_time(layers=20, B=2, context=40, table_tokens=256)
    assert r["calls"] == {"write_kv": 20, "pa_decode": 20}
    assert r["layer"] > 0 and r["build"] > 0
