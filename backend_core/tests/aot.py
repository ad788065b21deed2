"""Ahead-of-time compilation of a Triton kernel for an NVIDIA or AMD target, without a GPU: the
resource report of the ptxas that the Triton wheel ships (registers, spills, stack), and for AMD
(gfx942, gfx950) the register and scratch counts the AMDGPU backend writes into the assembly.

Used by CPU tests that keep shipped kernel configurations compiling and spill-free. The caller
describes the specialization the runtime would build: argument types, constexprs, and which
pointers/integers are 16-divisible (the JIT marks those itself at run time).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from typing import Dict, Iterable, Mapping, Optional

__all__ = ["ptxas_report", "amdgcn_report", "run_report_script"]


def _source(kernel, types: Mapping[str, str], constexprs: Mapping[str, object], divisible: Iterable[str]):
    from triton.compiler import ASTSource

    if getattr(kernel, "is_gluon", lambda: False)():  # a gluon.jit kernel (its own front end)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    names = list(inspect.signature(kernel.fn).parameters)
    divisible = set(divisible)
    signature, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            signature[n] = "constexpr"
        elif n in types:
            signature[n] = types[n]
            if n in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise ValueError(f"aot: no type or constexpr value for argument {n!r}")
    return ASTSource(fn=kernel, signature=signature, constexprs=dict(constexprs), attrs=attrs)


def amdgcn_report(kernel, types: Mapping[str, str], constexprs: Mapping[str, object], divisible: Iterable[str] = (),
                  num_warps: int = 4, arch: str = "gfx942", num_stages: int = 2) -> Dict[str, int]:
    """Compile ``kernel`` for AMD ``arch`` (wavefronts of 64) and return what the AMDGPU backend reports
    in the assembly: VGPRs, AGPRs, scratch bytes per lane (> 0: spills or a stack), VGPRs spilled, LDS
    bytes, and the waves per SIMD the register use allows (``occupancy``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(_source(kernel, types, constexprs, divisible), target=GPUTarget("hip", arch, 64),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    asm = compiled.asm["amdgcn"]

    def grab(pattern: str) -> int:
        m = re.search(pattern, asm)
        return int(m.group(1)) if m else -1

    return {"vgprs": grab(r";\s*NumVgprs:\s*(\d+)"), "agprs": grab(r";\s*NumAgprs:\s*(\d+)"),
            "scratch": grab(r";\s*ScratchSize:\s*(\d+)"), "vgpr_spills": grab(r"\.vgpr_spill_count:\s*(\d+)"),
            "occupancy": grab(r";\s*Occupancy:\s*(\d+)"), "lds": int(getattr(compiled.metadata, "shared", 0) or 0),
            "hsaco_bytes": len(compiled.asm.get("hsaco", b""))}


def ptxas_report(kernel, types: Mapping[str, str], constexprs: Mapping[str, object],
                 divisible: Iterable[str] = (), num_warps: int = 4, capability: int = 90,
                 num_stages: int = 3, maxnreg: Optional[int] = None) -> Dict[str, int]:
    """Compile ``kernel`` (a ``triton.jit`` or ``gluon.jit`` function) and return its ptxas resource numbers.

    ``types``: Triton type strings ("*fp32", "i32", ...) of the runtime arguments; every other
    parameter must be in ``constexprs``. ``divisible``: arguments to mark 16-divisible.
    ``maxnreg``: the register cap the launch passes (None: ptxas chooses).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    src = _source(kernel, types, constexprs, divisible)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
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
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame"),
            "shared": int(getattr(compiled.metadata, "shared", 0) or 0),
            "hot_spills": hot_spill_count(compiled.asm.get("cubin")),
            # ptxas C7512: "wgmma.mma_async instructions are serialized due to insufficient register resources"
            # (it then waits after every wgmma: results stay right, the overlap the code asks for is gone)
            "wgmma_serialized": int("C7512" in text or "wgmma.mma_async instructions are serialized" in text)}


def hot_spill_count(cubin: Optional[bytes]) -> int:
    """Spill instructions (local-memory STL / LDL) inside the kernel's hottest loops: the deepest loop nest
    that issues global loads, found in the SASS (``cuobjdump``; a loop is a backward branch). A spill there
    costs every tile; one before or between those loops costs once per program or task. -1 when the
    SASS cannot be read."""
    import triton

    if not cubin:
        return -1
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        return -1
    code = [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in out.stdout.splitlines()) if m]
    loops = []
    for addr, ins in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))

    def depth(addr: int) -> int:
        return sum(lo <= addr <= hi for lo, hi in loops)

    loads = [depth(a) for a, ins in code if re.search(r"\b(LDG|LDGSTS|UTMALDG|UBLKCP)\b", ins)]
    hot = max(loads, default=0)
    return sum(1 for a, ins in code if re.search(r"\b(STL|LDL)\b", ins) and depth(a) >= hot)


def run_report_script(script: str, root: str, timeout: float = 900, args=()):
    """Run ``script`` (Python that prints one JSON line last; ``args`` in its ``sys.argv[1:]``) in a fresh
    interpreter at ``root`` with Triton's interpreter mode off (a test session may have it on, and compiling
    for a GPU target needs it off); returns (the completed process, the parsed last line or None when it
    failed)."""
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        return proc, None
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])
