"""Where a FlyDSL kernel comes from: the installed AITER's ``aiter.ops.flydsl`` entry points, or the
project's own FlyDSL kernels. Both op families use this one mechanism.

* ``FLYDSL_BACKENDS_SOURCE=auto|aiter|own`` (read at every call, default ``auto``): ``auto`` takes
  AITER where its entry point exists *and* covers the call, else the project's kernel; ``aiter``
  and ``own`` insist on one source and make the call fail with the reason when it cannot serve.
* AITER is discovered at run time, never at import: the first question imports
  ``aiter.ops.flydsl`` (memoized), checks that each entry point is callable and that its
  signature has the parameters the project's adapter passes (AITER's API is young; a changed
  signature means "not usable", with the reason, rather than a wrong call).
"""

from __future__ import annotations

import importlib
import inspect
import os
import threading
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

from . import platform

__all__ = ["SOURCES", "SOURCE_ENV", "AITER_MODULE", "requested_source", "find_aiter", "choose", "select", "verdict_of",
           "clear_cache"]

SOURCES = ("auto", "aiter", "own")
SOURCE_ENV = "FLYDSL_BACKENDS_SOURCE"
AITER_MODULE = "aiter.ops.flydsl"

Verdict = Tuple[bool, str]

_lock = threading.Lock()
_memo: Dict[tuple, Tuple[Optional[Dict[str, Callable]], str]] = {}


def requested_source() -> str:
    """The value of ``FLYDSL_BACKENDS_SOURCE`` (``auto`` when unset). Raises ValueError when malformed."""
    raw = os.environ.get(SOURCE_ENV, "").strip().lower() or "auto"
    if raw not in SOURCES:
        raise ValueError(f"{SOURCE_ENV}={os.environ.get(SOURCE_ENV)!r}: expected one of {', '.join(SOURCES)}")
    return raw


def clear_cache() -> None:
    """Forget discovery results (tests install and remove stand-in AITER modules)."""
    with _lock:
        _memo.clear()


def _accepts(fn: Callable, params: Sequence[str]) -> Tuple[bool, str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True, "signature not inspectable (assumed compatible)"
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return True, "ok"
    missing = [p for p in params if p not in sig.parameters]
    if missing:
        return False, f"its signature lacks {', '.join(missing)} (this adapter maps the documented API; got {sig})"
    return True, "ok"


def find_aiter(entry_points: Mapping[str, Sequence[str]]) -> Tuple[Optional[Dict[str, Callable]], str]:
    """``({name: function}, reason)`` when ``aiter.ops.flydsl`` has every entry point of
    ``entry_points`` (name -> parameter names the adapter passes by keyword), else ``(None, why)``.
    Imports AITER on the first call for a given set of entry points, never before."""
    key = tuple(sorted((k, tuple(v)) for k, v in entry_points.items()))
    with _lock:
        if key in _memo:
            return _memo[key]
    result = _discover(entry_points)
    with _lock:
        _memo[key] = result
    return result


def _discover(entry_points: Mapping[str, Sequence[str]]):
    if not platform.module_available("aiter"):
        return None, "AITER is not installed"
    if not platform.flydsl_available():
        return None, "AITER is installed but flydsl is not (AITER's FlyDSL ops need it)"
    try:
        mod = importlib.import_module(AITER_MODULE)
    except Exception as exc:  # a broken optional dependency must not break the package
        return None, f"import {AITER_MODULE} failed: {type(exc).__name__}: {exc}"
    found = {}
    for name, params in entry_points.items():
        fn = getattr(mod, name, None)
        if not callable(fn):
            return None, f"{AITER_MODULE} has no {name} (the installed AITER predates it)"
        ok, why = _accepts(fn, params)
        if not ok:
            return None, f"{AITER_MODULE}.{name}: {why}"
        found[name] = fn
    version = getattr(importlib.import_module("aiter"), "__version__", "unknown version")
    return found, f"{AITER_MODULE} ({version}) has {', '.join(entry_points)}"


def choose(aiter: Verdict, own: Verdict) -> Tuple[Optional[str], str]:
    """Pick the source of one call from the two verdicts (can AITER serve it, can the project's
    kernel) and ``FLYDSL_BACKENDS_SOURCE``: ``("aiter" | "own", why)`` or ``(None, why not)``."""
    want = requested_source()
    if want in ("auto", "aiter") and aiter[0]:
        return "aiter", f"AITER: {aiter[1]}"
    if want == "aiter":
        return None, f"{SOURCE_ENV}=aiter but AITER cannot serve this call: {aiter[1]}"
    if own[0]:
        why = "" if want == "own" else f" (AITER passed over: {aiter[1]})"
        return "own", f"project kernel: {own[1]}{why}"
    if want == "own":
        return None, f"{SOURCE_ENV}=own but the project's FlyDSL kernel cannot serve this call: {own[1]}"
    return None, f"AITER: {aiter[1]}; project kernel: {own[1]}"


def select(device, aiter: Callable[[], Verdict], own: Callable[[], Verdict]) -> Tuple[str, str]:
    """The source serving one call on ``device``: ``("aiter" | "own", why)``, or ValueError with the
    reason (the device is not a FlyDSL-capable AMD GPU, or neither source covers the call)."""
    ok, why = platform.flydsl_device_ok(device)
    if not ok:
        raise ValueError(f"backend='flydsl' cannot serve this call: {why}")
    src, why = choose(aiter(), own())
    if src is None:
        raise ValueError(f"backend='flydsl' cannot serve this call: {why}")
    return src, why


def verdict_of(pick: Callable[[], Tuple[str, str]]) -> Verdict:
    """``select``'s answer as an implementation's ``supports`` verdict."""
    try:
        return True, pick()[1]
    except ValueError as exc:
        return False, str(exc).split(": ", 1)[-1]
