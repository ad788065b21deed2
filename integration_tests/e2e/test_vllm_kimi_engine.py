"""A real vLLM 0.33 engine (``vllm.LLM``, CPU worker) serving a tiny Kimi-Linear model (3 KDA layers
+ 1 MLA layer, ``tiny_kimi``) with this project's KDA decode hook on (``additional_config
{"flydsl_kda": true}``: pure decode batches run ``kda_backend.kda_decode``, the torch reference on
CPU) and off (vLLM's own Triton decode kernel, run by the Triton interpreter).

What it takes on CPU (``vllm_kimi.prepare_cpu``): torch stand-ins for the compiled ops on the path
(MLA decode / cache insert, the CPU conv-state update), the Triton interpreter for vLLM's KDA
kernels (FP32 compute for bf16 activations: the interpreter has no bf16 arithmetic), and CPU_MLA
accepting the hybrid's 128-multiple manager block. See that module.

Same weights, dtype (bf16 activations, FP32 recurrent state) and prompts in both runs: 6 prompts
of 10-40 tokens, 16-26 greedy tokens each, at most 4 sequences at a time, so the engine runs
batched prefill, pure decode batches (the hook's path) and mixed prefill+decode batches (vLLM's
path in both runs, the hook must hand them back). Criterion (vLLM's ``check_logprobs_close``): per
prompt, at the first position where the runs' tokens differ, each run's token must be in the
other's top-5 logprobs. The on-run must actually have used our op.

Measured (2 CPU cores): 6 prompts — 5/6 sequences identical, max |logprob difference| 0.093 over 123
compared positions; 8 prompts (16-30 tokens) — 5/8 identical, the other 3 part at near-ties (the two
chosen tokens within 0.07 nats, each in the other's top-5). Control: the hook reading each row's state
from the neighbouring row's slot fails the rule on 8/8 prompts at the first decode token.

Runtime on 2 CPU cores: about 3.5 minutes with 6 prompts (two engines; the interpreter dominates; 8
prompts took 5.5). It must run in its own pytest process (Triton has to be enabled before anything
imports ``vllm.triton_utils``; after another vLLM engine test it skips, saying so).
Run: VLLM_TARGET_DEVICE=cpu /path/to/venv-vllm/bin/python -m pytest -q integration_tests/e2e/test_vllm_kimi_engine.py
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("vllm")

from integration_tests.e2e import (
    tiny_kimi,  # noqa: E402
    vllm_kimi,  # noqa: E402
)

PROMPTS = 6  # 8 took ~5.5 min on 2 cores; 6 keeps CI under 20 min
NEW_TOKENS = 16  # prompt i gets NEW_TOKENS + 2 i: staggered finishes give mixed prefill+decode batches
TOP = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_kimi.build(tmp_path_factory.mktemp("tiny_kimi"))


def _serve(model_dir, hook: bool):
    """Greedy tokens and top-5 logprobs of the prompts, and how many times our op ran."""
    if torch.cuda.is_available():
        pytest.skip("the CPU engine case")
    try:
        vllm_kimi.prepare_cpu()
    except vllm_kimi.TritonUnavailable as exc:
        pytest.skip(str(exc))
    from vllm import LLM, SamplingParams

    import kda_backend.api as api

    calls = []
    original = api.kda_decode

    def counted(*args, **kwargs):  # kda_backend.vllm imports api.kda_decode at call time
        calls.append(int(kwargs["x"].shape[0]))
        return original(*args, **kwargs)

    api.kda_decode = counted
    try:
        llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0, enforce_eager=True,
                  compilation_config={"custom_ops": ["none"]}, max_num_seqs=4, max_model_len=512,
                  enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
                  additional_config={"flydsl_kda": hook})
        prompts = tiny_kimi.prompts(PROMPTS, seed=1)
        params = [SamplingParams(max_tokens=NEW_TOKENS + 2 * i, temperature=0.0, ignore_eos=True, logprobs=TOP)
                  for i in range(PROMPTS)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        res = [(list(o.outputs[0].token_ids), [{int(t): float(lp.logprob) for t, lp in d.items()}
                                               for d in o.outputs[0].logprobs]) for o in outs]
        del llm
        gc.collect()
    finally:
        api.kda_decode = original
    return res, calls


def compare(a, b, top=TOP):
    """vLLM's check_logprobs_close rule over sequences ``a`` and ``b`` ([(ids, logprob dicts)]).
    Returns (failures, identical sequences, compared positions, max |logprob difference| of the
    chosen token over the positions before each sequence's first difference)."""
    failures, same, positions, max_diff = [], 0, 0, 0.0
    for i, ((ids_a, lp_a), (ids_b, lp_b)) in enumerate(zip(a, b)):
        assert len(ids_a) == len(ids_b)
        for j, (ta, tb) in enumerate(zip(ids_a, ids_b)):
            positions += 1
            if ta != tb:
                top_a = sorted(lp_a[j], key=lp_a[j].get, reverse=True)[:top]
                top_b = sorted(lp_b[j], key=lp_b[j].get, reverse=True)[:top]
                if ta not in top_b or tb not in top_a:
                    failures.append(f"prompt {i} position {j}: {ta} vs {tb} (top-{top} {top_a} / {top_b})")
                break
            max_diff = max(max_diff, abs(lp_a[j][ta] - lp_b[j][tb]))
        else:
            same += 1
    return failures, same, positions, max_diff


@pytest.fixture(scope="module")
def runs(model_dir):
    off, off_calls = _serve(model_dir, hook=False)
    on, on_calls = _serve(model_dir, hook=True)
    return off, off_calls, on, on_calls


def test_hook_ran_on_decode_batches_only_when_enabled(runs):
    off, off_calls, on, on_calls = runs
    assert off_calls == []
    # 3 KDA layers per decode step; decode batches of 1-4 rows (the engine never pads on CPU)
    assert len(on_calls) >= 3 * NEW_TOKENS and len(on_calls) % 3 == 0
    assert set(on_calls) <= {1, 2, 3, 4} and 4 in on_calls
    assert [len(ids) for ids, _ in on] == [NEW_TOKENS + 2 * i for i in range(PROMPTS)]


def test_hook_on_matches_vllm_kda_decode(runs):
    off, _, on, _ = runs
    failures, same, positions, max_diff = compare(on, off)
    print(f"\nKimi-Linear on vLLM, KDA decode hook on vs off: {same}/{PROMPTS} sequences identical, "
          f"{positions} positions compared, max |logprob diff| {max_diff:.4f}")
    assert not failures, failures


# --- the stand-ins against straightforward references (fast, no engine) ------------------------------

def test_mla_decode_stand_in_is_paged_softmax_attention():
    g = torch.Generator().manual_seed(0)
    blocks, bs, width, rank, heads = 9, 16, 576, 512, 2
    cache = torch.randn(blocks, bs, width, generator=g)
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    q = torch.randn(2, heads, width, generator=g)
    out = torch.empty(2, heads, rank)
    vllm_kimi._mla_decode(out, q, cache, 0.1, table, lens)
    for i in range(2):
        kv = torch.cat([cache[int(b)] for b in table[i]])[: int(lens[i])]
        ref = torch.softmax(q[i] @ kv.T * 0.1, dim=-1) @ kv[:, :rank]
        torch.testing.assert_close(out[i], ref)


def test_conv_update_stand_in_matches_vllm_torch_conv():
    pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_torch

    g = torch.Generator().manual_seed(1)
    dim, width, slots = 12, 4, 5
    state = torch.randn(slots, dim, width - 1, generator=g)
    x = torch.randn(3, dim, generator=g)
    w = torch.randn(dim, width, generator=g)
    idx = torch.tensor([4, 0, 2])  # row 1 is padding (null block 0)
    ref_state = state.clone()
    ref = causal_conv1d_update_torch(x[[0, 2]].unsqueeze(-1), ref_state[[4, 2]], w, None, "silu").squeeze(-1)
    expect_state = state.clone()
    expect_state[[4, 2]] = torch.cat([state[[4, 2]], x[[0, 2]].unsqueeze(-1)], dim=-1)[..., 1:]
    out = vllm_kimi._conv_update(x, state, w, None, "silu", idx, None, 0)
    torch.testing.assert_close(out[[0, 2]], ref)
    assert torch.count_nonzero(out[1]) == 0
    torch.testing.assert_close(state, expect_state)


def test_latent_insert_stand_in_writes_live_slots_and_leaves_padding_rows():
    g = torch.Generator().manual_seed(2)
    blocks, bs, rank, rope = 4, 16, 8, 4
    cache = torch.full((blocks, bs, rank + rope), 1e30)
    kv_c = torch.randn(3, rank, generator=g)
    k_pe = torch.randn(3, 1, rope, generator=g)
    slots = torch.tensor([37, -1, 18, -1])  # row 1 is CUDA-graph padding; the mapping may be longer than the rows
    expect = cache.clone()
    expect[2, 5] = torch.cat([kv_c[0], k_pe[0, 0]])
    expect[1, 2] = torch.cat([kv_c[2], k_pe[2, 0]])
    vllm_kimi._insert_latent(kv_c, k_pe, cache, slots, bs)
    torch.testing.assert_close(cache, expect, rtol=0, atol=0)
