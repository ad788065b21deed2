"""Compare two lm-eval GSM8K results (FLYDSL vs the framework's default attention backend) with the
pass rule of docs/serving-accuracy.md.

    python -m integration_tests.e2e.gsm8k_compare FLYDSL_RESULTS DEFAULT_RESULTS [--tolerance 0.01]

Each argument is an lm-eval results file (``results_<timestamp>.json``, written under
``--output_path``) or a directory holding them (the newest ``results_*.json`` below it is used).
The score is the task's ``exact_match,<filter>`` (default task ``gsm8k``, filter ``strict-match``);
both runs must have evaluated the same number of questions with the same few-shot count.

Pass rule: |flydsl - default| <= tolerance (default 0.01, one point of accuracy). Both scores, their
stderr and the difference are printed, then ``PASS`` or ``FAIL``.
Exit status: 0 pass, 1 fail, 2 the files cannot be compared (missing, not lm-eval results, the task
or metric absent, different question counts or few-shot settings).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path


class ResultsError(Exception):
    """A results file that cannot be used for the comparison."""


@dataclass
class Score:
    path: Path
    value: float
    stderr: float | None
    n: int | None
    num_fewshot: int | None


def find_results(path) -> Path:
    """``path`` itself if it is a file, else the newest ``results_*.json`` below the directory."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
        raise ResultsError(f"{path}: no results_*.json below this directory")
    raise ResultsError(f"{path}: no such file or directory")


def read_score(path, task: str = "gsm8k", filter_name: str = "strict-match") -> Score:
    path = find_results(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ResultsError(f"{path}: not readable as JSON ({e})") from e
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, dict):
        raise ResultsError(f"{path}: no 'results' object (not an lm-eval results file)")
    if task not in results:
        raise ResultsError(f"{path}: task {task!r} absent (tasks: {sorted(results)})")
    metrics = results[task]
    key = f"exact_match,{filter_name}"
    if key not in metrics:
        raise ResultsError(f"{path}: metric {key!r} absent for {task} (metrics: {sorted(metrics)})")
    value = metrics[key]
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ResultsError(f"{path}: {key} = {value!r} is not a finite number")
    stderr = metrics.get(f"exact_match_stderr,{filter_name}")
    n = (data.get("n-samples") or {}).get(task, {}).get("effective")
    shots = (data.get("n-shot") or {}).get(task)
    return Score(path, float(value), stderr if isinstance(stderr, (int, float)) else None,
                 n if isinstance(n, int) else None, shots if isinstance(shots, int) else None)


def compare(flydsl: Score, default: Score, tolerance: float) -> bool:
    """True when the scores are within ``tolerance``; ``ResultsError`` when the runs differ in
    question count or few-shot setting (the scores would not be comparable)."""
    if flydsl.n is not None and default.n is not None and flydsl.n != default.n:
        raise ResultsError(f"different question counts: flydsl {flydsl.n}, default {default.n}")
    if flydsl.num_fewshot is not None and default.num_fewshot is not None and flydsl.num_fewshot != default.num_fewshot:
        raise ResultsError(f"different few-shot counts: flydsl {flydsl.num_fewshot}, default {default.num_fewshot}")
    return abs(flydsl.value - default.value) <= tolerance + 1e-12


def _line(name: str, s: Score) -> str:
    err = f" +- {s.stderr:.4f}" if s.stderr is not None else ""
    return f"{name:8s} {s.value:.4f}{err}  (n={s.n}, {s.num_fewshot}-shot)  {s.path}"


def _tolerance(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("flydsl", help="lm-eval results (file or --output_path directory) of the FLYDSL server")
    ap.add_argument("default", help="lm-eval results of the framework's default backend")
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--filter", default="strict-match", help="lm-eval filter name (strict-match, flexible-extract)")
    ap.add_argument("--tolerance", type=_tolerance, default=0.01, help="largest allowed |difference| (0.01 = 1 point)")
    args = ap.parse_args(argv)
    try:
        fly = read_score(args.flydsl, args.task, args.filter)
        ref = read_score(args.default, args.task, args.filter)
        ok = compare(fly, ref, args.tolerance)
    except ResultsError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    print(f"{args.task} exact_match,{args.filter}")
    print(_line("flydsl", fly))
    print(_line("default", ref))
    diff = fly.value - ref.value
    print(f"difference {diff:+.4f} ({100 * diff:+.2f} points); rule |difference| <= {args.tolerance:.4f}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
