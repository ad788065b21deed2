"""Compile-only support for FlyDSL kernels: toolchain checks, resource numbers, occupancy.

Used by the ops' ``compile_spec`` functions and the CPU compile gate. Nothing here imports
flydsl (or any op package) at module import time, so it is safe to import on any machine.

Facts this relies on (flydsl 0.4.2, checked on a CPU-only machine):

* ``COMPILE_ONLY=1`` makes a ``@flyc.jit`` call trace, lower and link a HSACO and return ``None``.
  Both ``ARCH`` (codegen) and ``FLYDSL_GPU_ARCH`` (what ``get_rocm_arch()`` reports to kernels)
  must name the same target; one process per arch (the target is frozen at first use).
* FlyDSL links with ``$ROCM_PATH/llvm/bin/ld.lld`` and needs ``$ROCM_PATH/amdgcn/bitcode/
  {ockl,ocml}.bc`` for some math; the wheel brings neither.
* The compiled module's IR text carries ``#gpu.kernel_metadata<"name", ..., metadata = {...}>``
  next to the binary. It is reached through private attributes of 0.4.2 (``_last_compiled`` on
  the jit function, ``_keepalive`` on a ``flyc.compile`` result); ``_artifact_ir_text`` is the
  only place that touches them.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Dict, List, Optional

from .names import FLYDSL_ARCHES

__all__ = [
    "ARCHES",
    "LDS_BYTES",
    "compile_env",
    "toolchain_problems",
    "resources_of",
    "waves_per_simd",
]

ARCHES = FLYDSL_ARCHES
LDS_BYTES = {"gfx942": 65536, "gfx950": 163840}  # LDS per CU

# CDNA3 / CDNA4, wave64
_VGPR_PER_SIMD_LANE = 512  # unified VGPR + AGPR file per lane per SIMD
_VGPR_GRANULE = 8
_MAX_WAVES_PER_SIMD = 8
_SIMDS_PER_CU = 4
_WAVE = 64


def compile_env(arch: str, rocm_path: Optional[str] = None) -> Dict[str, str]:
    """Environment variables for a compile-only subprocess targeting ``arch``."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    env = {
        "COMPILE_ONLY": "1",
        "ARCH": arch,
        "FLYDSL_GPU_ARCH": arch,
        "FLYDSL_RUNTIME_ENABLE_CACHE": "0",
    }
    if rocm_path is not None:
        env["ROCM_PATH"] = rocm_path
    return env


def toolchain_problems() -> List[str]:
    """What is missing for a compile-only FlyDSL build in this process (empty list: ready)."""
    problems: List[str] = []
    if importlib.util.find_spec("flydsl") is None:
        problems.append("flydsl is not installed (pip install 'flydsl-backends[flydsl]')")
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    lld = os.path.join(rocm, "llvm", "bin", "ld.lld")
    if not (os.path.isfile(lld) and os.access(lld, os.X_OK)):
        problems.append(f"linker {lld} is missing or not executable (set ROCM_PATH; python -m "
                        "flydsl_backends.compile_gate builds a compile-only one)")
    for bc in ("ockl.bc", "ocml.bc"):
        path = os.path.join(rocm, "amdgcn", "bitcode", bc)
        if not os.path.isfile(path):
            problems.append(f"device bitcode {path} is missing")
    if os.environ.get("COMPILE_ONLY", "").strip() not in ("1", "true", "True", "yes"):
        problems.append("COMPILE_ONLY is not set to 1 (without it a CPU-tensor launch aborts the process)")
    arch = os.environ.get("ARCH")
    gpu_arch = os.environ.get("FLYDSL_GPU_ARCH")
    if not arch or not gpu_arch:
        problems.append(f"ARCH={arch!r} and FLYDSL_GPU_ARCH={gpu_arch!r}: both must be set (unset means gfx942)")
    elif arch != gpu_arch:
        problems.append(f"ARCH={arch!r} != FLYDSL_GPU_ARCH={gpu_arch!r} (codegen and kernel arch choices would differ)")
    elif arch not in ARCHES:
        problems.append(f"ARCH={arch!r} is not one of {ARCHES}")
    return problems


def _artifact_ir_text(compiled) -> str:
    """The compiled module's IR text. The ONLY access to flydsl 0.4.2's private attributes.

    ``compiled`` is a ``@flyc.jit`` function after a call (its ``_last_compiled`` is
    ``(cache_key, CompiledArtifact)``), a ``flyc.compile`` result (``_keepalive`` is the
    ``CompiledArtifact``), a ``CompiledArtifact`` itself, or the IR text.
    """
    if isinstance(compiled, str):
        return compiled
    obj = compiled
    last = getattr(obj, "_last_compiled", None)
    if last is not None:
        obj = last[1]
    else:
        keep = getattr(obj, "_keepalive", None)
        if keep is not None and hasattr(keep, "_ir_text"):
            obj = keep
    text = getattr(obj, "_ir_text", None)
    if not isinstance(text, str):
        raise ValueError(
            f"resources_of: no compiled IR found on {type(compiled).__name__} (compile it first; flydsl 0.4.2 "
            "keeps it in _last_compiled / _keepalive)"
        )
    return text


_META_RE = re.compile(r'#gpu\.kernel_metadata<"([^"]+)"(.*?)metadata\s*=\s*\{([^}]*)\}', re.S)
_KV_RE = re.compile(r"(\w+)\s*=\s*(-?\d+)\s*:\s*i\d+")
_CHIP_RE = re.compile(r'chip\s*=\s*"(gfx[0-9a-z]+)"')


def resources_of(compiled) -> dict:
    """Resource numbers of the (first) kernel in a compiled FlyDSL function.

    Keys: kernel, arch, vgpr, agpr, sgpr, lds (bytes, static group segment), scratch (private
    segment bytes per lane), vgpr_spill, sgpr_spill.
    """
    text = _artifact_ir_text(compiled)
    m = _META_RE.search(text)
    if m is None:
        raise ValueError("resources_of: no #gpu.kernel_metadata in the compiled IR")
    kv = {k: int(v) for k, v in _KV_RE.findall(m.group(3))}
    chip = _CHIP_RE.search(text)
    arch = chip.group(1) if chip else os.environ.get("ARCH")
    return {
        "kernel": m.group(1),
        "arch": arch,
        "vgpr": kv.get("vgpr_count"),
        "agpr": kv.get("agpr_count", 0),
        "sgpr": kv.get("sgpr_count"),
        "lds": kv.get("group_segment_fixed_size", 0),
        "scratch": kv.get("private_segment_fixed_size", 0),
        "vgpr_spill": kv.get("vgpr_spill_count", 0),
        "sgpr_spill": kv.get("sgpr_spill_count", 0),
    }


def _round_up(x: int, g: int) -> int:
    return (x + g - 1) // g * g


def waves_per_simd(vgpr: int, agpr: int, lds: int, arch: str, threads_per_block: int) -> int:
    """Resident waves per SIMD (CDNA3/4 wave64 estimate: registers, LDS, 8-wave cap).

    Registers: VGPRs and AGPRs of one wave are allocated together (VGPRs rounded up to 4 before
    the AGPRs on gfx90a+; the total in granules of 8) from 512 per lane per SIMD. LDS: whole
    blocks per CU from ``LDS_BYTES[arch]``, blocks spread over the CU's 4 SIMDs.
    """
    if arch not in LDS_BYTES:
        raise ValueError(f"arch: expected one of {tuple(LDS_BYTES)}, got {arch!r}")
    if threads_per_block < 1:
        raise ValueError(f"threads_per_block: expected >= 1, got {threads_per_block}")
    regs = _round_up(_round_up(max(int(vgpr), 1), 4) + int(agpr or 0), _VGPR_GRANULE)
    by_regs = min(_MAX_WAVES_PER_SIMD, _VGPR_PER_SIMD_LANE // regs)  # waves per SIMD
    waves_per_block = (threads_per_block + _WAVE - 1) // _WAVE
    blocks = (by_regs * _SIMDS_PER_CU) // waves_per_block  # whole blocks per CU by registers
    if lds and int(lds) > 0:
        blocks = min(blocks, LDS_BYTES[arch] // int(lds))
    return min(by_regs, (blocks * waves_per_block) // _SIMDS_PER_CU)


def vgpr_budget(kernel: str, budgets: dict) -> Optional[int]:
    """VGPR budget of ``kernel`` in a ``{name, prefix or '*': int}`` table: the exact name, else the
    longest key that is a prefix of the name, else ``'*'`` (None when nothing matches)."""
    if kernel in budgets:
        return int(budgets[kernel])
    prefixes = [k for k in budgets if k != "*" and kernel.startswith(k)]
    if prefixes:
        return int(budgets[max(prefixes, key=len)])
    return int(budgets["*"]) if "*" in budgets else None
