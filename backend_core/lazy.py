"""Framework subclasses built on first use, so an adapter module imports no framework.

An adapter (``pa_backend/sglang.py``, ``pa_backend/vllm.py``) defines builder functions that import
the framework and return a class; ``LazyClasses`` builds each once (thread-safe) and serves them as
module attributes through PEP 562::

    _lazy = LazyClasses(__name__, {"MyBackend": _build_backend_class})
    _get_class = _lazy.get
    __getattr__ = _lazy.module_getattr
"""

from __future__ import annotations

import threading
from typing import Callable, Dict


class LazyClasses:
    def __init__(self, module: str, builders: Dict[str, Callable[[], type]]):
        self.module = module
        self.builders = dict(builders)
        self._classes: Dict[str, type] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> type:
        """The class ``name``, built on the first call (a builder may call ``get`` for another)."""
        with self._lock:
            cls = self._classes.get(name)
        if cls is None:
            cls = self.builders[name]()
            cls.__module__ = self.module
            cls.__qualname__ = name
            with self._lock:
                cls = self._classes.setdefault(name, cls)
        return cls

    def module_getattr(self, name: str):
        if name in self.builders:
            return self.get(name)
        raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
