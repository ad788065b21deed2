"""FlyDSL implementation slot of the paged-attention ops (AMD gfx950 / gfx942).

The source is AITER's ``aiter.ops.flydsl.pa_decode`` when the installed AITER has it (``aiter.py``,
the one adapter), chosen through ``backend_core.flydsl_source`` (``FLYDSL_BACKENDS_SOURCE``). The
project ships no FlyDSL paged-attention kernel of its own in this release (``own`` cannot serve),
and neither ``write_kv`` nor ``pa_prefill`` has a FlyDSL path: on AMD, ``backend="auto"`` uses the
Triton kernels for those. Gated on the device asked about (``platform.flydsl_device_ok``). Not run
on AMD hardware here (there is none).
"""

from __future__ import annotations

from typing import List, Tuple

from backend_core import flydsl_source, platform

from . import aiter as _aiter

__all__ = ["available", "supports", "bind", "run", "source_for", "sources"]

OWN_REASON = "the project ships no FlyDSL paged-attention kernel of its own yet (AITER's is the FlyDSL source)"


def available() -> Tuple[bool, str]:
    if not platform.flydsl_available():
        return False, "flydsl is not installed (pip install 'flydsl-backends[flydsl]')"
    if not (platform.has_gpu() and platform.is_hip()):
        return False, "no AMD GPU visible (FlyDSL paged decode comes from AITER and runs only on AMD GPUs)"
    fns, why = _aiter.find()
    if fns is None:
        return False, f"{why}; {OWN_REASON}"
    return True, why


def source_for(p) -> Tuple[str, str]:
    return flydsl_source.select(p.device, lambda: _aiter.covers(p), lambda: (False, OWN_REASON))


def supports(p) -> Tuple[bool, str]:
    return flydsl_source.verdict_of(lambda: source_for(p))


def bind(p):
    """The run function of the source serving ``p`` (AITER's: chosen once per runner)."""
    source_for(p)
    return _aiter.run


def run(p):
    return bind(p)(p)


def sources() -> List[Tuple[str, bool, str]]:
    fns, why = _aiter.find()
    return [("aiter", fns is not None, why), ("own", False, OWN_REASON)]
