"""``flydsl-backends``: info, verify, accuracy, bench, serving-accuracy.

* ``info``    the platform, and for each op which implementations are available here and why not,
              and which FlyDSL source (AITER or the project's kernel) would serve; ``--resources``
              adds the FlyDSL compile gate's resource table (gfx950, gfx942).
* ``verify``  every available implementation of every op against the reference over a shape
              grid; a pass/fail table; exit status 1 on any failure. On a machine without a GPU it
              runs the reference and the Triton kernels through Triton's interpreter on small
              shapes, and says so.
* ``accuracy`` long-horizon decode against float64: the KDA recurrent state's drift over many steps
              (bounded by its rounding whatever the step count) and a long paged decode through one
              plan with the cache written as it goes; exit status 1 on any failure.
* ``bench``   CUDA-graph timings with the copy bandwidth measured in the same run; CSV rows
              under ``benchmarks/results/``.
* ``serving-accuracy`` a real model served by vLLM or SGLang with the flydsl backend against the
              framework's own Triton backend (or HF transformers over the same FP8 K/V): the
              logprobs rule, teacher-forced agreement and perplexity; exit status 1 on a failed
              threshold (``serving_accuracy``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from backend_core.cliargs import comma_list, positive_int

from . import ops as _ops


def _prepare_cpu_interpreter() -> Optional[str]:
    """On a machine without a GPU, route Triton through its interpreter (before Triton is imported)."""
    from backend_core import platform

    if platform.has_gpu():
        return None
    if not platform.triton_available():
        return "no GPU and Triton is not installed: only the torch reference runs"
    if "triton" in sys.modules and not platform.triton_interpreter_enabled():
        return "Triton was imported before TRITON_INTERPRET=1 could be set: Triton rows skipped"
    os.environ["TRITON_INTERPRET"] = "1"
    from backend_core.interpreter import faithful_interpreter

    faithful_interpreter()  # a stray read of a poisoned FP8 page must show as NaN on CPU too
    return "no GPU: Triton kernels run through TRITON_INTERPRET=1 on CPU tensors, small shapes"


def cmd_info(args) -> int:
    note = _prepare_cpu_interpreter()
    from backend_core import platform

    s = platform.summary()
    print("flydsl-backends info")
    print(f"  torch   {s['torch']} ({s['torch_build']})")
    interp = "  [interpreter]" if platform.triton_interpreter_enabled() else ""
    print(f"  triton  {s['triton'] or 'not installed'}{interp}")
    print(f"  flydsl  {s['flydsl'] or 'not installed'}")
    for d in s["devices"]:
        print(f"  device  {d}")
    if note:
        print(f"  note    {note}")
    for op in _ops.OPS:
        for opname, reg in op.op_registries().items():
            print(f"\n{opname}: implementations (auto prefers, on GPU: {' > '.join(reg.preference['cuda'])}; "
                  f"on CPU: {' > '.join(reg.preference['cpu'])}; force with {reg.env_var}=<name>)")
            status = reg.status()
            for name, ok, why in status:
                print(f"  {name:<7} {'available' if ok else 'unavailable':<12} {why}")
            forced = reg.requested_backend("auto")  # the override in effect ("auto": none)
            if forced != "auto":
                usable = any(name == forced and ok for name, ok, _ in status)
                print(f"  {reg.env_var}={forced} is set: every call runs {forced}"
                      + ("" if usable else f", which is unavailable here, so every {opname} call will raise"))
            if any(name == "flydsl" for name, _, _ in status):  # under the op that has a FlyDSL implementation
                print(f"  flydsl sources ({_source_env()}; auto prefers AITER where it covers the call):")
                for src, ok, why in op.sources():
                    print(f"    {src:<6} {'found' if ok else 'not usable':<11} {why}")
    if args.resources:
        return _print_resources()
    return 0


def _source_env() -> str:
    from backend_core.flydsl_source import SOURCE_ENV

    return f"{SOURCE_ENV}={os.environ.get(SOURCE_ENV) or 'auto'}"


def _print_resources() -> int:
    """The compile gate's resource table (compiles every shipped FlyDSL specialization here)."""
    from . import compile_gate

    print("\nFlyDSL resources (compile-only builds on this machine, one process per arch):")
    return compile_gate.main([])


def _family_table(args, title: str, run_family, bound_legend=None) -> int:
    """What ``verify`` and ``accuracy`` share: the device, each family's rows (``run_family(fam, impls, device,
    small)`` returns a function of a per-row ``progress`` callback making them, or None when the family has no
    such run; a line every 10 s says how far a long family has got), one table per family,
    the summary; exit status 1 on any failure. ``bound_legend(fam)``: a bound column and what it bounds."""
    note = _prepare_cpu_interpreter()
    import torch

    from backend_core import platform

    gpu = platform.has_gpu()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    small = args.small or not gpu
    print(f"flydsl-backends {title} on {platform.device_info(device).name} "
          f"({'small CPU shapes' if small and not gpu else 'small shapes' if small else 'decode shapes'})")
    if note:
        print(f"note: {note}")
    families = _ops.OPS if args.op == "all" else (_ops.get(args.op),)
    # --backend is repeatable and takes comma lists; a name no family has is refused before anything runs
    wanted = {n.strip() for b in (args.backend or ()) for n in b.split(",") if n.strip()}
    if args.backend and not wanted:
        print(f"--backend: no implementation named in {args.backend!r}", file=sys.stderr)
        return 2
    known = {n for fam in families for n, _, _ in fam.registry().status()}
    if wanted - known:
        print(f"--backend: unknown implementation(s) {sorted(wanted - known)}; expected some of {sorted(known)}",
              file=sys.stderr)
        return 2
    failures = total = n_skipped = 0
    not_run = []  # requested implementations that could not run here
    for fam in families:
        op, reg = fam.name, fam.registry()
        impls = [n for n, ok, _ in reg.status() if ok and (not wanted or n in wanted)]
        job = run_family(fam, impls, device, small)
        if job is None:
            continue
        for n, ok, why in reg.status():
            if not ok:
                print(f"  {op}/{n}: not run ({why})")
                if n in wanted:
                    not_run.append(f"{op}/{n}")
        t0 = last = time.time()
        done = 0

        def tick(_row):
            nonlocal done, last
            done += 1
            if time.time() - last >= 10:
                last = time.time()
                print(f"  {op}: {done} cases run ({last - t0:.0f} s)", flush=True)

        rows = job(tick)
        ran = {r["impl"] for r in rows if not r.get("skipped")}
        for n in impls:  # asked for, available, but declined every case: not checked either
            if n in wanted and n not in ran:
                not_run.append(f"{op}/{n} (skipped on every case)")
        legend = bound_legend(fam) if bound_legend else None
        bound_head = f" {'bound':>9}" if legend else ""
        print(f"\n{'op':<5} {'impl':<7} {'result':<6} {'out err':>9} {'state err':>9}{bound_head}  case"
              + (f" (bound: {legend})" if legend else ""))
        for r in rows:
            dash = f" {'-':>9}" if legend else ""
            if r.get("skipped"):
                n_skipped += 1
                print(f"{op:<5} {r['impl']:<7} {'SKIP':<6} {'-':>9} {'-':>9}{dash}  {r['case']} ({r['skipped']})")
                continue
            total += 1
            failures += 0 if r["ok"] else 1
            detail = r.get("error") or "".join(
                f" [{k} failed]" for k in ("padding_zero", "conv_exact", "untouched_ok") if r.get(k) is False
            ).strip() or r.get("detail") or ""
            state = f"{r['state_err']:>9.2e}" if "state_err" in r else f"{'-':>9}"
            bound = (f" {r['bound']:>9.2e}" if "bound" in r else dash) if legend else ""
            tail = f"{r['case']}{'; ' + detail if detail else ''}"
            print(f"{op:<5} {r['impl']:<7} {'PASS' if r['ok'] else 'FAIL':<6} "
                  f"{r.get('out_err', float('nan')):>9.2e} {state}{bound}  {tail}")
        print(f"({time.time() - t0:.1f} s)")
    print(f"\n{total - failures} passed, {failures} failed" + (f", {n_skipped} skipped" if n_skipped else ""))
    if failures:
        return 1
    if not_run or not total:  # what was asked for was not checked: not a pass
        print("not checked: " + (", ".join(not_run) if not_run else "no implementation ran") + " (see above)")
        return 2
    return 0


def cmd_verify(args) -> int:
    return _family_table(args, "verify", lambda fam, impls, device, small:
                         lambda progress: fam.run_verify(impls, device, small, progress=progress))


def cmd_accuracy(args) -> int:
    """Long-horizon decode against float64 (each family's ``accuracy`` module): the KDA recurrent state's
    drift over many steps, and a long paged decode through one shape-only plan with the cache written as it
    goes. On a GPU 2000 steps; on the CPU interpreter a few dozen, on small shapes."""
    from backend_core import platform

    steps = args.steps if args.steps is not None else (2000 if platform.has_gpu() else 40)  # argparse: >= 1
    progress = (lambda line: print(line, flush=True)) if steps >= 200 else None

    def run(fam, impls, device, small):
        if fam.accuracy is None:
            return None
        return lambda rows: fam.run_accuracy(impls, device, steps, small, progress=rows, step_progress=progress)

    return _family_table(args, f"accuracy, {steps} decode steps against float64,", run,
                         lambda fam: "of the state error; the output may add 1e-2" if fam.name == "kda"
                         else "of the output error")


def cmd_bench(args) -> int:
    from backend_core import platform
    from backend_core.timing import check_out, write_rows

    if not platform.has_gpu() and not getattr(args, "host", False):
        print("bench needs a CUDA/ROCm GPU; this machine has none (timings on the CPU interpreter mean nothing); "
              "`bench pa --host` measures the per-layer host time on any machine", file=sys.stderr)
        return 2
    fam = _ops.get(args.op)
    known = set().union(*(reg.names() for reg in fam.op_registries().values()))
    if args.impl is None:  # the default: the kernels this family has
        args.impl = [name for name in ("triton", "flydsl") if name in known] or sorted(known)
    unknown = [name for name in args.impl if name not in known]
    if unknown:
        print(f"--impl: {', '.join(unknown)} not an implementation of {args.op} (known: {', '.join(sorted(known))})",
              file=sys.stderr)
        return 2
    if getattr(args, "host", False) and args.out:
        print("--out: `bench pa --host` prints its figures and writes no CSV", file=sys.stderr)
        return 2
    dev = platform.device_info().name.replace(" ", "_")
    # one CSV per op and device: rows append, each carrying its commit and date
    out = Path(args.out) if args.out else Path("benchmarks/results") / f"{args.op}_decode_{dev}.csv"
    bad = None if getattr(args, "host", False) else check_out(out)
    if bad:  # before any timing: a bad path must not cost the run
        print(f"--out: {bad}", file=sys.stderr)
        return 2
    if not getattr(args, "host", False):
        usable = [n for n in args.impl if any(n in reg.names() and reg.get(n).is_available()[0]
                                                 for reg in fam.op_registries().values())]
        if not usable:
            print(f"--impl: none of {', '.join(args.impl)} can run here (`flydsl-backends info` says why); "
                  "nothing to time", file=sys.stderr)
            return 2
    rows = fam.run_bench(args)
    if isinstance(rows, int):  # the op printed its own result
        return rows
    write_rows(out, rows)
    print(f"{len(rows)} rows appended to {out}")
    return 0


def _tuning_check(package: str):
    """``<package>.triton.check_environment`` (the Triton kernels' tuning variables; importing that package does
    not import Triton), or None where the family has none."""
    try:
        spec = importlib.util.find_spec(f"{package}.triton")
    except ModuleNotFoundError:  # the package is a plain module
        return None
    return None if spec is None else getattr(importlib.import_module(spec.name), "check_environment", None)


def _environment_error() -> Optional[str]:
    """The first malformed setting among the package's environment variables (the implementation
    overrides, FLYDSL_BACKENDS_SOURCE, FLYDSL_BACKENDS_TRITON_DIRECT, the Triton kernels' tuning variables), as
    one line; None when all parse.
    A server would raise the same error at its first call."""
    from backend_core.flydsl_source import requested_source

    try:
        requested_source()
        import backend_core.launch  # noqa: F401  (parses FLYDSL_BACKENDS_TRITON_DIRECT at import)

        for fam in _ops.OPS:
            for reg in fam.op_registries().values():
                reg.requested_backend("auto")
            check = _tuning_check(fam.package)
            if check is not None:
                check()
    except ValueError as exc:
        return str(exc)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flydsl-backends", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log implementation choices")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{info,verify,accuracy,bench,serving-accuracy}")
    i = sub.add_parser("info", help="platform and implementation availability")
    i.add_argument("--resources", action="store_true",
                   help="also compile every shipped FlyDSL specialization for gfx950/gfx942 and print VGPR/LDS/...")
    v = sub.add_parser("verify", help="every available implementation against the reference")
    v.add_argument("--op", default="all", choices=("all",) + _ops.names())
    v.add_argument("--backend", action="append",
                   help="only these implementations (repeatable or a comma list; exit status 2 if one cannot run here)")
    v.add_argument("--small", action="store_true", help="small shapes even on a GPU")
    a = sub.add_parser("accuracy", help="long-horizon decode against float64 (KDA state drift, a long paged decode)")
    a.add_argument("--op", default="all", choices=("all",) + _ops.names())
    a.add_argument("--backend", action="append",
                   help="only these implementations (repeatable or a comma list; exit status 2 if one cannot run here)")
    a.add_argument("--steps", type=positive_int, default=None,
                   help="decode steps (default: 2000 on a GPU, 40 without one)")
    a.add_argument("--small", action="store_true", help="small shapes even on a GPU")
    b = sub.add_parser("bench", help="CUDA-graph timings, CSV rows under benchmarks/results/")
    b.add_argument("op", choices=_ops.names())
    b.add_argument("--impl", default=None, type=comma_list(),
                   help="comma list of implementations to time (default triton,flydsl, those the op has; "
                        "those that cannot serve a case are skipped)")
    b.add_argument("--trials", type=positive_int, default=50,
                   help="timed replays per row, the median reported (pa --host: 20 x this many layer calls)")
    for fam in _ops.OPS:  # each family's own flags (their help names the op)
        fam.add_bench_args(b)
    b.add_argument("--out", default=None,
                   help="CSV path; rows append (default benchmarks/results/<op>_decode_<device>.csv)")
    s = sub.add_parser("serving-accuracy", help="a real model through vLLM / SGLang: flydsl against the framework's "
                                                "own backend (or HF over the same FP8 K/V)")
    from . import serving_accuracy

    serving_accuracy.add_args(s)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    helping = any(a in ("-h", "--help") for a in (sys.argv[1:] if argv is None else argv))
    bad = _environment_error()  # first: building the parser imports the families, which read some of them
    if bad is not None:
        print(f"error: {bad}", file=sys.stderr)
        if not helping:
            return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.cmd == "serving-accuracy":
        from . import serving_accuracy

        return serving_accuracy.main(args)
    return {"info": cmd_info, "verify": cmd_verify, "accuracy": cmd_accuracy, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
