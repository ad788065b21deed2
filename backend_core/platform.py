"""The one place that asks the hardware and the installed toolchains.

Everything here is lazy and memoized: importing this module imports only torch. Triton and
FlyDSL are probed with ``importlib.util.find_spec`` (no import) until a caller really needs them.

Functions answer for a *device* (a ``torch.device``, an index, a string or ``None`` for the
current one) so that multi-GPU hosts with mixed devices give per-device answers.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import names as _names

DeviceLike = Union[torch.device, str, int, None]

__all__ = [
    "DeviceInfo",
    "on_call_device",
    "device_info",
    "has_gpu",
    "is_hip",
    "module_available",
    "triton_available",
    "triton_interpreter_enabled",
    "triton_runnable",
    "resident_programs",
    "triton_device_ok",
    "sm_count",
    "flydsl_available",
    "FLYDSL_ARCHES",
    "flydsl_build_target",
    "flydsl_device_ok",
    "summary",
]


@dataclass(frozen=True)
class DeviceInfo:
    """What the project needs to know about one device."""

    type: str  # "cuda" (NVIDIA or ROCm through torch's cuda namespace) or "cpu"
    index: Optional[int]
    name: str
    vendor: str  # "nvidia", "amd" or "cpu"
    arch: str  # "sm_90", "gfx950", "gfx942", ... or "cpu"
    multiprocessors: int  # SMs (NVIDIA) or CUs (AMD); 0 on the CPU
    total_memory: int  # bytes; 0 on the CPU

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"

    @property
    def is_nvidia(self) -> bool:
        return self.vendor == "nvidia"

    @property
    def sm_version(self) -> int:
        """NVIDIA compute capability as major * 10 + minor (sm_90: 90); 0 on other devices."""
        return int(self.arch[3:]) if self.is_nvidia and self.arch[3:].isdigit() else 0


def is_hip() -> bool:
    """True when torch is a ROCm build (``torch.cuda`` then drives HIP devices)."""
    return getattr(torch.version, "hip", None) is not None


def has_gpu() -> bool:
    """True when torch sees at least one CUDA or ROCm device."""
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken driver install must not break `import`
        return False


def _normalize(device: DeviceLike) -> torch.device:
    if device is None:
        if has_gpu():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if has_gpu() else 0)
    return dev


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    if not has_gpu() or index < 0 or index >= torch.cuda.device_count():
        raise ValueError(
            f"device: no GPU with index {index} (torch sees {torch.cuda.device_count() if has_gpu() else 0})"
        )
    props = torch.cuda.get_device_properties(index)
    if is_hip():
        arch = str(getattr(props, "gcnArchName", "")).split(":")[0] or "gfx-unknown"
        vendor = "amd"
    else:
        arch = f"sm_{props.major}{props.minor}"
        vendor = "nvidia"
    return DeviceInfo(
        type="cuda",
        index=index,
        name=props.name,
        vendor=vendor,
        arch=arch,
        multiprocessors=int(props.multi_processor_count),
        total_memory=int(props.total_memory),
    )


_CPU = DeviceInfo(type="cpu", index=None, name="cpu", vendor="cpu", arch="cpu", multiprocessors=0, total_memory=0)


def device_info(device: DeviceLike = None) -> DeviceInfo:
    """Describe ``device`` (memoized per device index). Raises ValueError for a missing GPU index."""
    dev = _normalize(device)
    if dev.type == "cpu":
        return _CPU
    if dev.type != "cuda":
        raise ValueError(f"device: unsupported device type {dev.type!r} (expected 'cuda' or 'cpu')")
    return _cuda_device_info(dev.index)


def module_available(name: str) -> bool:
    """Whether ``name`` could be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def triton_available() -> bool:
    return module_available("triton")


def triton_interpreter_enabled() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_runnable() -> "tuple[bool, str]":
    """Can Triton kernels run here at all: installed, and a GPU or the interpreter (CPU tensors)."""
    if not triton_available():
        return False, "triton is not installed (pip install 'flydsl-backends[triton]')"
    if has_gpu():
        return True, "triton installed, GPU present"
    if triton_interpreter_enabled():
        return True, "triton installed, TRITON_INTERPRET=1 (CPU tensors, interpreted: slow, for tests)"
    return False, "no CUDA/ROCm GPU visible to torch (set TRITON_INTERPRET=1 to run kernels on CPU tensors)"


def triton_device_ok(device: torch.device) -> "tuple[bool, str]":
    """Can a Triton kernel take tensors on ``device``: CUDA/ROCm, or CPU under the interpreter."""
    if device.type == "cpu" and not triton_interpreter_enabled():
        return False, "CPU tensors need TRITON_INTERPRET=1"
    if device.type not in ("cpu", "cuda"):
        return False, f"device type {device.type!r} is not supported"
    return True, "ok"


def sm_count(device: DeviceLike) -> int:
    """SMs / CUs of ``device``; on the CPU (interpreter runs) 132, a large NVIDIA GPU's count, so launch
    policies take the same shape-dependent branches as on a GPU."""
    info = device_info(device)
    return info.multiprocessors if info.type == "cuda" else 132


def resident_programs(device: DeviceLike, warps: int, kernel=None) -> int:
    """How many programs of ``warps`` warps one SM / CU holds at once: from a compiled Triton kernel's
    registers and shared memory when ``kernel`` (what a launch returned) is given and the device's
    limits are known, else an estimate (12 one-warp programs: 168 registers each on sm_90). On the
    CPU (the interpreter runs programs one after another): 1."""
    info = device_info(device)
    if info.type != "cuda":
        return 1
    guess = max(1, 12 // max(warps, 1))
    regs = getattr(kernel, "n_regs", None)
    meta = getattr(kernel, "metadata", None)
    if not regs or meta is None or is_hip():
        return guess
    props = torch.cuda.get_device_properties(info.index)
    per_sm_regs = int(getattr(props, "regs_per_multiprocessor", 65536))
    per_sm_smem = int(getattr(props, "shared_memory_per_multiprocessor", 0))
    per_sm_threads = int(getattr(props, "max_threads_per_multi_processor", 2048))
    per_warp = -(-int(regs) * 32 // 256) * 256  # registers are allocated per warp in units of 256
    n = min(per_sm_regs // (per_warp * warps), per_sm_threads // (32 * warps), 32)
    shared = int(getattr(meta, "shared", 0) or 0)
    if shared and per_sm_smem:
        n = min(n, per_sm_smem // (shared + 1024))  # 1 KB per block is reserved by the driver
    return max(1, n)


def flydsl_available() -> bool:
    return module_available("flydsl")


# The AMD architectures the FlyDSL kernels are built and resource-checked for.
FLYDSL_ARCHES = _names.FLYDSL_ARCHES


def _env_arch(name: str) -> Optional[str]:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw.startswith("gfx"):
        return raw.split(":")[0]
    parts = raw.split(".")
    if len(parts) == 3 and all(x.isdigit() for x in parts):  # HSA_OVERRIDE_GFX_VERSION=9.5.0
        return f"gfx{parts[0]}{parts[1]}{parts[2]}"
    return raw


def flydsl_build_target() -> "tuple[Optional[str], str]":
    """(architecture FlyDSL will build for, where that comes from), without importing FlyDSL.

    FlyDSL 0.4.2 takes its target (codegen, and FP8 semantics through ``get_rocm_arch``) from
    ``FLYDSL_GPU_ARCH`` (or ``HSA_OVERRIDE_GFX_VERSION``), else from the first GPU the ROCm runtime
    lists; codegen also honours ``ARCH``. ``(None, reason)`` when ``ARCH`` and ``FLYDSL_GPU_ARCH``
    disagree (a binary built that way mixes one arch's code with another's FP8 format)."""
    src = "FLYDSL_GPU_ARCH" if _env_arch("FLYDSL_GPU_ARCH") else "HSA_OVERRIDE_GFX_VERSION"
    gpu = _env_arch(src)
    arch = _env_arch("ARCH")
    if gpu and arch and gpu != arch:
        return None, f"ARCH={arch} and {src}={gpu} disagree (set both to the device's arch)"
    if gpu:
        return gpu, src
    if arch:
        return arch, "ARCH"
    if has_gpu() and is_hip():
        return device_info(0).arch, "the first GPU (FlyDSL's default)"
    return None, "no AMD GPU and neither FLYDSL_GPU_ARCH nor ARCH is set"


@functools.lru_cache(maxsize=None)
def _flydsl_device_ok(index: Optional[int], target: Optional[str], target_why: str) -> "tuple[bool, str]":
    if index is None:
        return False, "FlyDSL kernels need an AMD GPU (the tensors are on the CPU)"
    info = _cuda_device_info(index)
    if not info.is_amd:
        return False, (f"cuda:{index} is {info.name} ({info.arch}); FlyDSL kernels need an AMD GPU "
                       f"({'/'.join(FLYDSL_ARCHES)})")
    if info.arch not in FLYDSL_ARCHES:
        return False, f"cuda:{index} is {info.arch}; the FlyDSL kernels are built for {'/'.join(FLYDSL_ARCHES)} only"
    if target is None:
        return False, target_why
    if target != info.arch:
        return False, (f"FlyDSL builds for {target} ({target_why}) but cuda:{index} is {info.arch}: set "
                       f"FLYDSL_GPU_ARCH={info.arch} (and ARCH) or use a {target} device")
    return True, f"cuda:{index} is {info.arch}, FlyDSL builds for {target}"


def flydsl_device_ok(device: DeviceLike = None) -> "tuple[bool, str]":
    """Can FlyDSL kernels run on ``device``: an AMD gfx950/gfx942 GPU whose arch is FlyDSL's build
    target. Reads the device's ``gcnArchName``; memoized per (device index, target). Whether
    flydsl is installed is the caller's question (``flydsl_available``)."""
    try:
        dev = _normalize(device)
    except (RuntimeError, ValueError) as exc:
        return False, f"device: {exc}"
    if dev.type == "cpu":
        return _flydsl_device_ok(None, None, "")
    if dev.type != "cuda":
        return False, f"device type {dev.type!r}: FlyDSL kernels need an AMD GPU"
    if not has_gpu() or dev.index >= torch.cuda.device_count() or dev.index < 0:
        seen = torch.cuda.device_count() if has_gpu() else 0
        return False, f"device: no GPU with index {dev.index} (torch sees {seen})"
    target, why = flydsl_build_target()
    return _flydsl_device_ok(dev.index, target, why)


def summary() -> dict:
    """A dict for ``flydsl-backends info`` and benchmark rows."""
    out = {
        "torch": torch.__version__,
        "torch_build": ("rocm " + torch.version.hip if is_hip()
                        else "cuda " + str(torch.version.cuda) if torch.version.cuda else "cpu"),
        "triton": _version_of("triton"),
        "flydsl": _version_of("flydsl"),
        "triton_interpreter": triton_interpreter_enabled(),
        "devices": [],
    }
    if has_gpu():
        for i in range(torch.cuda.device_count()):
            d = device_info(i)
            out["devices"].append(f"cuda:{i} {d.name} ({d.arch}, {d.multiprocessors} SMs/CUs, "
                                  f"{d.total_memory / 2**30:.0f} GiB)")
    else:
        out["devices"].append("cpu only (no CUDA/ROCm device visible to torch)")
    return out


def _version_of(dist: str) -> Optional[str]:
    if not module_available(dist):
        return None
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "unknown"


def on_call_device(run):
    """``run(call)`` with ``call.device`` made the current GPU while it runs. Triton, FlyDSL and AITER
    launch on the current device and its current stream, so a call whose tensors live on another GPU
    than the current one (a process driving several GPUs; a server's workers each set their own)
    would launch there with this GPU's pointers. Costs a device-index compare per call; the registry
    wraps every runner it binds for a GPU call."""
    def guarded(call):
        dev = call.device
        if dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):
                return run(call)
        return run(call)

    guarded.__wrapped__ = run
    return guarded
