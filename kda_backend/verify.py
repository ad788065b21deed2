"""``flydsl-backends verify`` for the KDA ops: every available implementation against the
reference over a shape grid with padding rows, both conv layouts, both state dtypes, the f_b
variant, the safe gate, page-strided caches and heads-outer ``out`` rows (decode); both destination
forms, ragged T, accepted offsets, chains and trees (verify)."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .cases import clone_caches, clone_verify, compare_runs, compare_verify, make_case, make_verify_case
from .reference import run_reference, run_verify_reference

__all__ = ["verify_grid", "verify_op_grid", "run_verify", "tolerances"]


def tolerances(state_dtype: torch.dtype) -> Dict[str, float]:
    """Relative-error bounds against the FP32 reference.

    out is bf16: one rounding is <= 2**-8 relative per element (the Triton interpreter truncates
    instead of rounding, which can double it), so 1e-2 in norm. FP32 state differs only by the
    summation order of two K-length dot products (~1e-6); BF16 state carries one rounding (<= 2**-8).
    """
    return {"out_tol": 1e-2, "state_tol": 1e-4 if state_dtype == torch.float32 else 1e-2}


def verify_grid(small: bool) -> List[Dict[str, object]]:
    """The shapes: ``small`` for the CPU interpreter (seconds), otherwise real decode shapes."""
    if small:
        H, K = 2, 32
        base = [
            dict(B=3, H=H, K=K, W=4, conv_layout="width", padding=[1]),
            dict(B=3, H=H, K=K, W=4, conv_layout="channel", out_of_range=[2]),
            dict(B=2, H=H, K=K, W=3, state_dtype=torch.bfloat16, with_f_b=True, R=24, lower_bound=-5.0),
            dict(B=2, H=1, K=64, W=2, norm=False, conv_bias=True, page_pad=5, out_layout="heads", padding=[0]),
            dict(B=3, H=3, K=K, conv=False, norm=False, padding=[2]),
        ]
    else:
        base = []
        for B, H in ((1, 12), (8, 3), (33, 12), (64, 6)):
            for state_dtype in (torch.float32, torch.bfloat16):
                for with_f_b, layout in ((False, "width"), (True, "channel")):
                    base.append(dict(B=B, H=H, K=128, W=4, state_dtype=state_dtype, with_f_b=with_f_b,
                                     conv_layout=layout, padding=[0] if B > 1 else [],
                                     out_of_range=[B - 1] if B > 2 else [],
                                     lower_bound=-5.0 if with_f_b else None, page_pad=64 if B == 33 else 0,
                                     out_layout="heads" if B == 8 else "batch"))
        base.append(dict(B=16, H=12, K=128, conv=False, norm=False, padding=[3]))
        base.append(dict(B=5, H=32, K=64, W=3, conv_bias=True))
    return base


def verify_op_grid(small: bool) -> List[Dict[str, object]]:
    """The ``kda_verify`` shapes: ``small`` for the CPU interpreter, otherwise K3-like serving shapes."""
    if small:
        return [
            dict(B=3, H=2, K=32, T=4, accepted=[1, 4, 2], padding=[1]),
            dict(B=3, H=2, K=32, T=3, lengths=[3, 0, 2], extra_rows=1, conv_layout="channel",
                 state_dtype=torch.bfloat16, with_f_b=True, R=24, lower_bound=-5.0),
            dict(B=3, H=2, K=32, T=4, form="buffer", tree=True, padding=[2]),
            dict(B=2, H=1, K=64, T=2, W=3, form="buffer", conv=False, norm=False),
        ]
    grid = []
    for B, H, T in ((1, 12, 4), (8, 12, 8), (32, 12, 4), (4, 96, 3)):
        for state_dtype in (torch.float32, torch.bfloat16):
            grid.append(dict(B=B, H=H, K=128, T=T, state_dtype=state_dtype, with_f_b=True, lower_bound=-5.0,
                             accepted=[1 + n % T for n in range(B)], padding=[B - 1] if B > 2 else []))
            grid.append(dict(B=B, H=H, K=128, T=T, state_dtype=state_dtype, form="buffer", tree=B > 1,
                             lengths=[T - n % 2 for n in range(B)], padding=[0] if B > 2 else []))
    return grid


def _verify_op_rows(impls, device, small: bool, progress) -> List[Dict[str, object]]:
    from .registry import VERIFY_REGISTRY

    rows = []
    for seed, params in enumerate(verify_op_grid(small)):
        case = make_verify_case(**params, device=device, seed=1000 + seed)
        ref = clone_verify(case)
        run_verify_reference(ref.problem(), compute_dtype=torch.float64)
        tol = tolerances(params.get("state_dtype", torch.float32))
        for impl in impls:
            desc = "verify " + case.desc
            if impl not in VERIFY_REGISTRY.names():
                res = {"ok": True, "skipped": f"kda_verify has no {impl} implementation", "impl": impl, "case": desc}
            else:
                run = clone_verify(case)
                ok, why = VERIFY_REGISTRY.get(impl).can_serve(run.problem())
                if not ok:
                    res = {"ok": True, "skipped": why}
                else:
                    try:
                        run.call(impl)
                        res = compare_verify(run, ref, case, **tol)
                        if "step_state_err" in res:  # the CLI's table shows one state column
                            res["state_err"] = max(res["state_err"], res["step_state_err"])
                    except Exception as exc:  # a crash is a failure row, not an abort of the whole table
                        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                res.update(impl=impl, case=desc)
            rows.append(res)
            if progress:
                progress(res)
    return rows


def run_verify(impls: Sequence[str], device: torch.device, small: bool, progress=None) -> List[Dict[str, object]]:
    """Rows {impl, case, ok, out_err, state_err, ...} for each implementation and grid point.

    The yardstick is the reference math run in float64 on the same inputs, so the ``torch`` row
    checks the FP32 reference too.
    """
    rows = []
    for seed, params in enumerate(verify_grid(small)):
        case = make_case(**params, device=device, seed=seed)
        ref = clone_caches(case)
        run_reference(ref.problem(), compute_dtype=torch.float64)  # the same math in float64
        tol = tolerances(params.get("state_dtype", torch.float32))
        from .api import REGISTRY

        for impl in impls:
            run = clone_caches(case)
            ok, why = REGISTRY.get(impl).can_serve(run.problem())
            if not ok:  # outside this implementation's coverage: reported, not a failure
                res = {"ok": True, "skipped": why, "impl": impl, "case": case.desc}
                rows.append(res)
                if progress:
                    progress(res)
                continue
            try:
                run.call(impl)
                res = compare_runs(run, ref, case, **tol)
            except Exception as exc:  # a crash is a failure row, not an abort of the whole table
                res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            res.update(impl=impl, case=case.desc)
            rows.append(res)
            if progress:
                progress(res)
    return rows + _verify_op_rows(impls, device, small, progress)
