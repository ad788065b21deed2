"""Plan once per batch, run per layer (docs/design.md §4.1; FlashInfer's plan/run split).

A server's forward step runs the same paged attention batch through every layer: the block
tables, context lengths and query layout are the batch's, only the query, the layer's caches and
its scalars change. ``plan_decode`` / ``plan_prefill`` check the batch once, from what the
framework already holds on the host (query offsets, an upper bound on the context), and
``PAPlan.run`` does the per-layer part: cheap shape checks (the cache layout check is memoized per
cache), the implementation chosen once per layer shape, and the launch state (split-K plan,
prefill work items on the device, workspace views) made once per plan. No host sync per layer.

    plan = plan_decode(block_tables, context_lengths, query_length=1, max_context=None)
    for layer in layers:
        plan.run(q, key_cache, value_cache, key_scale, value_scale, softmax_scale=..., out=o)

CUDA graphs: a decode plan is shape-only (its grid depends on the batch size and the table width,
or on ``max_context`` when given); capture one and refill its ``block_tables`` /
``context_lengths`` buffers in place before each replay: the kernels read the lengths on the
device and split each sequence's real context. A prefill plan's work items are fixed by the query
offsets it was made with, so a captured prefill replays only the same query layout.

The eager ops ``pa_decode`` / ``pa_prefill`` are a one-layer plan each.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from backend_core.validation import arg_key

from .api import registry_for
from .contract import PABatch, check_batch, check_layer

__all__ = ["PAPlan", "plan_decode", "plan_prefill"]


class PAPlan:
    """A checked batch plus the per-batch state implementations keep (``state``)."""

    def __init__(self, batch: PABatch, *, max_context: Optional[int] = None, backend: str = "auto"):
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 0):
            raise ValueError(f"max_context: expected None or an int >= 0, got {max_context!r}")
        self.batch = batch
        batch.memo_key()  # the batch tensors' layout as planned (run refuses a batch resized since)
        self.max_context = max_context  # an upper bound on every context (None: the table width)
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str ('auto' or an implementation name), got {type(backend).__name__}")
        self.backend = backend
        self.state: dict = {}  # implementation launch state, keyed by the implementation and layer shape
        self._impls: dict = {}  # layer signature -> Implementation (chosen once)

    @property
    def device(self) -> torch.device:
        return self.batch.device

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def is_decode(self) -> bool:
        return self.batch.is_decode

    def run(self, query, key_cache, value_cache, key_scale, value_scale, *, softmax_scale: Optional[float] = None,
            sliding_window: int = 0, sinks=None, num_partitions: Optional[int] = None,
            out: Optional[torch.Tensor] = None, backend: Optional[str] = None,
            before_launch: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """One layer's attention over the planned batch. Arguments as in :func:`pa_decode` /
        :func:`pa_prefill` (``query`` [T, Hq, D]; ``out`` filled in place and returned).
        ``backend`` overrides the plan's choice (an adapter's per-layer setting). ``before_launch()``
        runs once every argument is checked, before any kernel: an adapter's write of the step's new
        K/V there leaves the caches untouched when the call is refused."""
        # checked before anything else: a falsy or unhashable override must not fall back to the plan's choice
        # or fail inside the memo below with an unrelated error
        chosen = self.backend if backend is None else backend
        if not isinstance(chosen, str):
            raise TypeError(f"backend: expected None or a str ('auto' or an implementation name), got "
                            f"{type(backend).__name__}")
        if before_launch is not None and not callable(before_launch):
            raise TypeError(f"before_launch: expected None or a callable, got {type(before_launch).__name__}")
        b = self.batch
        if (arg_key(b.block_tables), arg_key(b.context_lengths), arg_key(b.query_start_loc)) != b.memo_key()[:3]:
            # resized or re-strided in place since the plan was made (refilling their values is fine)
            raise ValueError("block_tables / context_lengths / query_start_loc: changed shape, strides or storage "
                             "since the plan was made; make a new plan for this batch")
        p = check_layer(self.batch, query=query, key_cache=key_cache, value_cache=value_cache, key_scale=key_scale,
                        value_scale=value_scale, softmax_scale=softmax_scale, sliding_window=sliding_window,
                        sinks=sinks, num_partitions=num_partitions, out=out, anchor="block_tables")
        p.plan = self
        # everything an implementation's coverage check may read but the addresses (the layers of a step share
        # one choice; check_layer keeps it with its memo): shapes, dtypes, strides, alignment, scale, window
        # (FlyDSL's AITER kernel takes contiguous caches and no softmax_scale: a layer with interleaved K/V
        # pages or another scale must be chosen for anew)
        sig = (p.layer_key, chosen)
        impl = self._impls.get(sig)
        if impl is None:
            impl = self._impls[sig] = registry_for(p).select(p, chosen, device_type=p.device.type, site_depth=1)
        if before_launch is not None:
            before_launch()
        return impl.run(p)


def plan_decode(block_tables, context_lengths, *, query_length: int = 1, max_context: Optional[int] = None,
                backend: str = "auto") -> PAPlan:
    """Plan a decode batch: ``block_tables`` [num_seqs, max_blocks] int32, ``context_lengths``
    [num_seqs] int32 (new tokens included; read on the device at run time, so the buffers may be
    refilled between runs), ``query_length`` rows per sequence (1..4). ``max_context``: an upper
    bound on every context the plan will run with (None: the table width; CUDA graphs should
    leave it None or give the largest context they will replay)."""
    return PAPlan(check_batch(block_tables=block_tables, context_lengths=context_lengths, query_length=query_length),
                  max_context=max_context, backend=backend)


def plan_prefill(block_tables, query_start_loc, context_lengths, *,
                 query_start_loc_host: Optional[Sequence[int]] = None,
                 max_context: Optional[int] = None, backend: str = "auto") -> PAPlan:
    """Plan a ragged batch (extend, chunked prefill, mixed): ``query_start_loc`` [num_seqs + 1]
    int32 on the device and, to avoid a host sync, its values on the host
    (``query_start_loc_host``: a list or CPU tensor; checked non-decreasing from >= 0). The work
    items (chunks of query rows) are made from them once, on the first run."""
    if isinstance(query_start_loc_host, torch.Tensor):
        if query_start_loc_host.device.type != "cpu":
            raise ValueError("query_start_loc_host: expected host values (a list or a CPU tensor), got a tensor on "
                             f"{query_start_loc_host.device}")
        query_start_loc_host = query_start_loc_host.tolist()
    return PAPlan(check_batch(block_tables=block_tables, context_lengths=context_lengths,
                              query_start_loc=query_start_loc, query_start_loc_host=query_start_loc_host, prefill=True),
                  max_context=max_context, backend=backend)
