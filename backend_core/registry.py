"""Choosing an implementation of an op: the one mechanism every op uses.

Each op (``kda_decode``, ``pa_decode``, ``pa_prefill``, ``write_kv``, ...) owns one
:class:`OpRegistry`, so each op states its own coverage. An :class:`Implementation` declares

* ``available() -> (ok, reason)``: can it run on this machine at all (toolchain installed,
  hardware present)? Memoized: the answer does not change within a process.
* ``supports(call) -> (ok, reason)``: can it serve this particular call (shapes, dtypes, device)?
* ``run(call)``: do it; optionally ``bind(call) -> run`` makes the choices an implementation has
  inside it (e.g. which FlyDSL source, AITER or the project's kernel) once for that call's shape.

``select(call, backend="auto")`` returns a :class:`Runner`: the chosen implementation with its
``run`` bound (callers that keep it, like a plan, make every choice once); for a GPU call the bound
``run`` makes the call's GPU the current device while it runs (kernels launch on the current one):

* ``backend="auto"`` walks the family's preference order for the call's device (fastest first)
  and takes the first implementation that is available and supports the call. The environment
  variable of the family (e.g. ``FLYDSL_BACKENDS_KDA=triton``) replaces ``"auto"`` with a name.
  The choice and the reasons the faster ones were passed over are logged once per call site.
* an explicit name that is unavailable or does not support the call raises ``ValueError``
  carrying the reason. There is no silent fallback from an explicit choice. A name forced through
  the environment variable that this op lacks but a sibling op of the family has (``also_known``:
  ``FLYDSL_BACKENDS_PA=flydsl`` for ``pa_prefill``, which has no FlyDSL kernel) means ``auto`` for
  this op, logged once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger("flydsl_backends")

Verdict = Tuple[bool, str]

__all__ = ["Implementation", "OpRegistry", "Runner", "Verdict"]


@dataclass
class Implementation:
    name: str
    available: Callable[[], Verdict]
    supports: Callable[[Any], Verdict]
    run: Callable[[Any], Any]
    description: str = ""
    bind: Optional[Callable[[Any], Callable[[Any], Any]]] = None  # call -> run with the per-shape choices made
    _available_cache: Optional[Verdict] = field(default=None, repr=False)

    def is_available(self) -> Verdict:
        if self._available_cache is None:
            try:
                self._available_cache = tuple(self.available())  # type: ignore[assignment]
            except Exception as exc:  # a probe that blows up means "not available", with the reason
                self._available_cache = (False, f"availability probe failed: {type(exc).__name__}: {exc}")
        return self._available_cache  # type: ignore[return-value]

    def can_serve(self, call: Any) -> Verdict:
        ok, why = self.is_available()
        if not ok:
            return False, f"not available: {why}"
        return self.supports(call)


@dataclass(frozen=True)
class Runner:
    """An implementation chosen for a call, with its ``run`` bound to that call's shape class."""

    name: str
    impl: Implementation
    run: Callable[[Any], Any]

    def __call__(self, call: Any) -> Any:
        return self.run(call)


class OpRegistry:
    """The implementations of one op and the rule that picks one."""

    def __init__(self, family: str, env_var: str, preference: Dict[str, Sequence[str]],
                 also_known: Sequence[str] = ()):
        """``preference`` maps a device type ("cuda", "cpu") to implementation names, fastest first;
        ``also_known``: names the family's environment variable may force that this op lacks."""
        self.family = family
        self.env_var = env_var
        self.preference = {k: tuple(v) for k, v in preference.items()}
        self.also_known = tuple(also_known)
        self._impls: Dict[str, Implementation] = {}
        self._logged: set = set()
        self._lock = threading.Lock()

    # -- registration -------------------------------------------------------------------------
    def register(self, impl: Implementation) -> Implementation:
        if impl.name in self._impls:
            raise ValueError(f"{self.family}: implementation {impl.name!r} registered twice")
        self._impls[impl.name] = impl
        return impl

    def names(self) -> List[str]:
        return list(self._impls)

    def get(self, name: str) -> Implementation:
        if name not in self._impls:
            raise ValueError(
                f"backend: {name!r} is not an implementation of {self.family} (expected 'auto' or one of "
                f"{sorted(self._impls)})"
            )
        return self._impls[name]

    def supported_on(self, backend: str, device=None) -> bool:
        """Whether ``backend`` can run this family's ops on ``device`` at all (None: the current
        device); shapes are checked per call. ``flydsl`` needs an AMD GPU whose arch is FlyDSL's
        build target, ``triton`` a GPU or the interpreter for CPU tensors."""
        from . import platform

        if not self.get(backend).is_available()[0]:
            return False
        if backend == "flydsl":
            return platform.flydsl_device_ok(device)[0]
        try:
            dev = platform.device_info(device)
        except ValueError:
            return False
        if backend == "triton" and dev.type == "cpu":
            return platform.triton_interpreter_enabled()
        return True

    def status(self) -> List[Tuple[str, bool, str]]:
        """(name, available, reason) for every implementation, for ``flydsl-backends info``."""
        return [(n, *impl.is_available()) for n, impl in self._impls.items()]

    def reset_cache(self) -> None:
        """Forget memoized availability (tests that fake the platform use this)."""
        for impl in self._impls.values():
            impl._available_cache = None
        self._logged.clear()

    # -- selection ----------------------------------------------------------------------------
    def requested_backend(self, backend: str) -> str:
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str ('auto' or one of {sorted(self._impls)}), got "
                            f"{type(backend).__name__}")
        if backend == "auto":
            forced = os.environ.get(self.env_var, "").strip()
            if forced and forced != "auto":
                if forced in self.also_known and forced not in self._impls:
                    self._log_once(("forced-absent", forced),
                                   f"{self.env_var}={forced}: {self.family} has no {forced} implementation; "
                                   "choosing automatically")
                    return "auto"
                if forced not in self._impls:
                    raise ValueError(
                        f"{self.env_var}={forced!r}: expected 'auto' or one of "
                        f"{sorted(set(self._impls) | set(self.also_known))}"
                    )
                return forced
        return backend

    def select(self, call: Any, backend: str = "auto", device_type: str = "cpu", site_depth: int = 0) -> Runner:
        """Pick the implementation for ``call`` and bind its run. ``site_depth``: frames between the
        caller of ``select`` and the user's call site (for the once-per-call-site log line)."""
        impl = self._choose(call, backend, device_type, site_depth)
        run = impl.bind(call) if impl.bind is not None else impl.run
        if device_type == "cuda":
            from .platform import on_call_device

            run = on_call_device(run)  # kernels launch on the current GPU: make it the call's
        return Runner(impl.name, impl, run)

    def _choose(self, call: Any, backend: str, device_type: str, site_depth: int) -> Implementation:
        name = self.requested_backend(backend)
        if name != "auto":
            impl = self.get(name)
            ok, why = impl.can_serve(call)
            if not ok:
                src = f" (forced by {self.env_var})" if backend == "auto" else ""
                raise ValueError(f"backend={name!r}{src} cannot serve this {self.family} call: {why}")
            return impl

        order = self.preference.get(device_type, self.preference.get("cpu", ()))
        skipped = []
        for cand in order:
            impl = self._impls.get(cand)
            if impl is None:
                continue
            ok, why = impl.can_serve(call)
            if ok:
                self._log_choice(impl.name, skipped, site_depth)
                return impl
            skipped.append(f"{cand}: {why}")
        raise ValueError(
            f"backend='auto': no implementation of {self.family} can serve this call on {device_type}: "
            + "; ".join(skipped)
        )

    def _log_once(self, key, message: str) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        logger.info("%s", message)

    def _log_choice(self, name: str, skipped: List[str], site_depth: int) -> None:
        try:  # frames: 0 this, 1 _choose, 2 select, 3 select's caller, then site_depth more up to the call site
            frame = sys._getframe(3 + site_depth)
            site = (frame.f_code.co_filename, frame.f_lineno)
        except ValueError:
            site = ("?", 0)
        key = (name, site, tuple(skipped))
        if key in self._logged:
            return
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        why = f" (passed over: {'; '.join(skipped)})" if skipped else ""
        logger.info("%s: backend='auto' chose %r at %s:%d%s", self.family, name, site[0], site[1], why)
