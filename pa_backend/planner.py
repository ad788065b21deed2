"""Split-K plan and workspace of the paged-attention kernels (docs/design.md §4.1).

The partition bound P (the grid's partition axis, or the bound of the task space that one-warp
decode programs take their tasks from) is a function of shapes only — the number of work items, KV heads,
an upper bound on the context (the block-table width, or the batch's max context when the host
knows it) and the device's SM/CU count — never of context lengths held in device memory, so no
step syncs the host and a captured CUDA graph replays with any context lengths that fit its table.
The split itself is made on the device, per sequence, from its real context (``Split``): a
sequence uses P_s <= P partitions sized to its context, so the work never depends on the table
width.

The partial results (running max, denominator and [BM, D] accumulator of every partition) live in
one grow-only FP32 workspace per device. ``reserve`` sizes it once for the largest batch and
table width a server will use; adapters call it before capturing CUDA graphs, after which no
decode step allocates. A call that needs more grows it; a buffer that was outgrown is kept alive
(never freed), because a graph captured earlier still writes to it on replay.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from backend_core.buffers import DeviceBuffers, indexed

__all__ = ["Split", "plan_partitions", "work_rows", "workspace", "task_queue", "QUEUE_SM_SLOTS", "reserve",
           "workspace_bytes"]


# Programs per SM the split-K aims for, and the partition lengths it prefers. Partitions shorter
# than LONG_PARTITION_TOKENS are made only while there are fewer than ``few_per_sm`` programs per
# SM, and none is shorter than MIN_PARTITION_TOKENS except under the small-work split
# (SHORT_TASKS_PER_SM below). The two targets follow the kernel's program
# size (an implementation passes its own, e.g. pa_backend.triton.tiling.split_policy); these defaults are
# the 4-warp Triton program's: 16 programs/SM beat 8 on long contexts (more waves, smaller tail), while
# 512-token partitions lost to 1024-token ones at 8k contexts (docs/performance.md).
PROGRAMS_PER_SM = 16
FEW_PROGRAMS_PER_SM = 4
# the largest targets any implementation uses: ``reserve`` sizes the workspace with them
MAX_PROGRAMS_PER_SM = 32
MAX_FEW_PROGRAMS_PER_SM = 16
MIN_PARTITION_TOKENS = 256
LONG_PARTITION_TOKENS = 1024
# Small work (few items x KV heads): partitions may be shorter than MIN_PARTITION_TOKENS (about sqrt(8 x
# span) tokens) while the tasks stay at most this many per SM: shorter partitions shorten each task's serial
# tile chain where the work is too small to fill the GPU, while a lower floor everywhere lost where the work was
# larger. This rule measured 1.04-1.34x faster than the 256-token floor on small batches and left the large
# decode cases unchanged (docs/performance.md).
SHORT_TASKS_PER_SM = 4
MAX_PARTITIONS = 256


@dataclass(frozen=True)
class Split:
    """The split-K plan of one launch: the grid's P and the device-side rule's parameters (a
    sequence with span tokens uses min(P, max(min(max(ceil(span / long), few), ceil(span / min)),
    min(floor(sqrt(span // 8)), short))) partitions, at least one; ``short`` 1: the second term is
    inert)."""

    P: int
    few: int
    min_tokens: int
    long_tokens: int
    short: int = 1


@functools.lru_cache(maxsize=1024)
def plan_partitions(num_items: int, Hkv: int, max_tokens: int, sms: int, requested: int = 0,
                    programs_per_sm: int = PROGRAMS_PER_SM, few_per_sm: int = FEW_PROGRAMS_PER_SM,
                    small_split: bool = True) -> Split:
    """The split of ``num_items`` sequences (or prefill chunks) of at most ``max_tokens`` visible
    tokens over ``sms`` SMs. ``requested`` (the caller's num_partitions hint) asks for that many
    partitions per sequence wherever its context has enough tiles. ``small_split``: where the work is
    small, contexts under MIN_PARTITION_TOKENS split too (SHORT_TASKS_PER_SM); the Triton launcher turns
    it on for shape-only decode plans only (not for prefill's items, where it was not measured, nor for
    plans bounded by a max context: eager steps, where one partition per short sequence writes its rows
    without a reduce launch). P never decreases when ``programs_per_sm`` or ``few_per_sm``
    grows, nor when ``small_split`` is on (``reserve`` relies on it)."""
    work = max(num_items * Hkv, 1)
    sms = max(sms, 1)
    if requested:  # at most MAX_PARTITIONS (a larger hint would also overflow the kernels' split arithmetic)
        r = max(1, min(requested, MAX_PARTITIONS))
        return Split(r, r, 1, 1)
    few = -(-few_per_sm * sms // work)
    short = max(1, SHORT_TASKS_PER_SM * sms // work) if small_split else 1
    target = -(-programs_per_sm * sms // work)
    target = min(target, max(-(-max_tokens // LONG_PARTITION_TOKENS), few))
    target = min(target, -(-max_tokens // MIN_PARTITION_TOKENS), MAX_PARTITIONS)
    # room for the small-work split of the longest span (the kernels' rule never exceeds P, so every table
    # width that holds the contexts splits them alike)
    target = min(max(target, min(math.isqrt(max(max_tokens, 0) // 8), short)), MAX_PARTITIONS)
    return Split(max(1, target), few, MIN_PARTITION_TOKENS, LONG_PARTITION_TOKENS, short)


def work_rows(G: int, QL: int) -> int:
    """BM: the M dimension of one program's dots (GQA group x query rows, padded to a power of
    two >= 16 for the tensor cores)."""
    return max(16, 1 << (G * QL - 1).bit_length())


def _floats(items: int, Hkv: int, P: int, BM: int, D: int) -> int:
    return items * Hkv * P * BM * (D + 2)


# one FP32 buffer per device (backend_core.buffers: grow-only, outgrown buffers kept alive for captured
# graphs; growth inside capture allocates from the graph's pool with a warning)
_WS = DeviceBuffers("pa split-K workspace", [(torch.float32, False)])


def workspace(device: torch.device, items: int, Hkv: int, P: int, BM: int, D: int):
    """(m [items, Hkv, P, BM], l [same], acc [items, Hkv, P, BM, D]) FP32 views of the device's
    workspace (contents undefined; every partition writes its slice before the reduce reads it)."""
    n = items * Hkv * P * BM
    buf = _WS.get(device, (_floats(items, Hkv, P, BM, D),))[0]
    return (buf[:n].view(items, Hkv, P, BM), buf[n:2 * n].view(items, Hkv, P, BM),
            buf[2 * n:n * (D + 2)].view(items, Hkv, P, BM, D))


# the partition kernel's task counter and per-SM program counters (int32 per device, zero between
# launches: the kernel's programs take tasks from it, the reduce kernel sets it back to zero)
_QUEUE = DeviceBuffers("pa task queue", [(torch.int32, True)])
QUEUE_SM_SLOTS = 1024  # per-SM counters (SM ids wrap around past it)


def task_queue(device: torch.device) -> torch.Tensor:
    """The device's task counter of the partition kernel, then QUEUE_SM_SLOTS per-SM counters (made
    zeroed on first use: before CUDA-graph capture, by ``reserve`` or an eager call)."""
    return _QUEUE.get(device, (1 + QUEUE_SM_SLOTS,))[0]


def workspace_bytes(device) -> int:
    return _WS.nbytes(device) + _QUEUE.nbytes(device)


def reserve(max_num_seqs: int, Hq: int, Hkv: int, D: int, max_context: int, block_size: int, *,
            query_length: int = 1, device="cuda", sms: int = 0) -> int:
    """Size the workspace for ``pa_decode`` batches of up to ``max_num_seqs`` sequences whose block
    tables hold ``max_context`` tokens, and make the zeroed task counters (call before CUDA-graph
    capture: a zeroed buffer cannot be made inside one). Smaller batches and
    narrower tables fit in it, whatever split targets the implementation uses (sized with the
    largest, MAX_PROGRAMS_PER_SM / MAX_FEW_PROGRAMS_PER_SM). Returns the workspace size in bytes."""
    from backend_core import platform

    for name, v in (("max_num_seqs", max_num_seqs), ("Hq", Hq), ("Hkv", Hkv), ("D", D), ("max_context", max_context),
                    ("block_size", block_size), ("query_length", query_length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if Hq % Hkv:
        raise ValueError(f"Hq: expected a multiple of Hkv={Hkv}, got {Hq}")
    device = indexed(device)  # a bare "cuda" is the current GPU, the key the kernels' calls use
    sms = sms or platform.sm_count(device)
    BM = work_rows(Hq // Hkv, query_length)
    # the largest request over batch sizes: fewer sequences get more partitions each
    need = max(_floats(b, Hkv, plan_partitions(b, Hkv, max_context, sms, 0, MAX_PROGRAMS_PER_SM,
                                               MAX_FEW_PROGRAMS_PER_SM).P, BM, D)
               for b in range(1, max_num_seqs + 1))
    _WS.get(device, (need,))
    task_queue(device)
    return workspace_bytes(device)
