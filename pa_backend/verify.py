"""``flydsl-backends verify`` for the paged-attention ops: every available implementation against the
reference math run in float64 on the same cache (stale table entries and NaN pages included)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import torch

from .cases import make_pa_case
from .reference import run_attention

__all__ = ["verify_grid", "run_verify", "OUT_TOL", "ACCURACY_TARGET", "tolerance"]

ACCURACY_TARGET = 3e-3  # relative error vs the reference on the dequantized cache, compiled kernels
OUT_TOL = 8e-3  # the CPU interpreter: bf16 stores truncate and dots take fp16 operands


def tolerance(device: torch.device) -> float:
    return ACCURACY_TARGET if torch.device(device).type == "cuda" else OUT_TOL


def verify_grid(small: bool) -> List[Dict[str, object]]:
    if small:
        return [
            dict(context_lengths=[5, 33], Hq=4, Hkv=1),
            dict(context_lengths=[20, 3], Hq=4, Hkv=4, v_layout="5d", scales="token"),
            dict(context_lengths=[9, 40], query_length=3, sliding_window=7, Hq=8, Hkv=2),
            dict(context_lengths=[18, 1], sinks=True, fp8_dtype=torch.float8_e4m3fnuz),
            dict(context_lengths=[18, 1], sinks=True, v_layout="5d", block_size=64),
            dict(context_lengths=[12, 30], query_lengths=[4, 1], scales="token"),
        ]
    grid = []
    for ctx, ql in (([1, 97, 1027], 1), ([54, 8192], 2), ([300, 4000, 17], 4)):
        for bs, v_layout, scales in ((16, "4d", "tensor"), (64, "5d", "token")):
            grid.append(dict(context_lengths=ctx, query_length=ql, Hq=16, Hkv=2, D=128, block_size=bs,
                             v_layout=v_layout, scales=scales))
    grid.append(dict(context_lengths=[200, 900], Hq=8, Hkv=1, D=256, sliding_window=128, sinks=True))
    grid.append(dict(context_lengths=[64, 700, 5], query_lengths=[64, 3, 5], Hq=8, Hkv=8, D=64, block_size=128))
    # the vendors' tilings differ here (triton.prefill_tiling / decode_tiling with amd=True): prefill at D 128,
    # GQA 4 (chunks on a prefix, one decode row among them) and the D 256 decode with 64-token 5-D pages
    grid.append(dict(context_lengths=[300, 2100, 40], query_lengths=[300, 700, 1], Hq=16, Hkv=4, D=128))
    grid.append(dict(context_lengths=[33, 1500], Hq=8, Hkv=1, D=256, block_size=64, v_layout="5d", scales="token"))
    return grid


def run_verify(impls: Sequence[str], device: torch.device, small: bool, progress=None) -> List[Dict[str, object]]:
    """Rows {impl, case, ok, out_err, ...} per implementation and grid point (``progress`` gets each row)."""
    rows = []
    for seed, params in enumerate(verify_grid(small)):
        case = make_pa_case(**params, device=device, seed=seed)
        from .contract import prepare_attention

        kw = dict(case.kwargs)
        kw.pop("out")
        ref_out = torch.empty(kw["query"].shape, dtype=torch.float64, device=device)
        p = prepare_attention(**kw, prefill=case.prefill)
        run_attention(dataclasses.replace(p, out=ref_out), compute_dtype=torch.float64)
        from .registry import registry_for

        reg = registry_for(p)
        for impl in impls:
            res: Dict[str, object] = {"impl": impl, "case": case.desc}
            if impl not in reg.names():
                ok, why = False, f"{reg.family} has no {impl} implementation"
            else:
                ok, why = reg.get(impl).can_serve(p)
            if not ok:  # outside this implementation's coverage: reported, not a failure
                res.update(ok=True, skipped=why)
                rows.append(res)
                if progress:
                    progress(res)
                continue
            try:
                out = case.call(impl, out=torch.full_like(kw["query"], float("nan")))
                finite = bool(torch.isfinite(out).all())
                err = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
                res.update(out_err=err, ok=finite and err <= tolerance(device))
                if not finite:
                    res["error"] = "non-finite output"
            except Exception as exc:
                res.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            rows.append(res)
            if progress:
                progress(res)
    return rows
