"""The implementations of the paged-attention ops, one registry per op (``backend_core.registry``).

Each op registers one run function per implementation: ``pa_decode`` and ``pa_prefill`` the attention run
(the reference's ``run_attention``, the Triton launcher's ``run_attention``, AITER's FlyDSL decode), ``write_kv``
the write run. ``FLYDSL_BACKENDS_PA=torch|triton|flydsl`` forces one for all three when ``backend="auto"``;
a name one op lacks (flydsl for prefill and write) means auto for that op. Status: on an NVIDIA GPU ``auto``
picks the Triton kernels (performance: docs/performance.md); on CPU the ``torch`` reference (Triton there
runs only under ``TRITON_INTERPRET=1``); on AMD the FlyDSL slot serves decode through AITER's FlyDSL kernel
when the installed AITER has it (``pa_backend/flydsl``).
"""

from __future__ import annotations

from backend_core.registry import Implementation, OpRegistry

from . import flydsl as _flydsl
from . import reference as _reference
from . import triton as _triton

__all__ = ["DECODE", "PREFILL", "WRITE", "REGISTRIES", "REGISTRY", "registry_for"]


def _always(p):
    return True, "ok"


def _registry(op: str, impls) -> OpRegistry:
    """One registry per op, each with its own coverage; one variable (FLYDSL_BACKENDS_PA) forces all
    three, and a name one op lacks (flydsl for prefill and write) means auto for that op."""
    names = [i.name for i in impls]
    reg = OpRegistry(op, env_var="FLYDSL_BACKENDS_PA",
                     preference={"cuda": tuple(n for n in ("flydsl", "triton", "torch") if n in names),
                                 "cpu": tuple(n for n in ("torch", "triton") if n in names)},
                     also_known=("torch", "triton", "flydsl"))
    for impl in impls:
        reg.register(impl)
    return reg


def _torch_attention() -> Implementation:
    return Implementation("torch", lambda: (True, "always (reference: gather, dequantize, FP32 softmax)"), _always,
                          _reference.run_attention, "reference")


def _triton_attention() -> Implementation:
    return Implementation("triton", _triton.available, _triton.supports, _triton.run_attention,
                          "Triton kernels (split-K partitions + reduce)")


DECODE = _registry("pa_decode", (
    _torch_attention(), _triton_attention(),
    Implementation("flydsl", _flydsl.available, _flydsl.supports, _flydsl.run,
                   "AITER's FlyDSL paged decode (AMD gfx950/gfx942), discovered at run time", bind=_flydsl.bind)))
PREFILL = _registry("pa_prefill", (_torch_attention(), _triton_attention()))  # no FlyDSL prefill (Triton on AMD)
WRITE = _registry("write_kv", (  # no FlyDSL write kernel
    Implementation("torch", lambda: (True, "always (reference: FP8 quantize, scatter into the pages)"), _always,
                   _reference.run_write, "reference"),
    Implementation("triton", _triton.available, _triton.supports, _triton.run_write, "Triton kernel (write_kv)")))
REGISTRIES = {"pa_decode": DECODE, "pa_prefill": PREFILL, "write_kv": WRITE}
REGISTRY = DECODE  # the decode op's registry (``pa_backend.REGISTRY``)


def registry_for(p) -> OpRegistry:
    """The registry of a checked attention batch or problem (``PABatch`` / ``PAProblem``): the one place the
    op is told from the problem (a plan asks once, when it is made)."""
    return DECODE if p.is_decode else PREFILL
