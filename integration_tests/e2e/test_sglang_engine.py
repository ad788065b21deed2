"""A real SGLang 0.5.23 engine (``sglang.Engine``, scheduler in its own process) serving a model
built at run time with ``attention_backend="flydsl"`` and an FP8 KV cache, on CPU (issue 16).

``sglang_cpu.prepare`` declares a test-side out-of-tree CPU platform (SGLang's own CPU device
operations; torch-native layers; no sgl_kernel, Triton or graphs) through SGLang's platform plugin
group, and the installed ``sglang.srt.plugins`` entry point registers ``flydsl``; the attention
kernels are this project's torch reference. The model (``tiny_model``) copies the token COPY_BACK
positions back, so every greedy token checks the K/V the backend read; tokens are also compared with
HF transformers running the same weights. A trace written by the scheduler process
(``sglang_cpu.install_trace``) proves the batches ran through the flydsl backend.

One engine: server-width block tables (context 131072), radix (prefix) cache on, chunked prefill at
64 tokens, mixed prefill + decode batches (``enable_mixed_chunk``).

Run: PYTHONPATH=integration_tests/stubs /path/to/venv-sgl/bin/python -m pytest -q \\
         integration_tests/e2e/test_sglang_engine.py
"""

from __future__ import annotations

import pytest
import torch

from integration_tests.e2e import sglang_cpu  # noqa: E402

sglang_cpu.skip_without_engine()

from integration_tests.e2e import tiny_model as tm  # noqa: E402

NEW_TOKENS = 24
CHUNK = 64
PAGE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.build(tmp_path_factory.mktemp("tiny_llama_sgl"))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return tmp_path_factory.mktemp("sgl_trace") / "attention.jsonl"


@pytest.fixture(scope="module")
def engine(model_dir, trace, tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the CPU engine case")
    mp = pytest.MonkeyPatch()
    sglang_cpu.prepare(tmp_path_factory.mktemp("sgl_platform"), mp)
    mp.setenv(sglang_cpu.TRACE_ENV, str(trace))
    import sglang

    eng = sglang.Engine(model_path=str(model_dir), attention_backend="flydsl", kv_cache_dtype="fp8_e4m3",
                        page_size=PAGE, device="cpu", skip_tokenizer_init=True, dtype="bfloat16", random_seed=0,
                        disable_cuda_graph=True, max_total_tokens=16384, max_running_requests=16,
                        chunked_prefill_size=CHUNK, enable_mixed_chunk=True, log_level="warning",
                        # an idle scheduler otherwise polls at 100% of a core: half of a 2-core CI box,
                        # taken from the HF references this process computes between batches
                        sleep_on_idle=True)
    try:
        yield eng
    finally:
        eng.shutdown()
        mp.undo()


def _generate(eng, trace, prompts, n=NEW_TOKENS):
    """Greedy tokens of ``prompts`` (one batch) and the attention calls the scheduler made for them."""
    trace.write_text("")
    outs = eng.generate(input_ids=[list(p) for p in prompts],
                        sampling_params={"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    calls = sglang_cpu.read_trace(trace)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "length", o["meta_info"]
    return [list(o["output_ids"]) for o in outs], outs, calls


def _check_calls(calls):
    """Every attention call ran in a scheduler process (not this one), on this project's FP8 pool
    (``FlyDSLMHATokenToKVPool``: K [blocks, Hkv, D/16, page, 16], V [blocks, Hkv, page/16, D, 16]),
    and each planned batch ran once per layer."""
    import os

    assert calls, "no attention call reached the flydsl backend"
    assert all(c["pid"] != os.getpid() for c in calls)
    assert {c["kv_dtype"] for c in calls} == {"torch.float8_e4m3fn"}, {c["kv_dtype"] for c in calls}
    assert {(tuple(c["k_shape"][1:]), tuple(c["v_shape"][1:])) for c in calls} == {
        ((tm.KV_HEADS, tm.HEAD_DIM // 16, PAGE, 16), (tm.KV_HEADS, PAGE // 16, tm.HEAD_DIM, 16))}, calls[0]
    per_plan = {}
    for c in calls:
        per_plan[c["plan"]] = per_plan.get(c["plan"], 0) + 1
    assert set(per_plan.values()) == {tm.LAYERS}, per_plan


def test_greedy_tokens_follow_the_kv_and_match_hf(engine, model_dir, trace):
    prompts = tm.prompts(16, seed=1)
    gen, _, calls = _generate(engine, trace, prompts)
    for p, g in zip(prompts, gen):
        assert len(g) == NEW_TOKENS
        assert tm.copy_rule_agreement(p, g) == 1.0, (p, g)
    assert gen == tm.hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert tm.hf_argmax_agreement(model_dir, prompts, gen) >= 0.999
    _check_calls(calls)
    decode = [c for c in calls if c["decode"]]
    assert decode and max(len(c["rows"]) for c in decode) >= 8, "no decode batch of >= 8 sequences"
    assert any(not c["decode"] for c in calls), "no prefill batch ran through the backend"
    # every generated token after the first came from a decode (or mixed) step of the backend
    assert sum(len(c["rows"]) for c in decode) // tm.LAYERS >= 16 * (NEW_TOKENS - 2) * 0.5


def test_radix_cache_shared_prefix(engine, model_dir, trace):
    """A 64-token shared prefix: once cached, later requests prefill only their suffix (their
    extend batches read the cached pages: context > query rows) and still follow the copy rule
    and equal HF's greedy tokens."""
    shared = tm.prompts(1, seed=7, length=(64, 64))[0]
    first, _, _ = _generate(engine, trace, [shared + [5, 6, 7]], n=8)
    prompts = tm.prompts(8, seed=2, length=(5, 30), prefix=shared)
    gen, outs, calls = _generate(engine, trace, prompts, n=16)
    cached = [o["meta_info"].get("cached_tokens", 0) for o in outs]
    assert all(c >= 48 for c in cached), cached  # page-aligned part of the shared prefix
    for p, g in zip(prompts, gen):
        assert tm.copy_rule_agreement(p, g) == 1.0, (p, g)
    assert gen == tm.hf_greedy(model_dir, prompts, 16)
    _check_calls(calls)
    prefill = [c for c in calls if not c["decode"]]
    assert any(ctx > rows for c in prefill for rows, ctx in zip(c["rows"], c["ctx"]) if rows > 1), \
        "no extend over cached pages ran through the backend"


def test_chunked_prefill_mixed_with_decodes(engine, model_dir, trace):
    """Prompts of 150-260 tokens (chunked at 64 tokens) next to short ones that are already decoding:
    some steps are mixed batches (decode rows of 1 query token and prefill chunks in one ragged
    batch), and later chunks attend to the earlier chunks' pages."""
    prompts = tm.prompts(6, seed=3, length=(8, 16)) + tm.prompts(2, seed=4, length=(150, 260))
    gen, _, calls = _generate(engine, trace, prompts)
    for p, g in zip(prompts, gen):
        assert tm.copy_rule_agreement(p, g) == 1.0, (p, g)
    assert gen == tm.hf_greedy(model_dir, prompts, NEW_TOKENS)
    _check_calls(calls)
    prefill = [c for c in calls if not c["decode"]]
    assert any(ctx > rows > 1 for c in prefill for rows, ctx in zip(c["rows"], c["ctx"])), \
        "no later prefill chunk (context beyond its own rows) ran"
    assert max(sum(c["rows"]) for c in prefill) <= CHUNK + 16, "a prefill batch exceeded the chunk size"
    mixed = [c for c in prefill if 1 in c["rows"] and max(c["rows"]) > 1]
    assert mixed, "no mixed batch (decode rows + a prefill chunk) ran through the backend"


def test_retraction(model_dir, trace, tmp_path_factory):
    """Retraction (SGLang's preemption): with SGLang's own test switch ``SGLANG_TEST_RETRACT`` the
    scheduler retracts running decode requests every 3rd step (``ScheduleBatch.retract_decode``:
    their KV pages freed, the requests queued again and re-prefilled, partly from the radix cache).
    Every request still follows the copy rule and equals HF's greedy tokens."""
    mp = pytest.MonkeyPatch()
    sglang_cpu.prepare(tmp_path_factory.mktemp("sgl_platform_retract"), mp)
    mp.setenv(sglang_cpu.TRACE_ENV, str(trace))
    mp.setenv("SGLANG_TEST_RETRACT", "1")
    import sglang

    eng = sglang.Engine(model_path=str(model_dir), attention_backend="flydsl", kv_cache_dtype="fp8_e4m3",
                        page_size=PAGE, device="cpu", skip_tokenizer_init=True, dtype="bfloat16", random_seed=0,
                        disable_cuda_graph=True, max_total_tokens=4096, max_running_requests=8,
                        chunked_prefill_size=CHUNK, context_length=512, log_level="warning", sleep_on_idle=True)
    try:
        prompts = tm.prompts(8, seed=5, length=(20, 60))
        gen, outs, calls = _generate(eng, trace, prompts, n=32)
    finally:
        eng.shutdown()
        mp.undo()
    retractions = [o["meta_info"].get("num_retractions", 0) for o in outs]
    assert sum(retractions) > 0, retractions
    for p, g in zip(prompts, gen):
        assert tm.copy_rule_agreement(p, g) == 1.0, (p, g)
    assert gen == tm.hf_greedy(model_dir, prompts, 32)
    _check_calls(calls)
