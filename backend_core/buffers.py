"""Grow-only per-device buffers that CUDA graphs can keep pointing at (docs/design.md §4.1).

Kernels need scratch memory (split-K partials, last-program counters) and adapters need persistent
index vectors whose addresses a captured CUDA graph bakes in. ``DeviceBuffers`` is the one way the
package holds such memory:

* ``get(device, sizes)`` returns one tensor per declared part, each at least as large as asked
  (contents undefined unless the part is declared ``zeroed``; a zeroed part is zero when
  allocated, and its users must leave it zero after every launch).
* Growth: to the larger of the request, the caller's ``minimum`` and twice the current size. An
  outgrown set is kept alive for the life of the process, never freed: a graph captured with it
  still reads and writes it on every replay.
* During CUDA-graph capture a set that must grow is allocated from the capture's memory pool and
  kept alive like any other, with a warning (size the buffers before capturing: the adapters
  do); a set with a zeroed part raises ValueError instead, because its zero fill would be
  recorded into the graph, not run.
* Two streams: every call on a device shares that device's set. Kernels that write a set must
  not run concurrently on two streams of one device (none of this package's adapters does).
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["DeviceBuffers", "indexed"]

log = logging.getLogger("flydsl_backends")


def indexed(device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the current GPU (the kernels' tensors carry an index, and
    ``cuda`` != ``cuda:0`` as a key)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeviceBuffers:
    """A named set of parts ``(dtype, zeroed)``, one set per device. See the module docstring."""

    def __init__(self, name: str, parts: Sequence[Tuple[torch.dtype, bool]]):
        if not parts:
            raise ValueError("parts: expected at least one (dtype, zeroed) pair")
        self.name = name
        self.parts = tuple(parts)
        self.buffers: Dict[torch.device, Tuple[torch.Tensor, ...]] = {}
        self.retired: List[Tuple[torch.Tensor, ...]] = []  # outgrown sets: captured graphs may still use them
        self._lock = threading.Lock()

    def get(self, device, sizes: Sequence[int], minimum: Sequence[int] = ()) -> Tuple[torch.Tensor, ...]:
        """The device's set, grown when any part is smaller than ``sizes`` (elements per part)."""
        device = indexed(device)
        if len(sizes) != len(self.parts):
            raise ValueError(f"{self.name}: expected {len(self.parts)} sizes, got {len(sizes)}")
        with self._lock:
            cur = self.buffers.get(device)
            if cur is not None and all(t.numel() >= n for t, n in zip(cur, sizes)):
                return cur
            if _capturing(device):
                if any(zeroed for _, zeroed in self.parts):
                    raise ValueError(f"{self.name}: the buffers must grow during CUDA-graph capture, and their zero "
                                     "fill would only run on replay; run one eager step (or reserve) before capturing")
                log.warning("%s: buffers grew during CUDA-graph capture (from the graph's memory pool); size them "
                            "before capturing", self.name)
            lows = list(minimum) + [0] * (len(sizes) - len(minimum))
            new = []
            for i, ((dtype, zeroed), n, low) in enumerate(zip(self.parts, sizes, lows)):
                size = max(int(n), int(low), 2 * cur[i].numel() if cur is not None else 0, 1)
                with torch.inference_mode(False):  # writable inside and outside inference mode
                    make = torch.zeros if zeroed else torch.empty
                    new.append(make(size, dtype=dtype, device=device))
            if cur is not None:
                self.retired.append(cur)
            self.buffers[device] = cur = tuple(new)
            return cur

    def nbytes(self, device) -> int:
        cur = self.buffers.get(indexed(device))
        return 0 if cur is None else sum(t.numel() * t.element_size() for t in cur)
