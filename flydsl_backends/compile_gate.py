"""CPU compile gate of the project's FlyDSL kernels: build every shipped specialization of every op
family that has its own FlyDSL kernels (``flydsl_backends.ops.OPS``, ``flydsl_kernels``) for gfx950 and
gfx942 without an AMD GPU and fail on anything a GPU would suffer from.

    python -m flydsl_backends.compile_gate [--arch gfx950,gfx942] [--vgpr-budget N] [--json FILE]
    flydsl-backends info --resources          (the same table)

Toolchain: FlyDSL 0.4.2 links with ``$ROCM_PATH/llvm/bin/ld.lld`` and links ``ockl``/``ocml`` bitcode
from ``$ROCM_PATH/amdgcn/bitcode``; neither is in the flydsl wheel. When ``ROCM_PATH`` has no lld,
``ensure_toolchain`` builds a compile-only ROCM_PATH from PyPI packages (the ``[flydsl-compile]``
extra): an ld.lld wrapper around the LLD in the ``ziglang`` wheel, and the two bitcode files of the
installed ``triton`` wheel.

One worker process per arch (FlyDSL freezes its target at first use), with ``COMPILE_ONLY=1``,
``ARCH`` and ``FLYDSL_GPU_ARCH`` both set and the on-disk cache off; the two run side by side. A
specialization fails the gate on: a compile error, any VGPR/SGPR spill, any scratch, LDS over the
arch's budget, or VGPRs over the per-kernel budget in the op family's ``budgets.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from backend_core.names import FLYDSL_ARCHES

ARCHES = FLYDSL_ARCHES
COLUMNS = ("kernel", "arch", "vgpr", "agpr", "sgpr", "lds", "scratch", "waves", "compile_s", "verdict")


# --- toolchain -------------------------------------------------------------------------------------
def _has_lld(root: str) -> bool:
    return os.access(os.path.join(root, "llvm", "bin", "ld.lld"), os.X_OK)


def ensure_toolchain(root: Optional[str] = None) -> str:
    """A ROCM_PATH that FlyDSL can link with: ``$ROCM_PATH`` (or /opt/rocm) when it has ld.lld, else
    a compile-only one built under ``root`` (default: a folder in the temp dir). Raises RuntimeError
    naming the missing package."""
    for cand in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if cand and _has_lld(cand) and os.path.isdir(os.path.join(cand, "amdgcn", "bitcode")):
            return cand
    import importlib.util

    missing = [m for m in ("flydsl", "ziglang", "triton") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"compile-only FlyDSL toolchain: {', '.join(missing)} not installed "
                           "(pip install 'flydsl-backends[flydsl-compile]')")
    import triton

    root = root or os.path.join(tempfile.gettempdir(), "flydsl-backends-rocm")
    os.makedirs(os.path.join(root, "llvm", "bin"), exist_ok=True)
    os.makedirs(os.path.join(root, "amdgcn", "bitcode"), exist_ok=True)
    lld = os.path.join(root, "llvm", "bin", "ld.lld")
    with open(lld + ".tmp", "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n')
    os.chmod(lld + ".tmp", 0o755)
    os.replace(lld + ".tmp", lld)
    lib = os.path.join(os.path.dirname(triton.__file__), "backends", "amd", "lib")
    for name in ("ockl.bc", "ocml.bc"):
        src = os.path.join(lib, name)
        if not os.path.isfile(src):
            raise RuntimeError(f"compile-only FlyDSL toolchain: {src} not found in the triton wheel")
        shutil.copyfile(src, os.path.join(root, "amdgcn", "bitcode", name))
    out = subprocess.run([lld, "--version"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"compile-only FlyDSL toolchain: {lld} does not run: {out.stderr[-500:]}")
    return root


# --- budgets ---------------------------------------------------------------------------------------
def kernel_modules():
    """(op name, compile-gate module) of every op family with its own FlyDSL kernels."""
    from .ops import OPS

    return [(op.name, op.kernels()) for op in OPS if op.flydsl_kernels]


def load_budgets(path: Optional[str] = None) -> Dict[str, int]:
    """The VGPR budgets of every family's ``budgets.json`` (or of ``path``), merged."""
    merged: Dict[str, int] = {}
    for p in [path] if path else [mod.BUDGETS_PATH for _, mod in kernel_modules()]:
        with open(p) as f:
            data = json.load(f)
        budgets = data.get("vgpr", data)
        if not isinstance(budgets, dict) or not all(isinstance(v, int) for v in budgets.values()):
            raise ValueError(f"{p}: expected {{'vgpr': {{kernel name, prefix or '*': int}}}}")
        merged.update(budgets)
    return merged


def verdict(row: dict, budgets: Dict[str, int], lds_limit: int) -> List[str]:
    """Why ``row`` (one compiled specialization) fails the gate; empty when it passes."""
    if row.get("error"):
        return [f"compile error: {row['error']}"]
    why = []
    if row.get("vgpr_spill", 0) or row.get("sgpr_spill", 0):
        why.append(f"spills (vgpr {row.get('vgpr_spill', 0)}, sgpr {row.get('sgpr_spill', 0)})")
    if row.get("scratch", 0):
        why.append(f"scratch {row['scratch']} B")
    if row.get("lds", 0) > lds_limit:
        why.append(f"LDS {row['lds']} B > {lds_limit} B")
    from backend_core.flydsl_compile import vgpr_budget

    budget = vgpr_budget(row["kernel"], budgets)
    if budget is None:
        why.append("no VGPR budget for this kernel in budgets.json")
    elif row.get("vgpr", 0) > budget:
        why.append(f"VGPR {row['vgpr']} > budget {budget}")
    return why


# --- workers ---------------------------------------------------------------------------------------
def _worker(arch: str, only: Optional[str]) -> int:
    """Compile every shipped specialization for ``arch`` in this process; JSON rows on stdout."""
    from backend_core import flydsl_compile

    problems = flydsl_compile.toolchain_problems()
    if problems:
        print(json.dumps({"fatal": "; ".join(problems)}))
        return 2
    specs = [(mod, s) for _, mod in kernel_modules() for s in mod.SHIPPED_SPECS
             if not only or only in mod.kernel_name(s)]
    for i, (mod, spec) in enumerate(specs):
        name = mod.kernel_name(spec)
        t0 = time.perf_counter()
        try:
            row = dict(mod.compile_spec(spec))
            row.setdefault("kernel", name)
        except Exception as exc:  # the gate reports it and fails, the other specs still build
            row = {"kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        row["arch"] = arch
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        threads = mod.threads_of(spec)
        if "error" not in row:
            row["waves"] = flydsl_compile.waves_per_simd(row.get("vgpr", 0), row.get("agpr", 0), row.get("lds", 0),
                                                         arch,
                                                         threads)
        print(json.dumps(row), flush=True)
        print(f"[{arch}] {i + 1}/{len(specs)} {name} {row['compile_s']} s", file=sys.stderr, flush=True)
    return 0


def run_gate(arches=ARCHES, only: Optional[str] = None, vgpr_budget_override: Optional[int] = None,
             progress=sys.stderr) -> dict:
    """Compile for every arch (one worker process each, side by side). Returns {"rows", "failures",
    "fatal"}; a failure is (kernel, arch, reasons)."""
    root = ensure_toolchain()
    from backend_core.flydsl_compile import LDS_BYTES, compile_env

    budgets = {"*": vgpr_budget_override} if vgpr_budget_override is not None else load_budgets()
    procs = {}
    for arch in arches:
        if arch not in LDS_BYTES:
            raise ValueError(f"--arch: {arch!r} is not one of {', '.join(LDS_BYTES)}")
        env = dict(os.environ, **compile_env(arch, root))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "flydsl_backends.compile_gate", "--worker", arch] + (["--only",
                                                                                           only] if only else [])
        procs[arch] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=progress, text=True)
    rows, fatal = [], []
    for arch, proc in procs.items():
        out, _ = proc.communicate()
        for line in out.splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if "fatal" in row:
                fatal.append(f"{arch}: {row['fatal']}")
            else:
                rows.append(row)
        if proc.returncode not in (0, 2):
            fatal.append(f"{arch}: worker exited with {proc.returncode} (a crash, not a compile error)")
    failures = []
    for row in rows:
        why = verdict(row, budgets, LDS_BYTES[row["arch"]])
        row["verdict"] = "ok" if not why else "FAIL: " + "; ".join(why)
        if why:
            failures.append((row["kernel"], row["arch"], why))
    if not rows and not fatal:
        fatal.append("no specialization was compiled")
    return {"rows": rows, "failures": failures, "fatal": fatal}


def format_table(rows: List[dict]) -> str:
    table = [COLUMNS] + [tuple(str(r.get(c, "-")) for c in COLUMNS) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flydsl_backends.compile_gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join(ARCHES), help="comma list (default: gfx950,gfx942)")
    ap.add_argument("--only", default=None, help="compile only kernels whose name contains this")
    ap.add_argument("--vgpr-budget", type=int, default=None,
                    help="one VGPR budget for every kernel instead of budgets.json (to see the gate fail)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.only)
    t0 = time.perf_counter()
    try:
        res = run_gate([a.strip() for a in args.arch.split(",") if a.strip()], args.only, args.vgpr_budget)
    except (RuntimeError, ValueError) as exc:
        print(f"compile gate: {exc}", file=sys.stderr)
        return 2
    print(format_table(sorted(res["rows"], key=lambda r: (r["arch"], r["kernel"]))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    n = len(res["rows"])
    print(f"\n{n} compiled specializations, {len(res['failures'])} failing, {time.perf_counter() - t0:.0f} s")
    for msg in res["fatal"]:
        print(f"FATAL {msg}")
    for kernel, arch, why in res["failures"]:
        print(f"FAIL {kernel} [{arch}]: {'; '.join(why)}")
    return 1 if res["failures"] or res["fatal"] else 0


if __name__ == "__main__":
    sys.exit(main())
