"""``kda_verify`` (buffer form) against SGLang 0.5.23's own target-verify kernels on the same inputs: its
``causal_conv1d_update`` with ``intermediate_conv_window`` (and ``retrieve_next_token`` /
``retrieve_next_sibling`` for trees), then ``fused_sigmoid_gating_delta_rule_update`` with
``intermediate_states_buffer`` / ``intermediate_state_indices`` / ``retrieve_parent_token`` (the two
launches of ``KDAAttnBackend``'s target verify with the Triton verify kernel). Both run on CPU under
Triton's interpreter; ours on the reference and on its Triton kernel.

SGLang rounds the conv output to bf16 between its launches and keeps a BF16 state in FP32 across the
tokens of a request; the fused op does neither (its contract is k decode steps): outputs and states
agree to bf16 precision, the per-step conv windows bit for bit.

Run: /tmp/venvs/sgl/bin/python -m pytest -q integration_tests/sglang/test_kda_verify.py
"""

from __future__ import annotations

import pytest
import torch

try:
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang 0.5.23 is not importable here ({type(exc).__name__}: {exc})", allow_module_level=True)

from kda_backend import VERIFY_REGISTRY, kda_verify  # noqa: E402

IMPLS = [n for n in ("torch", "triton") if VERIFY_REGISTRY.get(n).is_available()[0]]


def _tree(B, T, g):
    """parents [B, T] (column 0: -1) and SGLang's first-child / next-sibling arrays for the same trees."""
    par = torch.full((B, T), -1, dtype=torch.int64)
    nxt = torch.full((B, T), -1, dtype=torch.int64)
    sib = torch.full((B, T), -1, dtype=torch.int64)
    for n in range(B):
        for t in range(1, T):
            par[n, t] = int(torch.randint(0, t, (1,), generator=g))
        for p in range(T):
            kids = [t for t in range(1, T) if int(par[n, t]) == p]
            if kids:
                nxt[n, p] = kids[0]
                for a, b in zip(kids, kids[1:]):
                    sib[n, a] = b
    return par, nxt, sib


def _inputs(B, T, H, K, W, state_dtype, tree, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    C, N = 3 * H * K, B * T
    slots, rows = B + 3, B + 2
    cache = torch.randperm(slots, generator=g)[:B].to(torch.int32)
    inter = torch.randperm(rows, generator=g)[:B].to(torch.int32)
    state = torch.full((slots, H, K, K), 1e30).to(state_dtype)
    conv = torch.full((slots, W - 1, C), 1e30, dtype=torch.bfloat16)  # SGLang's width-major pool
    for n in range(B):
        state[int(cache[n])] = rnd(H, K, K, scale=0.5).to(state_dtype)
        conv[int(cache[n])] = rnd(W - 1, C).to(torch.bfloat16)
    par, nxt, sib = _tree(B, T, g) if tree else (None, None, None)
    return dict(x=rnd(N, C).to(torch.bfloat16), conv_weight=rnd(C, W, scale=0.5), conv_bias=rnd(C, scale=0.1),
                conv=conv, a=rnd(N, H * K).to(torch.bfloat16), b=rnd(N, H).to(torch.bfloat16),
                A_log=rnd(H, scale=0.5), dt_bias=rnd(H * K, scale=0.5), state=state, cache=cache, inter=inter,
                rows=rows, par=par, nxt=nxt, sib=sib, qsl=torch.arange(0, N + 1, T, dtype=torch.int32))


def _sglang(inp, B, T, H, K, W, lower_bound):
    x, C = inp["x"], inp["x"].shape[1]
    icw = torch.full((inp["rows"], T, W - 1, C), float("nan"), dtype=torch.bfloat16)
    isb = torch.full((inp["rows"], T, H, K, K), float("nan"), dtype=inp["state"].dtype)
    par_out = torch.zeros(B, T, dtype=torch.int64) if inp["par"] is not None else None
    tree = inp["par"] is not None
    y = causal_conv1d_update(x.view(B, T, C).transpose(1, 2), inp["conv"].clone().transpose(-1, -2),
                             inp["conv_weight"], inp["conv_bias"], activation="silu", conv_state_indices=inp["cache"],
                             intermediate_conv_window=icw.transpose(-1, -2), intermediate_state_indices=inp["inter"],
                             retrieve_next_token=inp["nxt"] if tree else None,
                             retrieve_next_sibling=inp["sib"] if tree else None, retrieve_parent_token=par_out)
    y = y.transpose(1, 2).reshape(B * T, C)
    q, k, v = (t.reshape(1, B * T, H, K) for t in y.split(H * K, dim=-1))
    o = fused_sigmoid_gating_delta_rule_update(
        A_log=inp["A_log"], a=inp["a"], dt_bias=inp["dt_bias"], softplus_beta=1.0, softplus_threshold=20.0,
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), b=inp["b"], initial_state_source=inp["state"].clone(),
        initial_state_indices=inp["cache"], use_qk_l2norm_in_kernel=True, cu_seqlens=inp["qsl"], is_kda=True,
        lower_bound=lower_bound, disable_state_update=True, intermediate_states_buffer=isb,
        intermediate_state_indices=inp["inter"], cache_steps=T, retrieve_parent_token=par_out)
    return o.reshape(B * T, H, K), isb, icw


def _ours(inp, B, T, H, K, W, lower_bound, impl):
    C = inp["x"].shape[1]
    scs = torch.full((inp["rows"], T, W - 1, C), float("nan"), dtype=torch.bfloat16)
    ss = torch.full((inp["rows"], T, H, K, K), float("nan"), dtype=inp["state"].dtype)
    conv = inp["conv"].clone()
    out = kda_verify(inp["x"], inp["conv_weight"], conv.transpose(-1, -2), inp["a"], inp["b"], inp["A_log"],
                     inp["dt_bias"], inp["state"].clone(), inp["cache"], None, None, step_state=ss,
                     step_state_indices=inp["inter"], step_conv_state=scs.transpose(-1, -2),
                     parent_indices=inp["par"], conv_bias=inp["conv_bias"], lower_bound=lower_bound, backend=impl)
    assert torch.equal(conv, inp["conv"]), "the committed conv state was written"
    return out, ss, scs


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [
    dict(T=4, tree=False, state_dtype=torch.float32, lower_bound=None),
    dict(T=5, tree=True, state_dtype=torch.float32, lower_bound=-5.0),
    dict(T=4, tree=True, state_dtype=torch.bfloat16, lower_bound=None),
])
def test_verify_matches_sglang_target_verify(impl, case):
    B, T, H, K, W = 2, case["T"], 2, 32, 4
    inp = _inputs(B, T, H, K, W, case["state_dtype"], case["tree"], seed=4)
    if case["tree"]:
        assert any(int(inp["par"][n, t]) != t - 1 for n in range(B) for t in range(1, T)), "a chain: pick a seed"
    o_s, ss_s, cw_s = _sglang(inp, B, T, H, K, W, case["lower_bound"])
    o_o, ss_o, cw_o = _ours(inp, B, T, H, K, W, case["lower_bound"], impl)
    assert _rel(o_o, o_s) < 2e-2
    for n in range(B):
        r = int(inp["inter"][n])
        assert torch.equal(cw_o[r], cw_s[r]), n
        for t in range(T):
            assert _rel(ss_o[r, t], ss_s[r, t]) < 2e-2, (n, t)
    unused = [r for r in range(inp["rows"]) if r not in inp["inter"].tolist()]
    assert torch.isnan(ss_o[unused].float()).all() and torch.isnan(cw_o[unused].float()).all()
