"""Compile the Triton KDA kernel ahead of time for an NVIDIA target and read ptxas's resource report.

No GPU is needed: Triton compiles for ``GPUTarget("cuda", 90, 32)`` on any machine and the
``ptxas`` it ships reports registers, spills and stack. The runtime's specialization is imitated
(16-byte divisible pointers and strides, unit strides folded to constants) so the numbers match
what the JIT builds on the device. Used by the CPU test that keeps shipped configurations free
of spills.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from typing import Dict

__all__ = ["ptxas_report", "SHIPPED_CONFIGS"]

# (state dtype, f_b, BV, warps): what launch_config picks for K = V = 128 on a 132-SM GPU.
SHIPPED_CONFIGS = [(dt, fb, bv, 4) for dt in ("fp32", "bf16") for fb, bvs in ((False, (16, 32, 64, 128)), (True, (128,)))
                   for bv in bvs]

UNIT_STRIDES = ("stride_cs_c", "stride_cw_w", "stride_b_h", "stride_idx")


def ptxas_report(state_dtype: str = "fp32", with_f_b: bool = False, BV: int = 128, num_warps: int = 4,
                 K: int = 128, H: int = 12, W: int = 4, capability: int = 90) -> Dict[str, int]:
    """{'registers', 'spill_stores', 'spill_loads', 'stack'} of one specialization (conv + norm on)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .kda_decode import kda_decode_kernel

    names = list(inspect.signature(kda_decode_kernel.fn).parameters)
    fp32_ptrs = {"p_cw", "p_cb", "p_A_log", "p_dt_bias", "p_ows"}
    signature, attrs = {}, {}
    for i, n in enumerate(names):
        if n in UNIT_STRIDES or not (n.startswith("p_") or n.startswith("stride_") or n in
                                     ("num_slots", "scale", "lower_bound", "norm_eps")):
            signature[n] = "constexpr"
            continue
        if n == "p_state":
            signature[n] = "*fp32" if state_dtype == "fp32" else "*bf16"
        elif n in ("p_idx", "p_cnt"):
            signature[n] = "*i32"
        elif n.startswith("p_"):
            signature[n] = "*fp32" if n in fp32_ptrs else "*bf16"
        elif n in ("scale", "lower_bound", "norm_eps"):
            signature[n] = "fp32"
        else:
            signature[n] = "i32"
        if n.startswith("p_") or n.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = dict(H=H, K=K, V=K, BV=BV, W=W, R=K, BR=K, RC=32, HAS_CONV=True, HAS_BIAS=False, HAS_FB=with_f_b,
                      HAS_NORM=True, USE_LOWER_BOUND=with_f_b, **{n: 1 for n in UNIT_STRIDES})
    src = ASTSource(fn=kda_decode_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        arch = f"sm_{capability}a" if capability == 90 else f"sm_{capability}"
        out = subprocess.run([ptxas, "-v", "--gpu-name", arch, f.name, "-o", os.devnull], capture_output=True,
                             text=True, timeout=300)
    finally:
        os.unlink(f.name)
    text = out.stderr + out.stdout
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed: {text[-2000:]}")

    def grab(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame")}
