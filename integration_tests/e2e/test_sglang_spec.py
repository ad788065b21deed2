"""Speculative decoding through a real SGLang 0.5.23 engine (``sglang.Engine``, scheduler in its own
process) with ``attention_backend="flydsl"`` and an FP8 KV cache, on CPU: the target model's
TARGET_VERIFY batches (draft chains of ``speculative_num_draft_tokens`` rows per request) run
through this project's multi-token decode path (``pa_decode`` with ``query_length`` 2 and 4).

STANDALONE speculative decoding (a separate draft model, ``speculative_eagle_topk=1``), with 2 and
with 4 tokens per verify (``speculative_num_steps`` 1 and 3; 4 is the adapter's limit). The draft is a
second copy of the tiny model (``tiny_model``: a planted copy-back head, so greedy tokens prove
correct K/V reads), so its drafts are right and nearly all are accepted: every row of a verify
decides an output token, and the K/V every row wrote is read back 7 tokens later (a verify row
whose K/V is not written to its own slot, or a read of the wrong pages, breaks the copy rule). The
causal mask among one verify's rows is not what these tokens check (the planted head looks 7 back);
``integration_tests/sglang/test_attn_backend.py`` compares verify batches with SGLang's torch_native
extend for that. The draft runs on SGLang's ``torch_native`` backend and its own KV pool; the
stand-ins this CPU platform needs (tree build / greedy verify, the draft's attention backends,
Triton's interpreter for SGLang's spec-path kernels) are described in
``sglang_cpu.install_spec_seams``.

EAGLE speculative decoding (``speculative_algorithm="EAGLE"``, topk 1, 2 tokens per verify): the
draft is a one-layer ``LlamaForCausalLMEagle`` (EAGLE-2, ``sglang/srt/models/llama_eagle.py``) built
at run time from the target's weights (``build_eagle_draft``), fed the target's hidden states and
sharing the target's embedding and LM head; it also runs on ``torch_native`` with its own KV pool.
Same checks as the STANDALONE cases: greedy tokens follow the copy rule and equal HF's greedy tokens
of the target, every request verified with nearly all drafts accepted (accept length 2.0 of 2 here),
and every decode-path batch on flydsl was a target verify of 2 rows per request (FP8 KV cache).
Controls run by hand, then undone: rolling the K cache's pages for decode-path batches inside the
trace wrapper made the EAGLE case fail on the copy rule (agreement 0.71); zeroing the draft's
embedding half of ``fc`` left the tokens right but dropped the accept length to 1.04 and failed the
acceptance check (so the EAGLE draft is what proposes the accepted tokens).

Runtime on 2 idle CPU cores: about 41-50 s for the file, of which the EAGLE case is about 10-11 s.
On an NVIDIA GPU (``benchmarks/device_run.sh spec-sglang``: ``sglang_gpu``'s platform, SGLang's spec kernels
native, the target on this project's Triton kernels): 3 passed on the H200 at 392bd45 (173 s).

Run: PYTHONPATH=integration_tests/stubs /path/to/venv-sgl/bin/python -m pytest -q \\
         integration_tests/e2e/test_sglang_spec.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from integration_tests.e2e import sglang_cpu  # noqa: E402

sglang_cpu.skip_without_engine()

from integration_tests.e2e import tiny_model as tm  # noqa: E402

PAGE = 16
NEW_TOKENS = 24


def build_eagle_draft(path, target_dir):
    """A one-layer EAGLE(-2) draft for the tiny target (``LlamaForCausalLMEagle``,
    ``sglang/srt/models/llama_eagle.py``): ``fc`` maps [token embedding, target hidden state] to the
    layer's input, the layer has no ``input_layernorm`` (EAGLE's layer 0) and the model no final
    norm, and the embedding and LM head are the target's (SGLang's EAGLE worker shares them:
    ``set_embed_and_head``). Its layer is the target's layer 0 (the planted copy-back head) fed the
    embedding scaled by sqrt(2) (what RMSNorm makes of these embeddings), with small seeded weights
    on the hidden-state half: the draft's position p embeds token p + 1, so its head 7 back proposes
    the copy-rule token and nearly every draft is accepted."""
    from safetensors.torch import load_file

    w = load_file(str(Path(target_dir) / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    fc = torch.zeros(tm.HIDDEN, 2 * tm.HIDDEN)
    fc[:, :tm.HIDDEN] = torch.eye(tm.HIDDEN) * 2 ** 0.5
    fc[:, tm.HIDDEN:] = torch.randn(tm.HIDDEN, tm.HIDDEN, generator=g) * tm.NOISE
    d = {"fc.weight": fc, "fc.bias": torch.zeros(tm.HIDDEN), "embed_tokens.weight": w["model.embed_tokens.weight"]}
    d.update({k[len("model."):]: v for k, v in w.items()
              if k.startswith("model.layers.0.") and "input_layernorm" not in k})
    cfg = dict(tm.config(), architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    return tm.write_model(path, cfg, {k: v.to(torch.bfloat16).contiguous() for k, v in d.items()})


def _speculate(tmp_path_factory, algorithm, draft_tokens):
    """Build the target (and the draft ``algorithm`` needs), serve 8 prompts greedily with
    ``draft_tokens`` per verify, check the tokens and the flydsl trace."""
    cuda = torch.cuda.is_available()  # the GPU run: sglang_gpu's platform, SGLang's spec kernels native
    root = tmp_path_factory.mktemp(f"sgl_{algorithm.lower()}")
    target = tm.build(root / "target")
    draft = build_eagle_draft(root / "draft", target) if algorithm == "EAGLE" else tm.build(root / "draft")
    trace, kernels = root / "attention.jsonl", root / "triton_kernels.log"
    mp = pytest.MonkeyPatch()
    if cuda:
        from integration_tests.e2e import sglang_gpu

        sglang_gpu.prepare(root / "platform", mp, speculative=True)
    else:
        sglang_cpu.prepare(root / "platform", mp, speculative=True)
    mp.setenv(sglang_cpu.TRACE_ENV, str(trace))
    mp.setenv(sglang_cpu.TRITON_LOG_ENV, str(kernels))
    import sglang

    prompts = tm.prompts(8, seed=11, length=(10, 40))
    eng = None
    try:
        eng = sglang.Engine(model_path=str(target), attention_backend="flydsl", kv_cache_dtype="fp8_e4m3",
                            page_size=PAGE, device="cuda" if cuda else "cpu", skip_tokenizer_init=True,
                            dtype="bfloat16",
                            random_seed=0, disable_cuda_graph=True, max_total_tokens=8192, max_running_requests=8,
                            context_length=1024, log_level="warning", sleep_on_idle=True,
                            speculative_algorithm=algorithm, speculative_draft_model_path=str(draft),
                            speculative_eagle_topk=1, speculative_num_steps=draft_tokens - 1,
                            speculative_num_draft_tokens=draft_tokens,
                            speculative_draft_attention_backend=sglang_cpu.DRAFT_BACKEND)
        outs = eng.generate(input_ids=[list(p) for p in prompts],
                            sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
    finally:
        if eng is not None:
            eng.shutdown()
        mp.undo()
    gen = [list(o["output_ids"]) for o in outs]
    for p, g, o in zip(prompts, gen, outs):
        assert o["meta_info"]["finish_reason"]["type"] == "length", o["meta_info"]
        assert len(g) == NEW_TOKENS
        assert tm.copy_rule_agreement(p, g) == 1.0, (p, g)
    assert gen == tm.hf_greedy(target, prompts, NEW_TOKENS)

    # the engine speculated: verify steps ran and (a copy-rule draft) nearly every draft was accepted
    verify_ct = [o["meta_info"].get("spec_verify_ct", 0) for o in outs]
    accept = [o["meta_info"].get("spec_accept_length", 0) for o in outs]
    assert all(c > 0 for c in verify_ct), verify_ct
    assert min(accept) >= 0.9 * draft_tokens, accept

    calls = sglang_cpu.read_trace(trace)
    assert calls and all(c["pid"] != os.getpid() for c in calls)
    assert {c["kv_dtype"] for c in calls} == {"torch.float8_e4m3fn"}
    assert {(tuple(c["k_shape"][1:]), tuple(c["v_shape"][1:])) for c in calls} == {
        ((tm.KV_HEADS, tm.HEAD_DIM // 16, PAGE, 16), (tm.KV_HEADS, PAGE // 16, tm.HEAD_DIM, 16))}, calls[0]
    # only the target runs on flydsl (the draft is on torch_native): prefill plans and verify plans
    decode = [c for c in calls if c["decode"]]
    assert decode, "no decode-path batch reached the flydsl backend"
    assert all(set(c["rows"]) == {draft_tokens} for c in decode), \
        {tuple(c["rows"]) for c in decode}  # every decode-path batch was a target verify of n rows/request
    assert max(len(c["rows"]) for c in decode) == len(prompts)
    plans = {c["plan"] for c in decode}
    assert len(plans) >= max(verify_ct), (len(plans), verify_ct)
    # every counted verify ran on flydsl; on a GPU SGLang's overlap scheduler may already have launched one
    # more verify for a request whose last counted one finished it (its result is dropped): H200, 4 tokens
    # per verify, 56 verify rows per layer for 48 counted verifies of 8 requests
    verified = sum(len(c["rows"]) for c in decode) // tm.LAYERS
    assert sum(verify_ct) <= verified <= sum(verify_ct) + (len(prompts) if cuda else 0), (len(decode), verify_ct)
    # some verify's query rows straddle a page end (its context ends 1..n-1 tokens into a new page)
    assert any(0 < ctx % PAGE < draft_tokens for c in decode for ctx in c["ctx"])

    if cuda:  # the kernel log records interpreted launches (CPU) only
        return
    launched = {line.split()[0] for line in kernels.read_text().splitlines()} if kernels.exists() else set()
    assert {"sglang.kernels.ops.speculative.spec_tree:sgl_build_tree_kernel_efficient_triton",
            "sglang.kernels.ops.speculative.spec_tree:verify_tree_greedy_kernel_triton"} <= launched, launched
    assert not any(k.startswith("pa_backend") for k in launched), launched


@pytest.mark.parametrize("draft_tokens", [2, 4])  # the verify query length: bonus token + draft steps
def test_standalone_speculative_decoding_verifies_on_flydsl(tmp_path_factory, draft_tokens):
    _speculate(tmp_path_factory, "STANDALONE", draft_tokens)


def test_eagle_speculative_decoding_verifies_on_flydsl(tmp_path_factory):
    _speculate(tmp_path_factory, "EAGLE", 2)
