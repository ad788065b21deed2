"""What the decode probes share (GPU only): a planned decode checked against the float64 reference,
then timed under CUDA-graph replay; the device time of its kernels (torch.profiler)."""
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
