"""The timing loop and command line shared by ``integration_tests/{vllm,sglang}/host_time.py``: the host time
of an adapter's once-per-step metadata and of one layer's call, the work queued but not awaited."""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple


def time_step_and_layers(step: Callable[[], object], layer: Callable[[object], None], layers: int,
                         device: str, before_layers: Callable[[], None] = lambda: None) -> Tuple[float, float]:
    """(us per ``step()``, us per ``layer(state)``): ``step`` makes the batch's metadata and returns what the
    layers take, ``layer`` is one layer's call. Ten warm-up rounds; ``layers // 10`` timed steps, then
    ``before_layers()`` and ``layers`` timed layer calls on the last step's state (a GPU is synchronized
    around them only)."""
    import torch

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    state = step()
    for _ in range(10):
        layer(state)
        state = step()
    steps = max(layers // 10, 1)
    t0 = time.perf_counter()
    for _ in range(steps):
        state = step()
    step_us = (time.perf_counter() - t0) / steps * 1e6
    before_layers()
    sync()
    t0 = time.perf_counter()
    for _ in range(layers):
        layer(state)
    layer_us = (time.perf_counter() - t0) / layers * 1e6
    sync()
    if PROFILE:
        _profile(lambda: [layer(state) for _ in range(layers)], layers)
        sync()
    return step_us, layer_us


PROFILE = False  # set by parse() from --profile


def _profile(fn, calls: int, top: int = 25) -> None:
    """cProfile of ``fn`` (``calls`` layer calls): the functions by their own time, in us per layer call."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"  profile of {calls} layer calls (own time per layer call, us; cumulative; calls per layer):")
    for (file, line, name), (_, ncalls, tt, ct, _) in rows:
        print(f"    {tt / calls * 1e6:7.2f} {ct / calls * 1e6:8.2f} {ncalls / calls:5.1f}  "
              f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line} {name}")


def parse(argv: Optional[List[str]]) -> Tuple[int, str, str]:
    """``[layers] [--gpu] [--profile]`` -> (layers, device, implementation): the CPU with null kernels, or
    ``--gpu`` with the Triton kernels launched; ``--profile`` also prints a cProfile of the layer calls."""
    import sys

    global PROFILE

    argv = sys.argv[1:] if argv is None else argv
    nums = [a for a in argv if not a.startswith("--")]
    device, impl = ("cuda", "triton") if "--gpu" in argv else ("cpu", "null")
    PROFILE = "--profile" in argv
    return (int(nums[0]) if nums else 400), device, impl
