"""Pretrained models (SmolLM2-135M-Instruct, Gemma 3 270M; ``real_models``) served by a real SGLang
0.5.23 engine with ``--attention-backend flydsl`` and an FP8 KV cache, against HF transformers whose K
and V go through the same FP8 rounding and scale (``serving_accuracy.HFRunner(kv="fp8")``).

The same workload and thresholds as ``test_vllm_real_models`` (which also reports the plain-bf16 HF
line). Gemma 3 runs with ``disable_hybrid_swa_memory`` (the flydsl backend applies the window in the
kernel over one pool); the scheduler's trace (``sglang_cpu.install_trace``) counts each step's layer
calls: 15 with the window, 3 without.

CPU (CI): ``sglang_cpu``'s test platform, this project's attention on the torch reference.

Run: PYTHONPATH=integration_tests/stubs /path/to/venv-sgl/bin/python -m pytest -q \\
         integration_tests/e2e/test_sglang_real_models.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from integration_tests.e2e import sglang_cpu  # noqa: E402

sglang_cpu.skip_without_engine()
pytest.importorskip("gguf")

from flydsl_backends import serving_accuracy as sa  # noqa: E402
from integration_tests.e2e import real_models  # noqa: E402


@pytest.fixture(scope="module", params=sorted(real_models.MODELS, reverse=True))  # smollm2 first
def case(request):
    if torch.cuda.is_available():
        pytest.skip("the CPU engine case")
    c = real_models.build_case(request.param)
    yield c
    c.reference.close()
    gc.collect()


@pytest.fixture(scope="module")
def served(case, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    sglang_cpu.prepare(tmp_path_factory.mktemp("sgl_platform"), mp)
    trace = tmp_path_factory.mktemp("sgl_trace") / "attention.jsonl"
    mp.setenv(sglang_cpu.TRACE_ENV, str(trace))
    kw = dict(device="cpu", disable_cuda_graph=True, max_total_tokens=16384, sleep_on_idle=True)
    if case.name == "gemma3":
        kw["disable_hybrid_swa_memory"] = True
    try:
        r = sa.SGLangRunner(str(case.path), "flydsl", **kw)
        try:
            gens = r.generate(case.prompts)
            ppl = sa.perplexity(r.score([case.ppl_ids])[0].logprobs)
        finally:
            r.close()
    finally:
        mp.undo()
    return gens, ppl, sglang_cpu.read_trace(trace)


def test_flydsl_matches_the_fp8_reference(case, served):
    gens, ppl, _ = served
    row = case.check("sglang flydsl", gens, ppl)
    real_models.report("sglang", case.name, [row])
    assert row.prompts_passed == row.prompts, row.failures
    assert row.top1 >= sa.MIN_TOP1, row.top1
    assert abs(row.ppl_delta) <= sa.MAX_PPL_DELTA, (row.ppl, row.ppl_ref)


def test_every_layer_ran_on_flydsl_with_its_window(case, served):
    """Each planned batch ran once per layer, the sliding layers with the model's window and the global
    ones without; FP8 caches. (SGLang's Gemma 3 layers hold ``sliding_window - 1``: keys q-w..q, w + 1
    tokens, which the adapter hands on as the op's window of w + 1 tokens.)"""
    _, _, calls = served
    assert calls, "no attention call reached the flydsl backend"
    assert {c["kv_dtype"] for c in calls} == {"torch.float8_e4m3fn"}
    types = case.layer_types()
    per_plan = {}
    for c in calls:
        per_plan.setdefault(c["plan"], []).append(c["sliding_window"])
    want = sorted(case.config["sliding_window"] if t == "sliding" else 0 for t in types)
    assert all(sorted(w) == want for w in per_plan.values()), {k: v for k, v in list(per_plan.items())[:2]}
    assert len(per_plan) >= 32  # a prefill and 31 decode steps at least
    if case.name == "gemma3":
        assert types.count("sliding") == 15 and types.count("full") == 3
