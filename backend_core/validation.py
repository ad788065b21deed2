"""Argument checks shared by the op families.

Every failure raises ``TypeError`` (not a tensor, not a number) or ``ValueError`` (wrong shape,
dtype, device, layout) whose message starts with the argument's name and says what was expected
and what was given. Nothing here touches tensor data on the device (no host sync).
"""

from __future__ import annotations

import functools
import math
import os
from collections import OrderedDict
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

INT32_MAX = 2**31 - 1

__all__ = [
    "INT32_MAX",
    "signature_of",
    "require_tensor",
    "checked_tensor",
    "require_dtype",
    "require_shape",
    "require_same_device",
    "require_unit_stride",
    "require_non_overlapping",
    "span_elements",
    "require_int32_span",
    "require_float",
    "require_disjoint",
    "require_disjoint_from",
    "addresses",
    "require_data",
    "may_overlap",
]


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def require_tensor(t, name: str, *, optional: bool = False) -> Optional[torch.Tensor]:
    if t is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a torch.Tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    return t


def require_data(t: torch.Tensor, name: str) -> None:
    """Tensors on the ``meta`` device carry no data: no implementation can read or write them.
    Contracts call it last on the argument that fixes the device (every other tensor is on the
    same one), so shape and stride checks still run on meta tensors."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")


def checked_tensor(t, name: str, device: torch.device, dtypes: Sequence[torch.dtype], *,
                   anchor: Optional[str] = None) -> torch.Tensor:
    """``t`` must be a tensor with data on ``device`` (the device of argument ``anchor``) with one
    of ``dtypes``; returns it."""
    require_tensor(t, name)
    require_same_device(t, name, device, anchor)
    require_dtype(t, name, dtypes)
    return t


def require_dtype(t: torch.Tensor, name: str, dtypes: Sequence[torch.dtype]) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")


def require_shape(t: torch.Tensor, name: str, shape: Sequence[Union[int, None]], what: str = "") -> None:
    """``shape`` entries may be None (any size). ``what`` spells the symbolic shape, e.g. '[B, 3*H*K]'."""
    ok = t.dim() == len(shape) and all(e is None or int(s) == e for s, e in zip(t.shape, shape))
    if not ok:
        want = what or "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        concrete = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        extra = f" = {concrete}" if what and what != concrete else ""
        raise ValueError(f"{name}: expected shape {want}{extra}, got {list(t.shape)}")


def require_same_device(t: torch.Tensor, name: str, device: torch.device, anchor: Optional[str] = None) -> None:
    if t.device != device:
        of = f" (the device of {anchor})" if anchor else ""
        raise ValueError(f"{name}: expected a tensor on {device}{of}, got one on {t.device}")


def require_unit_stride(t: torch.Tensor, name: str, dim: int = -1) -> None:
    if t.size(dim) > 1 and t.stride(dim) != 1:
        raise ValueError(
            f"{name}: expected unit stride along dim {dim} (size {t.size(dim)}), got strides {tuple(t.stride())}"
        )


def span_elements(t: torch.Tensor) -> int:
    """Number of elements between the first and the last addressed element, inclusive."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def require_int32_span(t: torch.Tensor, name: str, what: str = "the tensor") -> None:
    """Kernels address within ``t`` with 32-bit offsets: its span must fit in int32."""
    n = span_elements(t)
    if n > INT32_MAX:
        raise ValueError(f"{name}: {what} spans {n} elements, past the int32 index space of the kernel's offsets")


def require_non_overlapping(t: torch.Tensor, name: str, dims: Optional[Sequence[int]] = None) -> None:
    """Raise when two index tuples (over ``dims``, default all) address the same element.

    Sufficient test: sorted by stride, each stride must exceed the span of all smaller ones.
    """
    dims = range(t.dim()) if dims is None else dims
    pairs = sorted((abs(t.stride(d)), t.size(d), d) for d in dims if t.size(d) > 1)
    span = 0  # span (in elements, minus one) of the dims seen so far
    for stride, size, d in pairs:
        if stride <= span:
            raise ValueError(
                f"{name}: elements overlap in memory (dim {d} has stride {stride} but the smaller dims span "
                f"{span + 1} elements; shape {list(t.shape)}, strides {tuple(t.stride())})"
            )
        span += stride * (size - 1)


def require_float(v, name: str, *, finite: bool = True, positive: bool = False,
                  optional: bool = False) -> Optional[float]:
    if v is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a float, got None")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a Python float, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:  # an int past the float range
        raise ValueError(f"{name}: expected a finite number, got an integer of {v.bit_length()} bits") from None
    if finite and not math.isfinite(f):
        raise ValueError(f"{name}: expected a finite number, got {f}")
    if positive and not f > 0:
        raise ValueError(f"{name}: expected a positive number, got {f}")
    return f


@functools.lru_cache(maxsize=4096)
def _layout(shape, stride, es: int):
    """(first byte, one past the last byte) relative to the data pointer, and [(byte stride, size)]
    of the dims with size > 1, for a strided view (memoized: layer calls repeat a few layouts)."""
    lo = hi = 0
    dims = []
    for size, st in zip(shape, stride):
        if size > 1:
            span = (size - 1) * st * es
            if span < 0:
                lo += span
            else:
                hi += span
            dims.append((abs(st) * es, int(size)))
    return lo, hi + es, tuple(dims)


def _addresses(t: torch.Tensor):
    """(first byte, one past the last byte, ((byte stride, size), ...) of the dims with size > 1)."""
    lo, hi, dims = _layout(t.shape, t.stride(), t.element_size())
    base = t.data_ptr()
    return base + lo, base + hi, dims


def _residues(lo: int, hi: int, dims, period: int):
    """Byte addresses of a strided view taken modulo ``period``, as one interval (start, length),
    or None when they may cover the whole period. Dims whose stride is a multiple of the period add
    nothing; the others stay inside their span above ``lo``."""
    inner = hi - lo - sum((st * (n - 1)) for st, n in dims if st % period == 0)
    if inner >= period:
        return None
    return lo % period, inner


def _disjoint(a, b) -> bool:
    """``a``, ``b``: ``_addresses`` of two non-empty tensors."""
    alo, ahi, adims = a
    blo, bhi, bdims = b
    if ahi <= blo or bhi <= alo:
        return True
    for period in sorted({st for st, _ in adims + bdims if st > 0}, reverse=True):  # noqa: C414
        ra, rb = _residues(alo, ahi, adims, period), _residues(blo, bhi, bdims, period)
        if ra is None or rb is None:
            continue
        # circular intervals [s, s + n) modulo period: disjoint when neither start lies in the other
        (sa, na), (sb, nb) = ra, rb
        if (sb - sa) % period >= na and (sa - sb) % period >= nb:
            return True
    return False


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share a byte of memory. Reads no data (no host sync).

    Exact for disjoint extents; for views whose extents interleave (vLLM puts a block's K and V
    pages, or a slot's conv and recurrent state, side by side in one page) it proves disjointness
    from a common period: if both views' addresses modulo a stride of either fall into
    non-intersecting intervals, they cannot meet. Anything it cannot prove disjoint counts as
    overlapping.
    """
    both = addresses([("a", a), ("b", b)])
    return len(both) == 2 and not _disjoint(both[0][1], both[1][1])  # empty / meta tensors hold no memory


def addresses(named: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> list:
    """[(name, address summary)] of the non-empty, non-meta tensors among ``named``: computed once
    for arguments that do not change between calls (a plan's batch tensors, a layer's caches) and
    given to ``require_disjoint_from``."""
    return [(n, _addresses(t)) for n, t in named
            if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta"]


def _check_disjoint(name: str, a, others) -> None:
    for on, oa in others:
        if not _disjoint(a, oa):
            raise ValueError(f"{name}: shares memory with {on}; {name} is written by the call, so it must not "
                             f"overlap any other argument (pass separate buffers)")


def require_disjoint_from(name: str, t: Optional[torch.Tensor], others: Sequence[Tuple[str, tuple]]) -> None:
    """``t`` (written by the call) shares no memory with any of ``others`` (from ``addresses``)."""
    for _, a in addresses([(name, t)]):
        _check_disjoint(name, a, others)


def require_disjoint(written: Sequence[Tuple[str, Optional[torch.Tensor]]],
                     others: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> None:
    """Every tensor in ``written`` (outputs and in-place arguments) must share no memory with any
    other argument, written or read: a kernel writing one would corrupt the other (or read what it
    just wrote). ``None`` and empty tensors are skipped. Raises ValueError naming both arguments."""
    w = addresses(written)
    items = w + addresses(others)
    for i, (wn, wa) in enumerate(w):
        _check_disjoint(wn, wa, items[i + 1:])


def env_positive_int(name: str, default: int, *, power_of_two: bool = False) -> int:
    """A tuning variable ``name``: a positive integer (a power of two with ``power_of_two``); ``default`` when
    unset. ValueError naming the variable and its value otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if v < 1 or (power_of_two and v & (v - 1)):
        raise ValueError(f"{name}={raw!r}: expected {'a power of two >= 1' if power_of_two else 'a positive integer'}")
    return v


def signature_of(*tensors) -> tuple:
    """A hashable key of tensors' shapes, dtypes, strides, devices and addresses modulo 16 (None stays
    None): what a memo of per-call-shape decisions (coverage, a chosen implementation) is keyed on. The
    alignment is in it because implementations differ there (FlyDSL's kernels take 16-byte aligned
    tensors only): a misaligned call must not reuse an aligned one's choice. A tensor that is not dense
    is keyed by its layout (its call is checked, and refused, in full)."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype, tuple(t.stride()), t.device, t.data_ptr() & 15)
                 if t.layout == torch.strided else (t.layout,) for t in tensors)


def arg_key(x):
    """What argument checks read of one argument: a tensor's address, shape, strides, dtype and device;
    anything else with its type (True is not 1)."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:  # no data pointer or strides: unhashable, so never memoized (the checks say why)
            return [x.layout]
        return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
    return (type(x), x)


class CheckMemo:
    """A bounded LRU memo of argument checks. A server calls an op with the same buffers, shapes and
    strides step after step, so each distinct argument set is checked in full once and later calls only
    rebuild the problem around the caller's tensors. Keys (tuples of ``arg_key`` parts) must hold
    everything the checks read; a key that cannot be hashed (an unhashable argument) is never stored,
    so the full checks run and reject it; a call that fails its checks is never stored; only derived
    numbers are kept, never tensors (a server that frees its buffers gets the memory back). Meta
    tensors share addresses (0): never stored."""

    def __init__(self, size: int = 4096):
        self._items: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.size = size

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple):
        """The stored facts of ``key`` (None: not checked yet, or not memoizable)."""
        try:
            hit = self._items.get(key)
        except TypeError:  # an unhashable argument
            return None
        if hit is not None:
            try:
                self._items.move_to_end(key)
            except KeyError:  # evicted meanwhile by another thread: the facts are still right
                pass
        return hit

    def clear(self) -> None:
        self._items.clear()

    def put(self, key: tuple, device: torch.device, facts) -> bool:
        """Store ``facts`` under ``key``; False when not stored (a meta device, an unhashable key)."""
        if device.type == "meta":
            return False
        try:
            self._items[key] = facts
        except TypeError:  # an unhashable argument (its call was checked in full)
            return False
        while len(self._items) > self.size:
            try:
                self._items.popitem(last=False)
            except KeyError:
                break
        return True
