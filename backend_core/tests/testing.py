"""Test helpers shared by the op families (imported by tests only)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["CORRUPTIONS", "corrupt", "relaid", "fake_gpus", "amd_props", "nvidia_props", "clear_device_memos",
           "bound_launches", "kept_args_binder"]

CORRUPTIONS = ("dtype", "drop_dim", "add_dim", "grow", "shrink", "transpose", "none", "list", "scalar", "strided",
               "alias")


def strided_copy(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The same values as ``t`` in a view whose strides are doubled along ``dim`` and every dim
    before it (the elements in between are copies)."""
    return torch.stack([t, t], dim + 1).select(dim + 1, 0)


def relaid(t: torch.Tensor, rng, sentinel, *, any_order: bool = False, slot_only: bool = False):
    """(view, allocation): ``t``'s values in a fresh allocation laid out as a layout fuzz draws it (``rng``: a
    ``random.Random``). The dimensions are stored in a random order with 0-3 elements of padding after each
    but the outermost; the innermost dimension stays innermost with unit stride unless ``any_order``.
    ``slot_only``: the order kept, padding (1-5) after the first dimension only (a page stride). 1-D: a
    stride of 1-3. The padding holds ``sentinel`` (for 1-byte float tensors: a byte value)."""
    nd = t.dim()
    if nd == 0:
        return t.clone(), None
    fp8 = t.element_size() == 1 and t.is_floating_point()

    def filled(shape):
        if fp8:
            return torch.full(shape, sentinel, dtype=torch.uint8, device=t.device).view(t.dtype)
        return torch.full(shape, sentinel, dtype=t.dtype, device=t.device)

    if nd == 1:
        step = rng.randint(1, 3)
        alloc = filled((max(int(t.shape[0]) * step, 1),))
        view = alloc[::step][:int(t.shape[0])]
    else:
        if slot_only:
            order = list(range(nd))
            pads = [0, rng.randint(1, 5)] + [0] * (nd - 2)
        else:
            order = list(range(nd if any_order else nd - 1))
            rng.shuffle(order)
            if not any_order:
                order.append(nd - 1)
            pads = [0] + [rng.randint(0, 3) for _ in range(nd - 1)]
        alloc = filled([int(t.shape[d]) + pad for d, pad in zip(order, pads)])
        view = alloc[tuple(slice(0, int(t.shape[d])) for d in order)].permute([order.index(d) for d in range(nd)])
    view.copy_(t)
    return view, alloc


def alias_view(t: torch.Tensor, host: torch.Tensor):
    """A contiguous tensor shaped and typed like ``t`` laid over ``host``'s first bytes, or None
    when ``host``'s storage is too small."""
    nbytes = t.numel() * t.element_size()
    off = host.storage_offset() * host.element_size()
    if t.numel() == 0 or host.untyped_storage().nbytes() - off < nbytes or off % t.element_size():
        return None
    return torch.empty(0, dtype=t.dtype, device=host.device).set_(
        host.untyped_storage(), off // t.element_size(), t.shape, torch.empty(t.shape, device="meta").stride())


def corrupt(kw: dict, name: str, kind: str, dtype: torch.dtype, dim: int) -> None:
    """Replace ``kw[name]`` by a malformed variant (property-based validation tests).

    ``dtype``: the target of a "dtype" corruption (between 1-byte dtypes it is a reinterpreting
    ``view``); ``dim``: which dimension the shape corruptions touch (modulo the rank). "strided":
    the same values through a strided view; "alias": a view of the same shape and dtype over the
    memory of another tensor argument (picked by ``dim``), so outputs and caches overlap inputs.
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
    if kind == "alias":
        hosts = sorted(k for k, v in kw.items() if isinstance(v, torch.Tensor) and k != name)
        if hosts:
            view = alias_view(t, kw[hosts[dim % len(hosts)]])
            if view is not None:
                kw[name] = view
        return
    if kind == "strided":
        if t.dim():
            kw[name] = strided_copy(t, d)
        return
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


def amd_props(arch: str, name: str = "AMD Instinct MI355X"):
    """Device properties as torch reports them for an AMD GPU (``gcnArchName`` carries the arch)."""
    from types import SimpleNamespace

    return SimpleNamespace(name=name, gcnArchName=arch, major=9, minor=4, multi_processor_count=256,
                           total_memory=288 << 30)


def nvidia_props(name: str = "NVIDIA H200", major: int = 9, minor: int = 0):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=132, total_memory=141 << 30)


def clear_device_memos() -> None:
    from backend_core import platform

    platform._cuda_device_info.cache_clear()
    platform._flydsl_device_ok.cache_clear()


def fake_gpus(monkeypatch, props, hip: bool) -> None:
    """Pretend torch sees GPUs with ``props`` (a list of property objects); no GPU needed.
    Undone by ``monkeypatch`` (call ``clear_device_memos()`` after the test)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.version, "hip", "6.4" if hip else None, raising=False)
    clear_device_memos()


def install_fake_aiter(monkeypatch, functions: dict, version: str = "0.0.0-standin") -> None:
    """Install a stand-in ``aiter.ops.flydsl`` exposing ``functions`` (name -> callable), make
    ``aiter`` and ``flydsl`` look installed, and reset discovery. Undone by ``monkeypatch``."""
    import importlib.machinery
    import sys
    import types

    from backend_core import flydsl_source, platform

    mods = {}
    for name in ("aiter", "aiter.ops", "aiter.ops.flydsl"):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mods[name] = m
        monkeypatch.setitem(sys.modules, name, m)
    mods["aiter"].__version__ = version
    mods["aiter"].ops = mods["aiter.ops"]
    mods["aiter.ops"].flydsl = mods["aiter.ops.flydsl"]
    for k, fn in functions.items():
        setattr(mods["aiter.ops.flydsl"], k, fn)
    real = platform.module_available
    monkeypatch.setattr(platform, "module_available", lambda n: True if n in ("aiter", "flydsl") else real(n))
    flydsl_source.clear_cache()


@contextlib.contextmanager
def aiter_standin(monkeypatch, standin):
    """While open, ``standin`` (a test module with ``functions()`` and a ``calls`` list) stands in for AITER's
    FlyDSL entry points; the source selection is reset on exit. Yields ``standin``."""
    from backend_core import flydsl_source

    monkeypatch.delenv("FLYDSL_BACKENDS_SOURCE", raising=False)
    install_fake_aiter(monkeypatch, standin.functions())
    standin.calls.clear()
    try:
        yield standin
    finally:
        flydsl_source.clear_cache()


def pretend_flydsl_device(monkeypatch, registry) -> None:
    """Make CPU tensors count as sitting on a FlyDSL-capable AMD GPU for ``registry``'s ``flydsl``
    implementation (contract tests drive the real dispatch path against stand-in kernels)."""
    from backend_core import platform

    monkeypatch.setattr(platform, "flydsl_device_ok", lambda device=None: (True, "stand-in AMD gfx950"))
    monkeypatch.setattr(registry.get("flydsl"), "_available_cache", (True, "stand-in"))


@contextlib.contextmanager
def bound_launches():
    """While open, every call of a ``backend_core.launch.Bound`` appends ``(kernel name, launched)`` to the
    yielded list (launched False: refused)."""
    from backend_core import launch

    taken = []
    real_call = launch.Bound.__call__

    def counting(self, *tensors):
        ok = real_call(self, *tensors)
        taken.append((self.fn.__name__, ok))
        return ok

    launch.Bound.__call__ = counting
    try:
        yield taken
    finally:
        launch.Bound.__call__ = real_call


def kept_args_binder(taken: list):
    """A stand-in for ``backend_core.launch.bind`` that runs on Triton's interpreter: the launch is made, and
    the returned bound launch keeps every argument (tensors included) and puts in only the tensors at the
    positions ``vary`` (appending ``(kernel name, True)`` to ``taken`` per call). A position an implementation
    leaves out of ``vary`` runs a later call on the first call's tensor, which a test comparing outputs sees
    where the kernel reads that tensor."""

    class KeptArgs:
        def __init__(self, fn, grid, vary, args, kwargs):
            self.fn, self.grid, self.vary, self.args, self.kwargs = fn, grid, vary, args, kwargs

        def __call__(self, *tensors):
            a = list(self.args)
            for i, t in zip(self.vary, tensors):
                a[i] = t
            self.fn[self.grid](*a, **self.kwargs)
            taken.append((self.fn.__name__, True))
            return True

    def bind(fn, grid, vary, *args, **kwargs):
        return fn[grid](*args, **kwargs), KeptArgs(fn, grid, vary, args, kwargs)

    return bind
