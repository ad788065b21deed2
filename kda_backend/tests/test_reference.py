"""The FP32 reference against an independent float64 formulation of the same step.

Independent: the conv is ``F.conv1d`` (groups = channels) over the explicit window, the delta
rule is the matrix form S' = S·D·(I - β k kᵀ) + β v kᵀ with D = diag(exp(g)), and the gates are
written from the formulas of docs/design.md §3 without the reference's helpers.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kda_backend.cases import clone_caches, make_case, rel_err
from kda_backend.reference import run_reference


def independent_step(kw, with_f_b: bool):
    x = kw["x"].double()
    B, C = x.shape
    state = kw["state"]
    H, V, K = state.shape[1:]
    idx = kw["state_indices"].long()
    conv_w = kw["conv_weight"]
    nslots = state.shape[0] if conv_w is None else min(state.shape[0], kw["conv_state"].shape[0])
    outs, states, convs = [], {}, {}
    for n in range(B):
        s = int(idx[n])
        if not 0 <= s < nslots:
            outs.append(torch.zeros(H, V, dtype=torch.float64))
            continue
        if conv_w is not None:
            window = torch.cat([kw["conv_state"][s].double(), x[n][:, None]], 1)  # [C, W]
            y = F.conv1d(window[None], conv_w.double()[:, None, :],
                         bias=None if kw.get("conv_bias") is None else kw["conv_bias"].double(), groups=C)[0, :, 0]
            y = y * torch.sigmoid(y)
            convs[s] = window[:, 1:]
        else:
            y = x[n]
        q, k, v = y.view(3, H, K).unbind(0)
        if with_f_b:
            a = torch.stack([kw["f_b_weight"][h].double() @ kw["f_a"][n].double() for h in range(H)])
        else:
            a = kw["a"][n].double().view(H, K)
        o_heads, S_heads = [], []
        for h in range(H):
            z = a[h] + kw["dt_bias"].double().view(H, K)[h]
            A = math.exp(float(kw["A_log"][h]))
            lb = kw.get("lower_bound")
            if lb is not None:
                g = lb / (1 + torch.exp(-A * z))
            else:
                g = -A * torch.where(z > 20, z, torch.log1p(torch.exp(z)))
            beta = 1 / (1 + math.exp(-float(kw["b"].reshape(B, H)[n, h])))
            qh = q[h] / torch.sqrt(q[h] @ q[h] + 1e-6) * (K ** -0.5)
            kh = k[h] / torch.sqrt(k[h] @ k[h] + 1e-6)
            S = state[s, h].double()
            D = torch.diag(torch.exp(g))
            S = S @ D @ (torch.eye(K, dtype=torch.float64) - beta * torch.outer(kh, kh)) + beta * torch.outer(v[h], kh)
            o = S @ qh
            if kw["norm_weight"] is not None:
                gate = kw["output_gate"][n, h].double()
                o = o / torch.sqrt((o * o).mean() + 1e-5) * kw["norm_weight"].double() / (1 + torch.exp(-gate))
            o_heads.append(o)
            S_heads.append(S)
        outs.append(torch.stack(o_heads))
        states[s] = torch.stack(S_heads)
    return torch.stack(outs), states, convs


CASES = [
    dict(B=3, H=2, K=16, W=4, padding=[1]),
    dict(B=3, H=2, K=16, W=3, conv_layout="channel", conv_bias=True, out_of_range=[2]),
    dict(B=2, H=2, K=16, W=2, with_f_b=True, R=8, lower_bound=-5.0),
    dict(B=2, H=1, K=16, norm=False, state_dtype=torch.bfloat16),
    dict(B=2, H=3, K=16, conv=False),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_reference_matches_independent_float64(params):
    case = make_case(**params, seed=7)
    kw0 = clone_caches(case).kwargs  # inputs before the step
    run = clone_caches(case)
    run_reference(run.problem())
    out64, states64, convs64 = independent_step(kw0, case.with_f_b)
    live = case.live_rows
    assert rel_err(run.kwargs["out"][live].double(), out64[live]) < 8e-3  # one bf16 rounding
    st_tol = 1e-5 if params.get("state_dtype", torch.float32) == torch.float32 else 8e-3
    for s, S in states64.items():
        assert rel_err(run.kwargs["state"][s], S) < st_tol
    for s, c in convs64.items():
        assert torch.equal(run.kwargs["conv_state"][s].double(), c)
    dead = [n for n in range(params["B"]) if n not in live]
    assert (run.kwargs["out"][dead] == 0).all()


def test_softplus_threshold_and_safe_gate():
    from kda_backend.reference import kda_gate

    a = torch.tensor([[-30.0, 0.0, 19.0, 25.0]])
    A_log = torch.tensor([0.0])
    zero = torch.zeros(1, 4)
    g = kda_gate(a, A_log, zero, None)
    assert torch.allclose(g[0, 3], torch.tensor(-25.0))  # past the threshold softplus(z) = z
    assert torch.allclose(g[0, 1], torch.tensor(-math.log(2.0)))
    lb = kda_gate(a, A_log, zero, -5.0)
    assert torch.all(lb <= 0) and torch.all(lb >= -5.0)
    assert torch.allclose(lb[0, 1], torch.tensor(-2.5))
