"""What the decode probes share (GPU only): a planned decode checked against the float64 reference,
then timed under CUDA-graph replay; the device time of its kernels (torch.profiler); kernels of
another commit loaded beside the tree's."""
import importlib.util
import os
import subprocess
import tempfile

import torch

from backend_core.timing import time_cuda_graph
from pa_backend.benchmark import accuracy


def checked_timing(plan, kw, args, out, nbytes, copy_gbps, trials=30):
    """(median us, % of the copy bandwidth, rel. error) of ``plan.run(**args, out=out)``: the output is
    filled with NaN and checked before the timing."""
    out.fill_(float("nan"))
    plan.run(**args, out=out)
    err = accuracy(kw, out)
    t = time_cuda_graph(lambda i: plan.run(**args, out=out), inner=2, trials=trials)
    return t.median_us, 100 * nbytes / (t.median_us * 1e-6) / 1e9 / copy_gbps, err


def kernel_times(plan, args, out, runs=40, match="pa_decode"):
    """{kernel: (mean device us, launches)} of ``runs`` eager calls (after 5 warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        plan.run(**args, out=out)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            plan.run(**args, out=out)
        torch.cuda.synchronize()
    return {ev.key: (ev.device_time_total / ev.count, ev.count) for ev in prof.key_averages() if match in ev.key}


def kernel_summary(plan, args, out) -> str:
    """"partition 72.1 us, reduce 7.6 us": the device time per call of each paged-attention kernel."""
    return ", ".join(f"{k.split('_kernel')[0].replace('pa_decode_', '')} {us:.1f} us"
                     for k, (us, _) in kernel_times(plan, args, out).items())


def module_from_source(src: str, name: str):
    """A module made from the Python source ``src`` (a kernel file as another commit or a variant has it)."""
    path = os.path.join(tempfile.mkdtemp(prefix=f"{name}_"), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def module_at(commit: str, path: str = "pa_backend/triton/pa_decode.py", name: str = "probe_base"):
    """The kernel module ``path`` as ``commit`` has it (the device copy carries the landed history)."""
    src = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout
    return module_from_source(src, name)


class Relaunch:
    """A kernel of another commit launched where the tree launches its own: ``drop`` names the tree's
    arguments it does not take; ``adapt(grid, kwargs) -> (grid, kwargs)`` may change the rest."""

    def __init__(self, kernel, drop=(), adapt=None):
        self.kernel, self.drop, self.adapt = kernel, tuple(drop), adapt

    def __getitem__(self, grid):
        def launch(*args, **kw):
            for n in self.drop:
                kw.pop(n, None)
            g = grid
            if self.adapt is not None:
                g, kw = self.adapt(grid, kw)
            return self.kernel[g](*args, **kw)
        return launch


def probe_line(label, variant, rnd, kw, args, out, nbytes, copy_gbps, ql=1) -> None:
    """Plan, check and time one decode variant (a shape-only plan of ``kw``'s tables), profile its kernels in
    round 0, and print one line (errors too: a failing variant must not stop the others)."""
    from pa_backend import plan_decode

    try:
        plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, backend="triton")
        us, pct, err = checked_timing(plan, kw, args, out, nbytes, copy_gbps)
        ks = kernel_summary(plan, args, out) if rnd == 0 else ""
        print(f"  {label} round {rnd} {variant}: {us:.1f} us ({pct:.1f}% of copy) rel.err {err:.2e}"
              f"{'; ' + ks if ks else ''}", flush=True)
    except Exception as exc:
        print(f"  {label} {variant}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def decode_problem(kw, who: str, scales_why: str):
    """The pure-decode bench_case ``kw`` a framework baseline takes, unpacked and checked:
    (query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, NB, Hkv, D, block, B, Hq).
    ``who`` names the baseline in the errors; ``scales_why`` says why it takes per-tensor scales only."""
    q, kc, vc = kw["query"], kw["key_cache"], kw["value_cache"]
    bt, lens = kw["block_tables"], kw["context_lengths"]
    ks, vs = kw["key_scale"], kw["value_scale"]
    if int(kw.get("query_length", 1)) != 1 or "query_start_loc" in kw:
        raise ValueError(f"{who}: pure decode batches only (one query token per sequence)")
    if ks.dim() != 0 or vs.dim() != 0:
        raise ValueError(f"{who}: per-tensor KV scales only (bench_case scales='tensor'): {scales_why}")
    if kc.dtype != torch.float8_e4m3fn or vc.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{who}: expected an FP8 e4m3fn cache, got {kc.dtype} / {vc.dtype}")
    NB, Hkv, D16, bs, X = kc.shape
    D = D16 * X
    B, Hq = int(bt.shape[0]), int(q.shape[1])
    if tuple(q.shape) != (B, Hq, D) or tuple(vc.shape) != (NB, Hkv, D, bs):
        raise ValueError(f"{who}: unexpected shapes: query {tuple(q.shape)}, key_cache {tuple(kc.shape)}, "
                         f"value_cache {tuple(vc.shape)}, block_tables {tuple(bt.shape)}")
    return q, kc, vc, bt, lens, ks, vs, NB, Hkv, D, bs, B, Hq
