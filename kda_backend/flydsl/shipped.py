"""The project's own FlyDSL KDA kernel as the compile gate sees it (``backend_core.ops``): the
specializations shipped, their VGPR budgets and how to compile one.

``SHIPPED_SPECS``: H in SUPPORTED_H x state {fp32, bf16} x
  * fully fused (conv W=4, no conv bias, gated norm with BF16 norm_weight, int32 indices): gate
    from ``a`` or from f_b (R=128), safe gate (lower_bound) on and off -> 4 specs;
  * the post-conv packed form (no conv, no norm; SGLang's packed decode), plain and safe gate -> 2.
60 specs, each built for gfx950 and gfx942 by the gate (~45-55 s per arch on 2 CPU cores). Other
combinations (conv bias, FP32 norm_weight, int64 indices, other R, the packed form with f_b / norm)
are supported and compile on first use.

``budgets.json`` (beside this file): the compile gate uses the entry whose key equals a kernel's name,
else the longest key that is a prefix of it, else ``"*"``.
"""

from __future__ import annotations

import os
from typing import List

from .kernel import SUPPORTED_H, Spec, compile_spec, fb_chunk_for, kernel_name, threads_of

__all__ = ["SHIPPED_SPECS", "BUDGETS_PATH", "kernel_name", "threads_of", "compile_spec"]

BUDGETS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "budgets.json")


def _shipped() -> List[Spec]:
    out: List[Spec] = []
    for H in SUPPORTED_H:
        for state in ("fp32", "bf16"):
            for has_f_b in (False, True):
                for safe in (False, True):
                    out.append(Spec(H=H, state=state, has_f_b=has_f_b, R=128 if has_f_b else 0, safe_gate=safe,
                                    fb_chunk=fb_chunk_for(state, has_f_b, 128)))
            for safe in (False, True):  # SGLang's packed decode (Kimi-Linear; Kimi-K3 with the safe gate)
                out.append(Spec(H=H, state=state, W=0, has_conv=False, has_norm=False, safe_gate=safe))
    return out


SHIPPED_SPECS: List[Spec] = _shipped()
