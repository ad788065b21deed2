"""FlyDSL implementation slot of the KDA decode op (AMD gfx950 / gfx942).

Not implemented yet: the kernel, the AITER discovery and the gfx950/gfx942 compile gate are the
FlyDSL issue's work. The slot is registered so that ``flydsl-backends info`` and
``backend="flydsl"`` report why it cannot serve rather than failing obscurely.
"""

from __future__ import annotations

from typing import Tuple

from backend_core import platform

__all__ = ["available", "supports", "run"]


def available() -> Tuple[bool, str]:
    if not platform.flydsl_available():
        return False, "not implemented in this release (and flydsl is not installed)"
    return False, "not implemented in this release (flydsl is installed, but the project's FlyDSL KDA kernel is not)"


def supports(problem) -> Tuple[bool, str]:
    return available()


def run(problem):
    ok, why = available()
    raise ValueError(f"backend='flydsl' cannot serve this call: {why}")
