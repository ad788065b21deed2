"""Argument checks shared by the op families.

Every failure raises ``TypeError`` (not a tensor, not a number) or ``ValueError`` (wrong shape,
dtype, device, layout) whose message starts with the argument's name and says what was expected
and what was given. Nothing here touches tensor data on the device (no host sync).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

INT32_MAX = 2**31 - 1

__all__ = [
    "INT32_MAX",
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
    return t


def checked_tensor(t, name: str, device: torch.device, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """``t`` must be a tensor on ``device`` with one of ``dtypes``; returns it."""
    require_tensor(t, name)
    require_same_device(t, name, device)
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


def require_same_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got one on {t.device}")


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


def require_float(v, name: str, *, finite: bool = True, positive: bool = False, optional: bool = False) -> Optional[float]:
    if v is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a float, got None")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a Python float, got {type(v).__name__}")
    f = float(v)
    if finite and not math.isfinite(f):
        raise ValueError(f"{name}: expected a finite number, got {f}")
    if positive and not f > 0:
        raise ValueError(f"{name}: expected a positive number, got {f}")
    return f


def shape_str(shape: Tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"
