"""``flydsl-backends accuracy`` for the KDA decode op: long-horizon drift of the recurrent state.

One KDA layer decodes ``steps`` tokens for B sequences (fresh random inputs each step, the adapters'
layouts: width-major conv windows, page-strided state, a padding row), with the implementation under test
updating its caches in place, and a float64 twin of the same recurrence run on the same inputs. A kernel
whose per-step error is rounding noise stays within a bound that does not grow with the steps; a bias (a
wrong rounding mode, a dropped term, a state read from the wrong slot) grows until it fails.

Bound (the reasoning ``tests/test_long_horizon.py`` used first): each step the state carries its storage
rounding u (2**-24 FP32, 2**-9 BF16 round-to-nearest) and an FP32 summation-order error; the recurrence
forgets at rate rho = exp(mean gate) per step, so independent errors sum to about u / sqrt(1 - rho**2).
The check allows 4x that (plus 1e-6); the output adds its bf16 rounding (1e-2). Triton's CPU interpreter
truncates FP32 -> BF16 (a bias of up to 2**-8 per step), so there the BF16 bound is the geometric sum
2**-8 / (1 - rho). The gates are set to forget slowly (A_log = log 0.05), the hardest case.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Sequence

import torch

from .cases import make_case, rel_err
from .reference import kda_gate, run_reference

__all__ = ["drift", "drift_case", "accuracy_grid", "run_accuracy"]

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -9}


def drift_case(B: int, H: int, K: int, state_dtype: torch.dtype, device, seed: int = 0, with_f_b: bool = False,
               padding: Sequence[int] = ()):
    """The layer ``drift`` runs: width-major conv windows, state pages strided past the slot (as vLLM's)."""
    return make_case(B, H, K, 4, slots=B + 1, state_dtype=state_dtype, device=torch.device(device), seed=seed,
                     with_f_b=with_f_b, state_scale=0.1, include_slot0=True, padding=padding, page_pad=32)


def drift(steps: int, B: int, H: int, K: int, state_dtype: torch.dtype, device, impl: str, seed: int = 0,
          with_f_b: bool = False, padding: Sequence[int] = (), progress=None) -> Dict[str, object]:
    """Run ``steps`` decode steps of one layer on ``impl`` and on a float64 twin; returns the largest output
    error over the steps, the final state error, the decay rate rho, the bounds, and whether the conv
    windows stayed bit-identical. ``progress(step)`` is called every 10% of the steps."""
    device = torch.device(device)
    case = drift_case(B, H, K, state_dtype, device, seed=seed, with_f_b=with_f_b, padding=padding)
    kw = case.kwargs
    kw["A_log"].fill_(math.log(0.05))  # slow forgetting: the hardest case for accumulated rounding
    twin_conv = kw["conv_state"].clone()
    state64 = kw["state"].double()
    out64 = torch.empty(kw["out"].shape, dtype=torch.float64, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    live = case.live_rows
    max_out_err, log_decay = 0.0, []
    for step in range(steps):
        for name in ("x", "a", "f_a", "b", "output_gate"):
            if kw.get(name) is not None:
                kw[name].copy_(torch.randn(kw[name].shape, generator=g).to(kw[name].dtype))
        a = kw.get("a")
        if a is None:  # the f_b form: a = f_a @ f_b_weight[h]^T
            a = torch.einsum("nr,hkr->nhk", kw["f_a"].double(), kw["f_b_weight"].double())
        log_decay.append(kda_gate(a.double().view(B, H, K), kw["A_log"].double(), kw["dt_bias"].double().view(H, K),
                                  None).mean().item())
        p64 = dataclasses.replace(case.problem(), state=state64, out=out64, conv_state=twin_conv)
        run_reference(p64, compute_dtype=torch.float64)
        case.call(impl)
        max_out_err = max(max_out_err, rel_err(kw["out"][live], out64[live]))
        if progress and steps >= 10 and (step + 1) % (steps // 10) == 0:
            progress(step + 1)
    state_err = rel_err(kw["state"][case.live_slots], state64[case.live_slots])
    rho = math.exp(sum(log_decay) / len(log_decay)) if log_decay else 0.999
    from backend_core import platform

    truncating = impl == "triton" and platform.triton_interpreter_enabled() and state_dtype == torch.bfloat16
    if truncating:
        state_tol = 2.0 ** -8 / (1 - rho) + 1e-6
    else:
        state_tol = 4 * U[state_dtype] / math.sqrt(1 - rho ** 2) + 1e-6
    padding_zero = all(bool((kw["out"][n] == 0).all()) for n in range(B) if n not in live)
    return dict(max_out_err=max_out_err, state_err=state_err, rho=rho, state_tol=state_tol, out_tol=1e-2 + state_tol,
                conv_equal=bool(torch.equal(twin_conv, kw["conv_state"])), padding_zero=padding_zero)


def accuracy_grid(small: bool) -> List[Dict[str, object]]:
    """The layers: ``small`` for the CPU interpreter, otherwise the Kimi-K3 TP8 layer (H 12, K 128)."""
    if small:
        base = dict(B=3, H=1, K=32, padding=(1,))
    else:
        base = dict(B=8, H=12, K=128, padding=(5,))
    return [dict(base, state_dtype=torch.float32), dict(base, state_dtype=torch.bfloat16),
            dict(base, state_dtype=torch.float32, with_f_b=True)]


def run_accuracy(impls: Sequence[str], device: torch.device, steps: int, small: bool, progress=None,
                 step_progress=None) -> List[Dict[str, object]]:
    """Rows {impl, case, ok, out_err, state_err, bound, ...}: one per implementation and layer of the grid.
    ``progress(row)`` gets each row, ``step_progress(text)`` a line every 10% of a long run."""
    from backend_core.ops import accuracy_rows

    from .api import REGISTRY

    def run_one(impl, params, tick):
        ok, why = REGISTRY.get(impl).can_serve(drift_case(device=device, **params).problem())
        if not ok:  # outside this implementation's coverage: reported, not a failure
            return dict(ok=True, skipped=why)
        d = drift(steps, device=device, impl=impl, progress=tick, **params)
        res = dict(out_err=d["max_out_err"], state_err=d["state_err"], bound=d["state_tol"], rho=d["rho"],
                   ok=(d["max_out_err"] <= d["out_tol"] and d["state_err"] <= d["state_tol"] and d["conv_equal"]
                       and d["padding_zero"]))
        if not d["conv_equal"]:
            res["error"] = "conv windows differ from the float64 twin's"
        elif not d["padding_zero"]:
            res["error"] = "a padding row's output is not zero"
        return res

    cases = [(f"{steps} steps B={p['B']} H={p['H']} K={p['K']} state={str(p['state_dtype']).replace('torch.', '')}"
              f"{' f_b' if p.get('with_f_b') else ''}", p) for p in accuracy_grid(small)]
    return accuracy_rows(impls, cases, run_one, steps, progress, step_progress)
