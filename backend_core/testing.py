"""Test helpers shared by the op families (imported by tests only)."""

from __future__ import annotations

import torch

__all__ = ["CORRUPTIONS", "corrupt"]

CORRUPTIONS = ("dtype", "drop_dim", "add_dim", "grow", "shrink", "transpose", "none", "list", "scalar")


def corrupt(kw: dict, name: str, kind: str, dtype: torch.dtype, dim: int) -> None:
    """Replace ``kw[name]`` by a malformed variant (property-based validation tests).

    ``dtype``: the target of a "dtype" corruption (between 1-byte dtypes it is a reinterpreting
    ``view``); ``dim``: which dimension the shape corruptions touch (modulo the rank).
    """
    t = kw.get(name)
    if kind == "none":
        kw[name] = None
        return
    if kind == "list":
        kw[name] = [1, 2, 3]
        return
    if kind == "scalar":
        kw[name] = 3.0
        return
    if t is None:
        t = torch.zeros(3)
    d = dim % max(t.dim(), 1)
    if kind == "dtype":
        if t.dtype.itemsize == 1 or dtype.itemsize == 1:
            kw[name] = t.view(dtype) if t.dim() and t.dtype.itemsize == dtype.itemsize else t
        else:
            kw[name] = t.to(dtype)
    elif kind == "drop_dim" and t.dim():
        kw[name] = t.select(d, 0)
    elif kind == "add_dim":
        kw[name] = t.unsqueeze(d)
    elif kind == "grow" and t.dim():
        kw[name] = torch.cat([t, t.narrow(d, 0, 1)], d)
    elif kind == "shrink" and t.dim() and t.shape[d] > 1:
        kw[name] = t.narrow(d, 0, t.shape[d] - 1)
    elif kind == "transpose" and t.dim() >= 2:
        kw[name] = t.transpose(d % (t.dim() - 1), -1)
