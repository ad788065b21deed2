"""Reference KDA decode: readable torch, one loop over rows, FP32 math (docs/design.md §3).

``run_reference`` executes a validated problem; the public entry points are
``kda_backend.kda_decode(..., backend="torch")`` or its alias ``kda_decode_ref``.
``kda_step_math`` is the bare per-row math in any floating dtype; the long-horizon drift test
runs it in float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # annotations only (the contract imports the registry, which imports this)
    from .contract import KDAProblem

__all__ = ["run_reference", "kda_step_math", "kda_gate", "gated_rmsnorm"]


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float]) -> torch.Tensor:
    """Log-decay g [H, K] from the raw gate a [H, K] (A_log [H], dt_bias [H, K])."""
    z = a + dt_bias
    A = torch.exp(A_log)[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * z)
    return -A * F.softplus(z, beta=1.0, threshold=20.0)


def kda_step_math(
    y: torch.Tensor,  # [3, H, K] post-conv, post-activation q|k|v
    a: torch.Tensor,  # [H, K] raw gate
    b: torch.Tensor,  # [H] raw beta
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,  # [H, K]
    S: torch.Tensor,  # [H, V, K] recurrent state (updated and returned)
    *,
    scale: float,
    lower_bound: Optional[float],
) -> tuple:
    """One KDA recurrence step for one row; returns (o [H, V], new S). Dtype of the inputs."""
    q, k, v = y[0], y[1], y[2]
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = kda_gate(a, A_log, dt_bias, lower_bound)  # [H, K]
    beta = torch.sigmoid(b)  # [H]
    S = S * torch.exp(g)[:, None, :]  # decay each K column
    v_new = beta[:, None] * (v - (S * k[:, None, :]).sum(-1))  # [H, V]
    S = S + v_new[:, :, None] * k[:, None, :]
    o = (S * q[:, None, :]).sum(-1)  # [H, V]
    return o, S


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o / sqrt(mean(o^2) + eps) * weight * sigmoid(gate), per head (last dim)."""
    return o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * weight * torch.sigmoid(gate)


@torch.inference_mode()  # writes the caller's caches as the kernels do: inference tensors, leaves that require grad
def run_reference(p: KDAProblem, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Execute a validated problem row by row, updating the caches in place like the kernels."""
    H, K = p.H, p.K
    f = compute_dtype
    A_log = p.A_log.to(f)
    dt_bias = p.dt_bias.to(f).view(H, K)
    for n in range(p.B):
        s = int(p.state_indices[n])
        if s < 0 or s >= p.num_slots:  # padding row: zero output, caches untouched
            p.out[n].zero_()
            continue
        x = p.x[n].to(f)
        if p.has_conv:
            window = torch.cat([p.conv_state[s].to(f), x[:, None]], dim=1)  # [C, W], newest last
            y = (window * p.conv_weight.to(f)).sum(-1)
            if p.conv_bias is not None:
                y = y + p.conv_bias.to(f)
            y = F.silu(y)
            p.conv_state[s].copy_(window[:, 1:].to(p.conv_state.dtype))
        else:
            y = x
        if p.has_f_b:
            a = torch.einsum("r,hkr->hk", p.f_a[n].to(f), p.f_b_weight.to(f))  # FP32, never rounded
        else:
            a = p.a[n].to(f).view(H, K)
        o, S = kda_step_math(
            y.view(3, H, K), a, p.b[n].to(f), A_log, dt_bias, p.state[s].to(f),
            scale=p.scale, lower_bound=p.lower_bound,
        )
        p.state[s].copy_(S.to(p.state.dtype))  # one rounding on store
        if p.has_norm:
            o = gated_rmsnorm(o, p.output_gate[n].to(f), p.norm_weight.to(f), p.norm_eps)
        p.out[n].copy_(o.to(p.out.dtype))
    return p.out
