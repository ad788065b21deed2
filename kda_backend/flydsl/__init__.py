"""FlyDSL implementation of the KDA decode op (AMD gfx950 / gfx942).

Two sources, chosen per call by ``backend_core.flydsl_source`` (``FLYDSL_BACKENDS_SOURCE=
auto|aiter|own``): AITER's ``aiter.ops.flydsl`` KDA entry points when the installed AITER has them
and they cover the call (``aiter.py``, the one adapter), else the project's own FlyDSL kernel
(``kernel.py``). Both are gated on the device asked about: an AMD GPU whose arch (gcnArchName) is
FlyDSL's build target (``backend_core.platform.flydsl_device_ok``).

Status: the own kernel is compiled and resource-checked for gfx950 and gfx942 on CPU (the compile
gate, ``flydsl-backends info --resources``); neither source has run on AMD hardware here (there
is none). ``flydsl-backends verify`` checks them on a gfx950 / gfx942 machine.
"""

from __future__ import annotations

from typing import List, Tuple

from backend_core import flydsl_source, platform

from . import aiter as _aiter

__all__ = ["available", "supports", "bind", "run", "source_for", "sources"]


def available() -> Tuple[bool, str]:
    if not platform.flydsl_available():
        return False, "flydsl is not installed (pip install 'flydsl-backends[flydsl]')"
    if not (platform.has_gpu() and platform.is_hip()):
        return False, ("no AMD GPU visible (the FlyDSL kernels are compiled and resource-checked for gfx950/gfx942 "
                       "on CPU; they run only on AMD GPUs)")
    return True, "flydsl installed, AMD GPU present"


def _own_covers(p) -> Tuple[bool, str]:
    if not platform.flydsl_available():
        return False, "flydsl is not installed"
    try:
        from . import kernel
    except ImportError as exc:  # a broken install must explain itself, not break dispatch
        return False, f"the project's FlyDSL kernel module does not import: {exc}"
    return kernel.supports(p)


def source_for(p) -> Tuple[str, str]:
    """(``"aiter"`` or ``"own"``, why) for a validated call, or ValueError with the reason."""
    return flydsl_source.select(p.device, lambda: _aiter.covers(p), lambda: _own_covers(p))


def supports(p) -> Tuple[bool, str]:
    return flydsl_source.verdict_of(lambda: source_for(p))


def bind(p):
    """The run function of the source serving ``p`` (chosen once: a plan or an adapter that keeps
    the registry's runner does not ask again)."""
    src, _ = source_for(p)
    if src == "aiter":
        return _aiter.run
    from . import kernel

    return kernel.launch


def run(p):
    return bind(p)(p)


def sources() -> List[Tuple[str, bool, str]]:
    """(source, usable on this machine, why) for ``flydsl-backends info``."""
    fns, why = _aiter.find()
    rows = [("aiter", fns is not None, why)]
    if platform.flydsl_available():
        from . import kernel, shipped

        rows.append(("own", True,
                     f"the project's FlyDSL kernel: H in {kernel.SUPPORTED_H}, K=V={kernel.SUPPORTED_K[0]}, "
                                  f"W={kernel.SUPPORTED_W[0]}, {len(shipped.SHIPPED_SPECS)} specializations compiled "
                                  "and "
                                  "resource-checked for gfx950/gfx942 on CPU; not run on AMD hardware"))
    else:
        rows.append(("own", False, "flydsl is not installed"))
    return rows
