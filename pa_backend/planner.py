"""Split-K plan and workspace of the paged-attention kernels (DESIGN §4).

A plan is a function of shapes only — the number of work items, KV heads, the block-table width
and the device's SM/CU count — never of context lengths held in device memory, so no step syncs
the host and a captured CUDA graph replays with any context lengths that fit its table.

The partial results (running max, denominator and [BM, D] accumulator of every partition) live in
one grow-only FP32 workspace per device. ``reserve`` sizes it once for the largest batch and
table width a server will use; adapters call it before capturing CUDA graphs, after which no
decode step allocates. A call that needs more grows it; a buffer that was outgrown is kept alive
(never freed), because a graph captured earlier still writes to it on replay.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Dict, List, Tuple

import torch

__all__ = ["plan_partitions", "work_rows", "workspace", "reserve", "workspace_bytes"]

log = logging.getLogger("flydsl_backends.pa")

# Programs per SM the split-K aims for, and the fewest tokens a partition should hold.
PROGRAMS_PER_SM = 8  # H200 sweep: 8 beat 1, 2 and 4 at every decode shape measured
MIN_PARTITION_TOKENS = 256


@functools.lru_cache(maxsize=1024)
def plan_partitions(num_items: int, Hkv: int, max_tokens: int, block_size: int, sms: int,
                    requested: int = 0, programs_per_sm: int = PROGRAMS_PER_SM) -> Tuple[int, int]:
    """(P partitions, NBP blocks per partition) for ``num_items`` sequences (or prefill chunks)
    whose table rows hold ``max_tokens`` tokens.

    Aims for num_items * Hkv * P >= programs_per_sm * sms programs with >= MIN_PARTITION_TOKENS
    tokens per partition; NBP is rounded up to a power of two (a compile-time loop count, so the
    number of kernel specializations stays small). ``requested`` (the caller's num_partitions)
    replaces the target count; it is capped by the number of blocks.
    """
    blocks = max(1, -(-max_tokens // block_size))
    if requested:
        target = requested
    else:
        target = -(-programs_per_sm * max(sms, 1) // max(num_items * Hkv, 1))
        target = min(target, max(1, -(-max_tokens // MIN_PARTITION_TOKENS)))
    target = max(1, min(target, blocks))
    nbp = 1 << (-(-blocks // target) - 1).bit_length()
    return -(-blocks // nbp), nbp


def work_rows(G: int, QL: int) -> int:
    """BM: the M dimension of one program's dots (GQA group x query rows, padded to a power of
    two >= 16 for the tensor cores)."""
    return max(16, 1 << (G * QL - 1).bit_length())


def _floats(items: int, Hkv: int, P: int, BM: int, D: int) -> int:
    return items * Hkv * P * BM * (D + 2)


class _Workspace:
    def __init__(self):
        self.lock = threading.Lock()
        self.buffers: Dict[torch.device, torch.Tensor] = {}
        self.retired: List[torch.Tensor] = []  # outgrown buffers earlier graphs may still write

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        with self.lock:
            buf = self.buffers.get(device)
            if buf is None or buf.numel() < n:
                if buf is not None:
                    self.retired.append(buf)
                    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                        log.warning("pa workspace grew to %d MiB during CUDA-graph capture; call "
                                    "pa_backend.reserve() with the largest batch before capturing", n * 4 >> 20)
                buf = torch.empty(max(n, 2 * buf.numel() if buf is not None else n), dtype=torch.float32,
                                  device=device)
                self.buffers[device] = buf
            return buf


_WS = _Workspace()


def workspace(device: torch.device, items: int, Hkv: int, P: int, BM: int, D: int):
    """(m [items, Hkv, P, BM], l [same], acc [items, Hkv, P, BM, D]) FP32 views of the device's
    workspace (contents undefined; every partition writes its slice before the reduce reads it)."""
    n = items * Hkv * P * BM
    buf = _WS.get(torch.device(device), _floats(items, Hkv, P, BM, D))
    return (buf[:n].view(items, Hkv, P, BM), buf[n:2 * n].view(items, Hkv, P, BM),
            buf[2 * n:n * (D + 2)].view(items, Hkv, P, BM, D))


def workspace_bytes(device) -> int:
    buf = _WS.buffers.get(torch.device(device))
    return 0 if buf is None else buf.numel() * 4


def reserve(max_num_seqs: int, Hq: int, Hkv: int, D: int, max_context: int, block_size: int, *,
            query_length: int = 1, device="cuda", sms: int = 0) -> int:
    """Size the workspace for ``pa_decode`` batches of up to ``max_num_seqs`` sequences whose block
    tables hold ``max_context`` tokens (call before CUDA-graph capture). Smaller batches and
    narrower tables fit in it. Returns the workspace size in bytes."""
    from backend_core import platform

    for name, v in (("max_num_seqs", max_num_seqs), ("Hq", Hq), ("Hkv", Hkv), ("D", D), ("max_context", max_context),
                    ("block_size", block_size), ("query_length", query_length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if Hq % Hkv:
        raise ValueError(f"Hq: expected a multiple of Hkv={Hkv}, got {Hq}")
    device = torch.device(device)
    sms = sms or platform.sm_count(device)
    BM = work_rows(Hq // Hkv, query_length)
    # the largest request over batch sizes: fewer sequences get more partitions each
    need = max(_floats(b, Hkv, plan_partitions(b, Hkv, max_context, block_size, sms)[0], BM, D)
               for b in range(1, max_num_seqs + 1))
    _WS.get(device, need)
    return workspace_bytes(device)
