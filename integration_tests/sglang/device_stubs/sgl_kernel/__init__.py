"""Device-run stand-in for sgl_kernel (its CUDA wheel cannot be installed on the test machine): every
``sgl_kernel.*`` submodule exists, every name in it is a function that raises when called, so SGLang
modules that import its names at module level load (on a CUDA machine SGLang imports them whenever
torch sees CUDA, ``_is_cuda = is_cuda()``).

A few names have torch stand-ins (``STANDINS``), for the SGLang engine on the GPU platform of
``integration_tests/e2e/sglang_gpu.py``, which keeps SGLang's layers on their torch paths; these are
the sgl_kernel names that path still calls:

* ``sgl_kernel.utils.is_arch_support_pdl()`` -- called by ``TritonAttnBackend.__init__`` on CUDA
  (``srt/layers/attention/triton_backend.py``) to decide programmatic dependent launch for its
  Triton kernels: answers False (the kernels launch the ordinary way).
* ``sgl_kernel.weak_ref_tensor(t)`` -- imported by ``runner_backend_utils/weak_ref_tensor.py`` and
  called by breakable / piecewise CUDA graphs to keep non-owning views of graph outputs: returns
  ``t`` itself (a strong reference: the memory stays alive longer, the values are the same). Not
  reached with decode-only graphs (the GPU platform turns prefill graphs off).
"""
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


def _is_arch_support_pdl() -> bool:
    return False


def _weak_ref_tensor(tensor):
    return tensor


# module -> {name: torch stand-in} (see the module docstring for where SGLang calls each)
STANDINS = {
    "sgl_kernel": {"weak_ref_tensor": _weak_ref_tensor},
    "sgl_kernel.utils": {"is_arch_support_pdl": _is_arch_support_pdl},
}


def _missing_attr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        standin = STANDINS.get(modname, {}).get(name)
        if standin is not None:
            return standin
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
