"""Where plan.run's host time goes with the direct launch (GPU machine; nothing here ships): the null
implementation (validation and dispatch only), the Triton kernels through Triton's launch, directly, and bound (the plan's later layers: addresses put into
a kept argument list, backend_core.launch.Bound), the
direct path with the driver launcher stubbed out (this project's Python alone), and the launcher alone (Triton's
CudaLauncher with the arguments ready). B=8, Hq=32, Hkv=8, D=128, context 1024, 128k-token table.
``--profile``: then a cProfile of the direct plan.run (the functions by their own time).
Run from the repo root: python3 benchmarks/pa_probe/host_split.py [calls] [--profile]"""
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from backend_core import launch  # noqa: E402
from pa_backend import plan_decode  # noqa: E402
from pa_backend.benchmark import bench_case, null_kernels  # noqa: E402

argv = [a for a in sys.argv[1:] if a != "--profile"]
n = int(argv[0]) if argv else 2000
kw = bench_case(8, 1024, 1, 32, 8, 128, 16, "tensor", torch.device("cuda"), table_tokens=1 << 17)
args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
out = torch.empty_like(kw["query"])


def timed(fn, reps=5):
    best = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    best.sort()
    return best[len(best) // 2]


print(torch.cuda.get_device_name(), f"{n} calls x 5, median")
with null_kernels():
    plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="null")
    print(f"null plan.run: {timed(lambda: plan.run(**args, out=out, backend='null')):.1f} us")
plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="triton")
run = lambda: plan.run(**args, out=out)  # noqa: E731
bound_call = launch.Bound.__call__
for mode in ("Triton", "direct", "bound", "Triton", "direct", "bound"):
    launch.enabled = mode != "Triton"
    # "direct": every layer builds its argument list and launch key (the bound launches refused; the kept ones
    # are still made per call, a little more than the thirteenth session's direct path)
    launch.Bound.__call__ = bound_call if mode == "bound" else (lambda self, *t: False)
    for _ in range(10):
        run()
    print(f"triton plan.run, {mode} launch: {timed(run):.1f} us")
launch.enabled = True
launch.Bound.__call__ = bound_call
kernels = [k for site in launch._SITES.values() for k in site.kernels.values()]
saved = [k._run for k in kernels]
calls = []
for k, r in zip(kernels, saved):
    def rec(*a, _r=r):
        calls.append((_r, a))
    k._run = rec
run()
recorded = list(calls)
print(f"launches per plan.run: {len(recorded)}")
for k in kernels:
    k._run = lambda *a: None
print(f"direct plan.run with the launcher stubbed (this project's Python): {timed(run):.1f} us")
for k, r in zip(kernels, saved):
    k._run = r


def launcher_only():
    for r, a in recorded:
        r(*a)


print(f"Triton's launcher alone, {len(recorded)} launches: {timed(launcher_only):.1f} us")
mods = [r.launch for r, _ in recorded]
rest = [(m, r, a) for m, (r, a) in zip(mods, recorded)]


def c_only():
    for m, r, a in rest:
        m(a[0], a[1], a[2], a[3], a[4], r.launch_cooperative_grid, r.launch_pdl, None, None, *a[5:])


if all(r.global_scratch_size == 0 and r.profile_scratch_size == 0 for r, _ in recorded):
    print(f"the C launch alone (no scratch to allocate): {timed(c_only):.1f} us")
t = torch.empty(1, device="cuda")
print(f"torch add_ (one small kernel, for scale): {timed(lambda: t.add_(1)):.1f} us")
if "--profile" in sys.argv:
    launch.enabled = True
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        run()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
