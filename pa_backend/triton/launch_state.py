"""Launch state of the Triton paged-attention kernels: what every layer of one batch shares.

A plan (``pa_backend.contract.PAPlan``: one forward batch; an eager call is a one-layer plan) keeps one
``Launch`` per layer shape in ``plan.state``: the tiling (``tiling.py``), the split-K plan and its workspace
views (``planner.py``), the prefill work items on the device, the task queue and the grid. It is made from
the plan's first layer of that shape, so a layer's call only launches. No step reads device memory on the
host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backend_core import platform

from ..planner import QUEUE_SM_SLOTS, plan_partitions, task_queue, work_rows, workspace
from . import tiling

if TYPE_CHECKING:  # annotations only (the contract imports the registries, which import this)
    from ..contract import PAProblem

__all__ = ["Launch", "launch_state", "prefill_chunks", "clear_unworked_rows", "RESIDENT"]


def prefill_chunks(qsl, rows_per_chunk: int):
    """Work items of a ragged batch: chunks of at most ``rows_per_chunk`` query rows of one
    sequence, as (sequence, first query row, rows, rows of the sequence after the chunk) — the
    kernel sees context_lengths[sequence] - rows_after tokens for the chunk's last row. From the
    host query offsets ``qsl`` (no device read)."""
    items = []
    for s in range(len(qsl) - 1):
        ql = qsl[s + 1] - qsl[s]
        for r0 in range(0, max(ql, 0), rows_per_chunk):
            n = min(rows_per_chunk, ql - r0)
            items.append((s, qsl[s] + r0, n, ql - r0 - n))
    return items


def _to_device(rows, device):
    """(device tensor, its pinned host source or None). The caller keeps the host source as long as the
    device tensor: a copy recorded into a CUDA graph (a plan's first run inside a capture) reads that host
    memory again at every replay, so it must not return to the pinned-memory cache."""
    t = torch.tensor(rows or [(0, 0, 0, 0)], dtype=torch.int32)
    if device.type == "cuda":
        t = t.pin_memory()
        return t.to(device, non_blocking=True), t  # no host sync
    return t.to(device), None


class Launch:
    """Everything a layer's launch needs that does not change between the layers of one batch."""

    def __init__(self, p: PAProblem):
        c = p.cache
        self.G, self.D = p.Hq // c.Hkv, c.D
        amd = p.device.type == "cuda" and platform.is_hip()
        if p.is_decode:
            self.QL, self.items, self.chunks = p.query_length, p.num_seqs, None
            self.zero_rows = None
        else:
            self.QL = tiling.prefill_tiling(self.D, self.G, c.block_size, amd)[0]
            # the chunks that see the most context first (a sequence's last chunks): the long programs
            # start in the first wave instead of forming the tail
            rows = sorted(prefill_chunks(p.query_start_loc_host, self.QL), key=lambda r: r[3])
            self.items = len(rows)
            self.chunks, self._chunks_host = _to_device(rows, p.device)
            self.zero_rows = (p.query_start_loc_host[0], p.query_start_loc_host[-1])  # rows outside every sequence
        self.BM = work_rows(self.G, self.QL)
        if p.is_decode:
            bt, self.warps, self.stages = tiling.decode_tiling(self.D, self.BM, c.block_size, amd)
        else:
            _, bt, self.warps, self.stages = tiling.prefill_tiling(self.D, self.G, c.block_size, amd)
        if bt & (bt - 1) or bt < 16:
            raise ValueError(f"BT={bt}: expected a power of two >= 16")
        if c.block_size & (c.block_size - 1):
            # a block of 48, 80, 96 or 112 tokens: tiles of its largest power-of-two divisor (>= 16), so a
            # tile always lies inside one block
            bt = min(bt, c.block_size & -c.block_size)
        self.bt = bt
        self.align = max(bt, c.block_size)
        self.max_tokens = int(p.block_tables.shape[1]) * c.block_size
        bound = self.max_tokens
        max_context = p.plan.max_context
        if max_context is not None:
            bound = min(bound, max(int(max_context), 1))
        # the small-work split for shape-only decode plans (CUDA graphs, eager calls: no bound; measured on
        # decode only, so prefill's items keep the 256-token floor); a plan bounded by its batch's max context
        # keeps one partition per short sequence (written directly, no reduce)
        self.split = plan_partitions(self.items, c.Hkv, bound, platform.sm_count(p.device), p.num_partitions or 0,
                                     *tiling.split_policy(self.warps),
                                     small_split=p.is_decode and max_context is None)
        self.ws = workspace(p.device, self.items, c.Hkv, self.split.P, self.BM, self.D) if self.items else None
        # one-warp decode programs of a shape-only plan (the table width bounds the context: CUDA graphs,
        # eager calls) take tasks from a device queue (pa_decode.py): such a grid carries programs past
        # each sequence's split, and the live ones land unevenly. A plan that knows its batch's max context
        # sizes the grid to it, and the grid is then as fast or faster (measured; docs/performance.md).
        # Larger programs keep the grid.
        self.queue_mode = (p.is_decode and self.warps == 1 and not p.num_partitions
                           and max_context is None)
        self.queue = task_queue(p.device) if self.items else None
        self.tasks = self.items * c.Hkv * self.split.P  # the task space's upper bound (shape-only)
        self.sms = platform.sm_count(p.device) if p.device.type == "cuda" else 4  # interpreter: a few programs
        self.resident_key = (p.device, self.D, self.BM, self.bt, self.warps, self.stages, c.v_transposed,
                             c.k_per_token, c.v_per_token, not p.is_decode, tiling.register_cap(self.warps))
        self.v_maxnum = tiling.v_maxnum(p.device)
        self.qk8 = tiling.fp8_qk(p.device, c, self.BM, p.query.dtype)
        # per-SM program counters (NVIDIA: %smid): a power of two >= the SM count
        self.sm_slots = min(1 << (self.sms - 1).bit_length(), QUEUE_SM_SLOTS) if self.v_maxnum else 0
        cap = tiling.register_cap(self.warps, self.queue_mode, p.is_decode) if self.v_maxnum else None  # NVIDIA
        self.launch_options = {"maxnreg": cap} if cap else {}
        self.grid = None if self.queue_mode else (self.items, c.Hkv, self.split.P)  # queue: set on first launch
        # one partition per item (a plan bounded by a short max context, or a narrow table): the partition
        # kernel writes the output rows itself and the reduce is not launched (one launch per layer less)
        self.direct = not self.queue_mode and self.split.P == 1
        self.reduce_warps = tiling.reduce_warps(self.D, self.BM)
        self.reduce_unroll = tiling.reduce_unroll(self.D, self.BM)
        # the plan's bound launches (backend_core.launch.bind) by layer signature
        self.bound = {}


# programs per SM of each compiled partition kernel (platform.resident_programs), filled by its first
# launch: the grid of later launches (and of captured graphs) is one wave of resident programs
RESIDENT: dict = {}


def launch_state(p: PAProblem) -> Launch:
    """The launch state of ``p``: made once per plan and layer shape (an eager call is a one-layer plan)."""
    c = p.cache
    key = ("triton", p.Hq, c.Hkv, c.D, c.block_size, p.num_partitions)
    st = p.plan.state.get(key)
    if st is None:
        st = p.plan.state[key] = Launch(p)
    return st


def clear_unworked_rows(L: "Launch", p: PAProblem) -> bool:
    """Zero the output rows outside every work item (a prefill's padding rows); whether any item has work."""
    if L.zero_rows is not None:
        p.out[:L.zero_rows[0]].zero_()
        p.out[L.zero_rows[1]:].zero_()
    return L.items > 0
