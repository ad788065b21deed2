"""Launching Triton kernels with less host time per call.

``kernel[grid](*args, **kwargs)`` does, at every call, work that a server repeats with the same kinds of
arguments layer after layer: it binds each argument by name, asks Triton's C helper for each one's
specialization (dtype, 16-byte alignment, an integer's value class), builds and hashes a cache key from
them and the options, looks the compiled kernel up, and its driver launcher then asks the CUDA/HIP driver
about every tensor's address (``cuPointerGetAttribute``). For the paged decode's ~60 arguments that is tens
of microseconds of host time per launch (benchmarks/NOTES.md: ``plan.run`` 87 us on the H200 host against
9 us with null kernels).

``launch(kernel, grid, *args, **kwargs)`` takes the same arguments. The first call of each kind goes through
Triton (which compiles, or finds its compiled kernel); the ``CompiledKernel`` it returns is kept under a key
that holds everything Triton specializes on, and later calls with an equal key launch it through the
driver launcher directly, with the tensors passed as their addresses. The key is conservative: the
current device, the options (``num_warps``, ...), and per argument a tensor's dtype and whether its address
is 16-byte aligned, any other argument's type and exact value (Triton only tells integers apart by
``== 1``, ``% 16 == 0`` and their range; a new value only costs one call through Triton). So a hit launches
exactly the binary Triton would have picked.

Not taken (the call goes through Triton, as before): Triton's interpreter, a launch hook set
(``triton.knobs.runtime.launch_enter_hook``: profilers), an argument missing, more than ``MAX_KINDS`` keys
for one kernel (the oldest is dropped), and ``FLYDSL_BACKENDS_TRITON_DIRECT=0`` (read at import; the
``enabled`` attribute switches it at run time, for A/B timings). Skipped on a hit: the driver's check that
each address is device memory (this package's argument checks have placed every tensor on the call's GPU
already) and Triton's check that a kernel's global constants are unchanged since it was compiled (this
package's kernels read none that change).
"""

from __future__ import annotations

import operator
import os
from collections import OrderedDict

import torch

__all__ = ["launch", "enabled", "MAX_KINDS", "kinds"]

enabled = os.environ.get("FLYDSL_BACKENDS_TRITON_DIRECT", "1").strip() != "0"
MAX_KINDS = 64  # compiled-kernel keys kept per kernel

_Tensor = torch.Tensor
_SCALARS = frozenset((int, bool, float, str, type(None), torch.dtype))
_dtype_of = operator.attrgetter("dtype")


class _Site:
    """One @triton.jit kernel: its parameter order and defaults, and its compiled kernels by key."""

    __slots__ = ("names", "name_set", "defaults", "kernels", "layouts")

    def __init__(self, fn):
        import inspect

        self.names = tuple(p.name for p in fn.params)
        self.name_set = frozenset(self.names)
        self.defaults = {p.name: p.default for p in fn.params if p.default is not inspect.Parameter.empty}
        self.kernels: "OrderedDict[tuple, object]" = OrderedDict()
        self.layouts: dict = {}  # positional argument types -> (tensors getter, others getter, tensor positions)


def _picker(idx):
    """A getter of the items at ``idx`` as a tuple (operator.itemgetter returns a bare item for one index)."""
    if not idx:
        return lambda args: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*idx)


def _layout(ptypes):
    where = tuple(i for i, t in enumerate(ptypes) if issubclass(t, _Tensor))
    others = tuple(i for i, t in enumerate(ptypes) if not issubclass(t, _Tensor))
    if not all(ptypes[i] in _SCALARS for i in others):
        return None
    return _picker(where), _picker(others), where


_SITES: dict = {}
_RUNTIME = None  # (current device, current raw stream, knobs.runtime), set at the first direct launch


def _runtime():
    global _RUNTIME
    if _RUNTIME is None:
        from triton import knobs
        from triton.runtime.driver import driver

        d = driver.active
        _RUNTIME = (d.get_current_device, d.get_current_stream, knobs.runtime)
    return _RUNTIME


def kinds(fn) -> int:
    """How many compiled-kernel keys ``launch`` holds for ``fn`` (tests)."""
    site = _SITES.get(fn)
    return len(site.kernels) if site is not None else 0


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``, with the kernel Triton compiled for these kinds of arguments launched
    directly when an earlier call of the same kinds found it. Tensors must be positional arguments (a
    tensor, or any object other than a number, string, None or torch dtype, among the keyword arguments
    sends the call through Triton). Returns the ``CompiledKernel`` (as Triton's launch does; None under the
    interpreter)."""
    if not enabled or fn.__class__.__name__ != "JITFunction" or callable(grid):  # the interpreter's: as they are
        return fn[grid](*args, **kwargs)
    site = _SITES.get(fn)
    if site is None:
        site = _SITES[fn] = _Site(fn)
    current_device, current_stream, rt = _runtime()
    if rt.launch_enter_hook is not None or rt.launch_exit_hook is not None:
        return fn[grid](*args, **kwargs)
    names = site.names
    n = len(args)
    if n > len(names) or len(site.layouts) > MAX_KINDS:  # Triton says what is wrong
        return fn[grid](*args, **kwargs)
    # keyword arguments (constexprs, options): by name and value, and their types (True is not 1)
    types = tuple(map(type, kwargs.values()))
    if not _SCALARS.issuperset(types):
        return fn[grid](*args, **kwargs)
    try:
        tail = [kwargs[name] for name in names[n:]]
    except KeyError:
        defaults = site.defaults
        if not all(name in kwargs or name in defaults for name in names[n:]):  # Triton says what is missing
            return fn[grid](*args, **kwargs)
        tail = [kwargs[name] if name in kwargs else defaults[name] for name in names[n:]]
        types = (types, tuple(map(type, tail)), tuple(tail))
    # positional arguments: a tensor by dtype and 16-byte alignment (launched by its address), anything
    # else by type and value. Where the tensors sit among them is kept per sequence of argument types
    ptypes = tuple(map(type, args))
    layout = site.layouts.get(ptypes)
    if layout is None:
        layout = _layout(ptypes)
        if layout is None:  # an argument that is neither a tensor nor a plain value: Triton says what it is
            return fn[grid](*args, **kwargs)
        site.layouts[ptypes] = layout
    tensors_of, scalars_of, where = layout
    tensors = tensors_of(args)
    ptrs = [t.data_ptr() for t in tensors]
    full = list(args)
    for i, ptr in zip(where, ptrs):
        full[i] = ptr
    key = (tuple(map(_dtype_of, tensors)), tuple([ptr & 15 for ptr in ptrs]), scalars_of(args))
    dev = current_device()
    key = (dev, tuple(kwargs.items()), types, ptypes, key)
    try:
        k = site.kernels.get(key)
    except TypeError:  # an unhashable value: Triton's own path says what it makes of it
        return fn[grid](*args, **kwargs)
    if k is None:
        k = fn[grid](*args, **kwargs)
        if k is not None and not hasattr(k, "result"):
            site.kernels[key] = k
            if len(site.kernels) > MAX_KINDS:
                site.kernels.popitem(last=False)
        return k
    g = len(grid)
    k.run(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1, current_stream(dev), k.function,
          k.packed_metadata, None, None, None, *full, *tail)
    return k
