"""``after_import(module, callback)``: run a callback when the framework itself first imports a module,
so a plugin hooks framework classes without importing, at plugin load, modules whose import has effects.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from typing import Callable, Dict

_after_log = logging.getLogger("flydsl_backends")


class _CallbackLoader(importlib.abc.Loader):
    """The module's own loader, then the callbacks still pending for it on the executed module (taken
    only here: a spec that is found but never executed, e.g. ``importlib.util.find_spec`` probing
    whether a module exists, leaves them for the real import). Their errors are logged, never raised
    into the import."""

    def __init__(self, loader, finder, name):
        self._loader, self._finder, self._name = loader, finder, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with self._finder._lock:
            callbacks = self._finder.pending.pop(self._name, [])
        for cb in callbacks:
            try:
                cb(module)
            except Exception as exc:  # a hook must not break the framework's import
                _after_log.warning("after-import hook %s on %s failed: %s: %s", getattr(cb, "__name__", cb),
                                   module.__name__, type(exc).__name__, exc)

    def __getattr__(self, name):  # get_source, is_package, ... of the module's own loader
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending: Dict[str, list] = {}
        self._lock = threading.Lock()

    def find_spec(self, fullname, path, target=None):
        with self._lock:
            callbacks = self.pending.get(fullname)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader, self, fullname)
        return spec


_finder = _AfterImportFinder()


def after_import(module: str, callback: Callable[[object], None]) -> None:
    """Call ``callback(module)`` once ``module`` is imported: now if it already is, else right after the
    framework's own first import of it (a meta-path hook; the module is never imported from here). A
    plugin registers framework hooks this way without importing, at load time, modules whose import
    has effects (e.g. vLLM's FLA layers query the GPU at import: done in a server's parent process,
    that initialises CUDA there and forces the engine's workers to spawn). A callback's exception is
    logged, not raised into the import."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        callback(loaded)
        return
    with _finder._lock:
        _finder.pending.setdefault(module, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
