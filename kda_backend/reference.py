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
    from .verify_contract import KDAVerifyProblem

__all__ = ["run_reference", "run_verify_reference", "kda_step_math", "kda_gate", "gated_rmsnorm"]


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


def _valid(i: int, n: int) -> bool:
    return 0 <= i < n


@torch.inference_mode()
def run_verify_reference(p: KDAVerifyProblem, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Execute a validated verify problem request by request, token by token (``kda_verify``'s contract).

    Every token's state is the ``kda_step_math`` step from its parent's state (the previous token, the
    tree parent, or the committed state for token 0), rounded to the state dtype as a decode step
    stores it; its conv window is its ancestors' x rows behind the committed window."""
    H, K, W = p.H, p.K, p.W
    f = compute_dtype
    A_log = p.A_log.to(f)
    dt_bias = p.dt_bias.to(f).view(H, K)
    sdt = p.state.dtype
    for n in range(p.B):
        if p.query_start_loc is not None:
            r0 = int(p.query_start_loc[n])
            Tn = min(max(int(p.query_start_loc[n + 1]) - r0, 0), p.T)
        else:
            r0, Tn = n * p.T, p.T
        rows = [r for r in range(r0, r0 + Tn) if 0 <= r < p.N]  # rows past x are never read
        Tn = len(rows)
        # where the committed state and conv window come from, and whether the request is live
        if p.slot_form:
            acc = 1 if p.num_accepted_tokens is None else int(p.num_accepted_tokens[n])
            live = 1 <= acc <= p.T
            read_slot = int(p.state_indices[n, acc - 1]) if live else -1
            conv_slot = int(p.state_indices[n, 0])
            offset = acc - 1
            live = live and _valid(read_slot, p.num_slots) and (not p.has_conv or _valid(conv_slot, p.num_slots))
        else:
            read_slot = conv_slot = int(p.state_indices[n])
            row = int(p.step_state_indices[n])
            offset = 0
            live = _valid(read_slot, p.num_slots) and _valid(row, p.num_rows)
        if not live:  # padding request: zero output, nothing written
            for r in rows:
                p.out[r].zero_()
            continue
        S0 = p.state[read_slot].to(f).clone()
        window0 = p.conv_state[conv_slot, :, offset:offset + W - 1].to(f).clone() if p.has_conv else None
        xs = [p.x[r].to(f) for r in rows]
        states, windows = [], []  # after each token: state (rounded as stored) and conv window (W-1, newest last)
        for t, r in enumerate(rows):
            parent = t - 1
            if p.has_parents and t > 0:
                cand = int(p.parent_indices[n, t])
                parent = cand if 0 <= cand < t else t - 1
            if p.has_conv:
                prior = window0 if parent < 0 else windows[parent]  # [C, W-1], newest last
                full = torch.cat([prior, xs[t][:, None]], dim=1)  # [C, W]
                y = (full * p.conv_weight.to(f)).sum(-1)
                if p.conv_bias is not None:
                    y = y + p.conv_bias.to(f)
                y = F.silu(y)
                windows.append(full[:, 1:])
            else:
                y = xs[t]
            if p.has_f_b:
                a = torch.einsum("r,hkr->hk", p.f_a[r].to(f), p.f_b_weight.to(f))
            else:
                a = p.a[r].to(f).view(H, K)
            S_prev = S0 if parent < 0 else states[parent]
            o, S = kda_step_math(y.view(3, H, K), a, p.b[r].to(f), A_log, dt_bias, S_prev,
                                 scale=p.scale, lower_bound=p.lower_bound)
            states.append(S.to(sdt).to(f))  # the precision a decode step leaves in the cache
            if p.has_norm:
                o = gated_rmsnorm(o, p.output_gate[r].to(f), p.norm_weight.to(f), p.norm_eps)
            p.out[r].copy_(o.to(p.out.dtype))
        # writes, after every read (the slot form may write the slot it read)
        for t in range(Tn):
            if p.slot_form:
                dst = int(p.state_indices[n, t])
                if _valid(dst, p.num_slots):
                    p.state[dst].copy_(states[t].to(sdt))
            else:
                p.step_state[row, t].copy_(states[t].to(sdt))
                if p.has_conv:
                    p.step_conv_state[row, t].copy_(windows[t].to(p.step_conv_state.dtype))
        if p.has_conv and p.slot_form:
            cs = p.conv_state[conv_slot]
            cs[:, :W - 2].copy_(window0[:, 1:].to(cs.dtype))
            for t in range(Tn):
                cs[:, W - 2 + t].copy_(xs[t].to(cs.dtype))
    return p.out
