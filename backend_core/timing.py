"""Benchmark harness: CUDA-graph replay timing, the copy-bandwidth probe, CSV result rows.

Timing method (used by every ``flydsl-backends bench`` row):

* the callable is run eagerly a few times (compilation, autotuning), then ``inner`` calls are
  captured in one CUDA graph; the caller's callable receives the call number so it can rotate
  over several input sets (so caches do not hold the working set between calls);
* each trial replays the graph between two CUDA events; the per-call time is the trial time
  divided by ``inner``; the reported figure is the median over ``trials`` (>= 30).

The copy-bandwidth probe times a large device-to-device copy the same way and counts bytes read
plus bytes written, so "% of copy" compares like with like.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

import torch

__all__ = ["Timing", "time_cuda_graph", "time_eager", "copy_bandwidth_gbps", "git_commit", "write_rows", "check_out",
           "RESULT_FIELDS", "BenchContext", "bench_context", "result_row"]


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    trials: int
    inner: int


def time_cuda_graph(fn: Callable[[int], object], *, inner: int = 20, trials: int = 50, warmup: int = 3,
                    device: Optional[torch.device] = None,
                    after_capture: Optional[Callable[[], None]] = None) -> Timing:
    """Median per-call time of ``fn(i)`` (i = 0..inner-1) captured ``inner`` times in one graph.
    ``after_capture()`` runs once between the capture and the first replay (e.g. to poison the outputs,
    so that what they hold afterwards was written by the replays, not by the eager warm-up)."""
    if trials < 1 or inner < 1:
        raise ValueError(f"trials and inner must be >= 1, got trials={trials}, inner={inner}")
    device = device or torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for w in range(warmup):
            for i in range(inner):
                fn(i)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(inner):
            fn(i)
    if after_capture is not None:
        after_capture()
    graph.replay()
    torch.cuda.synchronize(device)
    times: List[float] = []
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return _timing(times, trials, inner)


def time_eager(fn: Callable[[int], object], *, trials: int = 30, warmup: int = 3,
                device: Optional[torch.device] = None) -> Timing:
    """Median time of eager calls ``fn(i)``, CUDA events around each call (host work included):
    for ops that cannot be captured in a graph, e.g. a prefill that reads its metadata on the host."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    device = device or torch.device("cuda", torch.cuda.current_device())
    for w in range(warmup):
        fn(w)
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times: List[float] = []
    for i in range(trials):
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return _timing(times, trials, 1)


def _timing(times: List[float], trials: int, inner: int) -> Timing:
    times = sorted(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return Timing(statistics.median(times), q(0.1), q(0.9), trials, inner)


def copy_bandwidth_gbps(nbytes: int = 2 << 30, trials: int = 30, device: Optional[torch.device] = None) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of trials.

    The best of two copies is taken: the runtime's memcpy (``copy_``) and an elementwise kernel
    (``mul(src, 1)``), since either can be the faster one on a given GPU.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(50):  # clocks leave their idle state before timing
        dst.copy_(src)
    best = 0.0
    for fn in (lambda i: dst.copy_(src), lambda i: torch.mul(src, 1.0, out=dst)):
        t = time_cuda_graph(fn, inner=4, trials=trials, warmup=2, device=device)
        best = max(best, 2 * src.numel() * 4 / (t.median_us * 1e-6) / 1e9)
    src = dst = None  # freed before the caller allocates its own buffers
    torch.cuda.empty_cache()
    return best


def git_commit() -> str:
    """The commit being measured: FLYDSL_BACKENDS_COMMIT (set when the tree travels without .git), else git."""
    env = os.environ.get("FLYDSL_BACKENDS_COMMIT")
    if env:
        return env
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        pass
    return "unknown"


RESULT_FIELDS = ["date", "commit", "device", "op", "impl", "shape", "us", "p10_us", "p90_us", "bytes", "gbps",
                 "pct_copy", "copy_gbps", "trials", "notes"]


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def check_out(path: Path) -> Optional[str]:
    """Why ``write_rows`` could not append to ``path`` (one line), or None. Checked before a benchmark runs, so a
    bad path costs no timings: a folder, a parent that is a file, a file that cannot be opened for appending, or
    an existing file whose first line is not this CSV's header (it would get rows of another format)."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder; give a CSV file path"
    parent = next((q for q in path.parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"{parent} is not a folder"
    if path.exists() and path.stat().st_size:
        try:
            with path.open(newline="") as f:
                first = f.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            return f"{path} cannot be read ({exc})"
        if first != ",".join(RESULT_FIELDS):
            return f"{path} exists and is not a results CSV of this format (its first line is {first[:60]!r})"
    if (path.exists() and not os.access(path, os.W_OK)) or not os.access(parent or Path("."), os.W_OK):
        return f"{path} is not writable"
    return None


def write_rows(path: Path, rows: Iterable[Dict[str, object]]) -> Path:
    """Append rows (dicts keyed by RESULT_FIELDS) to a CSV file, writing the header when new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


@dataclass
class BenchContext:
    """What every row of one benchmark run shares: device, commit, date, the copy bandwidth."""

    device: torch.device
    device_name: str
    commit: str
    date: str
    copy_gbps: float


def bench_context(progress=print) -> BenchContext:
    """Start a benchmark run on the current GPU: measures the copy bandwidth and says so."""
    from backend_core import platform

    if not platform.has_gpu():
        raise RuntimeError("benchmarks need a CUDA/ROCm GPU (timings on the CPU interpreter mean nothing)")
    dev = torch.device("cuda", torch.cuda.current_device())
    info = platform.device_info(dev)
    ctx = BenchContext(dev, info.name, git_commit(), today(), copy_bandwidth_gbps(device=dev))
    progress(f"device {info.name} ({info.arch}), copy bandwidth {ctx.copy_gbps:.0f} GB/s (read+write), "
             f"commit {ctx.commit}")
    return ctx


def result_row(ctx: BenchContext, op: str, impl: str, shape: str, t: Timing, nbytes: int,
               notes: str = "") -> Dict[str, object]:
    """One CSV row (RESULT_FIELDS): time, logical GB/s and % of the run's copy bandwidth."""
    gbps = nbytes / (t.median_us * 1e-6) / 1e9
    return {"date": ctx.date, "commit": ctx.commit, "device": ctx.device_name, "op": op, "impl": impl, "shape": shape,
            "us": f"{t.median_us:.3f}", "p10_us": f"{t.p10_us:.3f}", "p90_us": f"{t.p90_us:.3f}", "bytes": nbytes,
            "gbps": f"{gbps:.1f}", "pct_copy": f"{100 * gbps / ctx.copy_gbps:.1f}", "copy_gbps": f"{ctx.copy_gbps:.1f}",
            "trials": t.trials, "notes": notes}
