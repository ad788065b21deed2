"""Placeholder torchvision for CPU test environments (PyPI torchvision is a CUDA build that cannot
load against CPU torch). SGLang imports ``torchvision.transforms`` from multimodal helpers the
attention tests never use; every ``torchvision.*`` submodule resolves to an empty placeholder."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__}: torchvision is a stub in this test environment")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _Placeholder(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__version__ = "0.0.0"
__path__ = __path__  # noqa: F821  (a package: submodules come from the finder)


def __getattr__(name):
    return _Placeholder(f"torchvision.{name}")
