"""Device-run stand-in for sgl_kernel (its CUDA wheel cannot be installed on the test machine): every
``sgl_kernel.*`` submodule exists, every name in it is a function that raises when called, so SGLang
modules that import its names at module level load; nothing of it runs in the tests."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0-standin"
__path__ = []


class _Stub:
    """Any name of sgl_kernel: attributes are stubs too (module-level tables such as
    ``scalar_types.uint4b8`` load); calling one raises."""

    def __init__(self, qualname):
        self._qualname = qualname

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self._qualname}.{name}")

    def __call__(self, *a, **k):
        raise NotImplementedError(f"{self._qualname}: stand-in (sgl_kernel is not installed on this machine)")

    def __repr__(self):
        return f"<sgl_kernel stand-in {self._qualname}>"


def _missing_attr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{modname}.{name}")

    return __getattr__


__getattr__ = _missing_attr(__name__)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = _missing_attr(spec.name)
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
