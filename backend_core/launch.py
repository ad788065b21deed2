"""Launching Triton kernels with less host time per call.

``kernel[grid](*args, **kwargs)`` does, at every call, work that a server repeats with the same kinds of
arguments layer after layer: it binds each argument by name, asks Triton's C helper for each one's
specialization (dtype, 16-byte alignment, an integer's value class), builds and hashes a cache key from
them and the options, looks the compiled kernel up, and its driver launcher then asks the CUDA/HIP driver
about every tensor's address (``cuPointerGetAttribute``). For the paged decode's ~60 arguments that is tens
of microseconds of host time per launch, several times the cost of the launch itself (figures in
docs/performance.md).

``launch(kernel, grid, *args, **kwargs)`` takes the same arguments. ``bind(kernel, grid, vary, *args,
**kwargs)`` launches as ``launch`` does and returns ``(kernel, Bound or None)``, a ``Bound`` being the same
launch with only the tensors at the positions ``vary`` changed (a plan's later layers, which differ only in
their query, caches and output): it copies the kept argument list and puts the new addresses in, with no
key built. The first call of each kind goes through
Triton (which compiles, or finds its compiled kernel); the ``CompiledKernel`` it returns is kept under a key
that holds everything Triton specializes on, and later calls with an equal key launch it through the
driver launcher directly, with the tensors passed as their addresses. The key is conservative: the
current device; the options (``num_warps``, ...) and the ones Triton adds at every call (the kernel's and
``TRITON_DEBUG``'s debug flag, the instrumentation mode); per tensor its dtype, its address modulo 16, its
device and, on AMD, the backend's own class of it (Triton marks storages within 2 GiB there, for 32-bit
buffer offsets); every other argument's type and exact value, except the integers a kernel declares
``do_not_specialize`` (a batch's sizes), keyed by their type (i32 / i64 / u64) as Triton does. So a hit
launches exactly the binary Triton would have picked (``backend_core/tests/test_launch.py`` checks the key
against Triton's own cache key, for NVIDIA's and AMD's specialization).

Not taken (the call goes through Triton, as before): Triton's interpreter; torch.compile's tracing (Dynamo
traces ``kernel[grid]``, not a launch by address); a launch hook installed
(``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` not empty: profilers) or a kernel's
``pre_run_hooks``; a global constant a kernel read changed since it was compiled (Triton raises); an argument
missing, a tensor among the keyword arguments, or an argument of another kind; and, by default, with ROCm. It
is on by default with CUDA (checked on NVIDIA GPUs: the same bytes as Triton's launch at about half the host
time per layer) and opt-in with ROCm, where it has not run
(``FLYDSL_BACKENDS_TRITON_DIRECT=1`` / ``0`` turns it on / off on either, read at import; the ``enabled``
attribute switches it at run time, for A/B timings). At most ``MAX_KINDS``
keys per kernel are kept (the least recently used is dropped). Skipped on a hit: the driver's check that
each address is device memory (this package's argument checks have placed every tensor on the call's GPU,
and a CPU tensor has its own key, whose first call Triton refuses).
"""

from __future__ import annotations

import operator
import os
from collections import OrderedDict

import torch

from . import platform

__all__ = ["launch", "bind", "Bound", "enabled", "MAX_KINDS", "kinds"]

# on with CUDA (run on NVIDIA GPUs), opt-in with ROCm (not run on AMD): FLYDSL_BACKENDS_TRITON_DIRECT=0 / 1 decides
_RAW = os.environ.get("FLYDSL_BACKENDS_TRITON_DIRECT", "").strip()
if _RAW not in ("", "0", "1"):
    raise ValueError(f"FLYDSL_BACKENDS_TRITON_DIRECT={_RAW!r}: expected 0 or 1")
enabled = _RAW == "1" if _RAW else not platform.is_hip()
MAX_KINDS = 64  # compiled-kernel keys kept per kernel

_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling
_SCALARS = frozenset((int, bool, float, str, type(None), torch.dtype))
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.methodcaller("get_device")  # -1: CPU (Triton's launcher refuses a host address)


def _int_class(v: int):
    """What Triton tells apart of an integer argument it does not specialize (``do_not_specialize``): its
    type. Out of range (Triton raises): the value itself, never equal to an in-range one's class."""
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return 0  # i32
    if -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        return 1  # i64
    if 0 <= v <= 0xFFFFFFFFFFFFFFFF:
        return 2  # u64
    return ("out of range", v)


class _Site:
    """One @triton.jit kernel: its parameter order and defaults, and its compiled kernels by key."""

    __slots__ = ("names", "name_set", "defaults", "loose", "kernels", "layouts")

    def __init__(self, fn):
        import inspect

        self.names = tuple(p.name for p in fn.params)
        self.name_set = frozenset(self.names)
        self.defaults = {p.name: p.default for p in fn.params if p.default is not inspect.Parameter.empty}
        # integer parameters Triton does not specialize on their value (a batch's sizes): keyed by type only,
        # so a new batch size reuses the compiled kernel
        self.loose = frozenset(i for i, p in enumerate(fn.params) if getattr(p, "do_not_specialize", False))
        self.kernels: "OrderedDict[tuple, object]" = OrderedDict()
        # positional argument types -> (tensors getter, exact-value getter, integer-class getter, tensor positions)
        self.layouts: dict = {}


def _picker(idx):
    """A getter of the items at ``idx`` as a tuple (operator.itemgetter returns a bare item for one index)."""
    if not idx:
        return lambda args: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*idx)


def _layout(ptypes, loose):
    where = tuple(i for i, t in enumerate(ptypes) if issubclass(t, _Tensor))
    others = [i for i, t in enumerate(ptypes) if not issubclass(t, _Tensor)]
    if not all(ptypes[i] in _SCALARS for i in others):
        return None
    classed = tuple(i for i in others if i in loose and ptypes[i] is int)
    exact = tuple(i for i in others if i not in classed)
    return _picker(where), _picker(exact), _picker(classed), where


_SITES: dict = {}
_RUNTIME = None  # (current device, current raw stream, knobs.runtime, knobs.compilation, tensor spec), set once
_MISSING = object()


def _hooked(h):
    """Triton 3.6's launch hooks are HookChain objects (knobs.py:468), never None: hooked when not empty."""
    return h is not None and bool(getattr(h, "calls", True))


def _passes_through_triton(fn, rt) -> bool:
    """A launch hook installed (profilers) or a kernel's pre-run hook: Triton's own launch runs them."""
    return _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook) or bool(fn.pre_run_hooks)


def _debug_state(fn, rt, comp) -> tuple:
    """The options JITFunction.run adds to every call (jit.py:696-697): another value compiles another kernel."""
    return fn.debug, rt.debug, comp.instrumentation_mode


def _globals_changed(fn) -> bool:
    """A global constant the kernel read changed since it was compiled (jit.py:724-729: Triton raises)."""
    return any(globals_dict.get(name, _MISSING) != val
               for (name, _), (val, globals_dict) in fn.used_global_vals.items())


def _runtime():
    global _RUNTIME
    if _RUNTIME is None:
        from triton import knobs
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        d = driver.active
        be = make_backend(d.get_current_target())
        # NVIDIA: dtype and address % 16 (specialize.cc handle_tensor); AMD: the backend's own rule, which
        # adds 'S' for a storage within 2 GiB (amd/compiler.py get_tensor_specialization)
        tspec = None if getattr(be, "supports_native_tensor_specialization", True) else be.get_tensor_specialization
        _RUNTIME = (d.get_current_device, d.get_current_stream, knobs.runtime, knobs.compilation, tspec)
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
    return _launch(fn, grid, args, kwargs, None)[0]


def bind(fn, grid, vary, *args, **kwargs):
    """``launch(fn, grid, *args, **kwargs)``, and a :class:`Bound` for later launches of the same kernel
    whose arguments differ only in the tensors at the positions ``vary``, or None (the direct launch not
    taken). Returns ``(compiled kernel, bound)``."""
    return _launch(fn, grid, args, kwargs, tuple(vary))


class Bound:
    """A launch with every argument fixed but the tensors at some positions (a layer's query, caches and
    output, where the layers of one batch share every shape, stride, scalar and batch buffer). Calling it
    with those tensors launches the compiled kernel directly, the argument list copied and the new
    addresses put in: no key is built. The caller guarantees what the key would have checked but the
    addresses: the same dtypes, shapes, strides and devices as at ``bind`` (a plan keys its bound launches
    on the layer's signature). Checked per call, and False returned without launching when one fails (the
    caller then launches in full): the switch still on and no tracing, no launch hook installed, the same
    current device, the same debug flags (the kernel's, ``TRITON_DEBUG``'s) and instrumentation mode, the
    kernel's global constants unchanged, each tensor's address modulo 16 (and on AMD its buffer class) as
    bound."""

    __slots__ = ("k", "fn", "grid", "full", "vary", "align", "dev", "tspec", "classes", "debug")

    def __init__(self, k, fn, grid, full, vary, tensors, dev, tspec, debug):
        self.k, self.fn, self.dev, self.tspec, self.debug = k, fn, dev, tspec, debug
        g = len(grid)
        self.grid = (grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1)
        self.full = full
        self.vary = vary
        self.align = tuple(t.data_ptr() & 15 for t in tensors)
        self.classes = tuple(tspec(t, align=True) for t in tensors) if tspec is not None else None

    def __call__(self, *tensors) -> bool:
        if not enabled or _compiling():
            return False
        current_device, current_stream, rt, comp, tspec = _runtime()
        fn = self.fn
        if _passes_through_triton(fn, rt):
            return False
        if _debug_state(fn, rt, comp) != self.debug:  # another compiled kernel
            return False
        dev = self.dev
        if current_device() != dev or _globals_changed(fn):
            return False
        ptrs = [t.data_ptr() for t in tensors]
        if tuple([ptr & 15 for ptr in ptrs]) != self.align:
            return False
        if self.classes is not None and tuple([tspec(t, align=True) for t in tensors]) != self.classes:
            return False
        full = self.full.copy()
        for i, ptr in zip(self.vary, ptrs):
            full[i] = ptr
        k = self.k
        gx, gy, gz = self.grid
        k.run(gx, gy, gz, current_stream(dev), k.function, k.packed_metadata, None, None, None, *full)
        return True


def _launch(fn, grid, args, kwargs, vary):
    """launch(); with ``vary`` a tuple of positions, also a Bound (or None) after the kernel."""
    if not enabled or fn.__class__.__name__ != "JITFunction" or callable(grid) or _compiling():
        # the interpreter's functions; and under torch.compile tracing Triton's own launch, which Dynamo traces
        return fn[grid](*args, **kwargs), None
    site = _SITES.get(fn)
    if site is None:
        site = _SITES[fn] = _Site(fn)
    current_device, current_stream, rt, comp, tspec = _runtime()
    if _passes_through_triton(fn, rt):
        return fn[grid](*args, **kwargs), None
    names = site.names
    n = len(args)
    if n > len(names) or len(site.layouts) > MAX_KINDS:  # Triton says what is wrong
        return fn[grid](*args, **kwargs), None
    # keyword arguments (constexprs, options): by name and value, and their types (True is not 1)
    types = tuple(map(type, kwargs.values()))
    if not _SCALARS.issuperset(types):
        return fn[grid](*args, **kwargs), None
    try:
        tail = [kwargs[name] for name in names[n:]]
    except KeyError:
        defaults = site.defaults
        if not all(name in kwargs or name in defaults for name in names[n:]):  # Triton says what is missing
            return fn[grid](*args, **kwargs), None
        tail = [kwargs[name] if name in kwargs else defaults[name] for name in names[n:]]  # the site's own: no key
    # positional arguments: a tensor by dtype and 16-byte alignment (launched by its address), anything
    # else by type and value. Where the tensors sit among them is kept per sequence of argument types
    ptypes = tuple(map(type, args))
    layout = site.layouts.get(ptypes)
    if layout is None:
        layout = _layout(ptypes, site.loose)
        if layout is None:  # an argument that is neither a tensor nor a plain value: Triton says what it is
            return fn[grid](*args, **kwargs), None
        site.layouts[ptypes] = layout
    tensors_of, exact_of, classed_of, where = layout
    tensors = tensors_of(args)
    ptrs = [t.data_ptr() for t in tensors]
    full = list(args)
    for i, ptr in zip(where, ptrs):
        full[i] = ptr
    key = (tuple(map(_dtype_of, tensors)), tuple([ptr & 15 for ptr in ptrs]), tuple(map(_device_of, tensors)),
           exact_of(args), tuple(map(_int_class, classed_of(args))))
    if tspec is not None:
        key += (tuple([tspec(t, align=True) for t in tensors]),)
    dev = current_device()
    debug = _debug_state(fn, rt, comp)
    key = (dev, tuple(kwargs.items()), types, ptypes, key, debug)
    try:
        k = site.kernels.get(key)
    except TypeError:  # an unhashable value: Triton's own path says what it makes of it
        return fn[grid](*args, **kwargs), None
    if k is None:
        k = fn[grid](*args, **kwargs)
        if k is not None and not hasattr(k, "result"):
            site.kernels[key] = k
            if len(site.kernels) > MAX_KINDS:
                site.kernels.popitem(last=False)
            return k, _bound(k, fn, grid, full, tail, vary, args, dev, tspec, debug)
        return k, None
    if _globals_changed(fn):
        return fn[grid](*args, **kwargs), None  # Triton raises its error
    try:
        site.kernels.move_to_end(key)  # the least recently used kind is the first dropped
    except KeyError:  # dropped meanwhile by another thread: this launch is still right
        pass
    g = len(grid)
    k.run(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1, current_stream(dev), k.function,
          k.packed_metadata, None, None, None, *full, *tail)
    return k, _bound(k, fn, grid, full, tail, vary, args, dev, tspec, debug)


def _bound(k, fn, grid, full, tail, vary, args, dev, tspec, debug):
    if vary is None:
        return None
    tensors = [args[i] for i in vary]
    if not all(isinstance(t, _Tensor) for t in tensors):
        return None  # only tensors' addresses may vary
    return Bound(k, fn, grid, full + tail, vary, tensors, dev, tspec, debug)
