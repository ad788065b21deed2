"""The implementations of the KDA decode op (``backend_core.registry``): the ``torch`` reference, the Triton
kernel and the FlyDSL kernel, each registered once with its run function. ``FLYDSL_BACKENDS_KDA=torch|triton|flydsl``
forces one when ``backend="auto"``.
"""

from __future__ import annotations

from backend_core.registry import Implementation, OpRegistry

from . import flydsl as _flydsl
from . import triton as _triton
from .reference import run_reference, run_verify_reference

__all__ = ["REGISTRY", "VERIFY_REGISTRY", "REGISTRIES"]

REGISTRY = OpRegistry(
    "kda",
    env_var="FLYDSL_BACKENDS_KDA",
    preference={"cuda": ("flydsl", "triton", "torch"), "cpu": ("torch", "triton")},
)
REGISTRY.register(Implementation("torch", lambda: (True, "always (reference, FP32 loop over rows)"),
                                 lambda p: (True, "ok"), run_reference, "reference: readable torch, FP32"))
REGISTRY.register(Implementation("triton", _triton.available, _triton.supports, _triton.run,
                                 "one Triton launch per step (NVIDIA, AMD; CPU via TRITON_INTERPRET=1)"))
REGISTRY.register(Implementation("flydsl", _flydsl.available, _flydsl.supports, _flydsl.run,
                                 "FlyDSL kernel (AMD gfx950/gfx942)", bind=_flydsl.bind))

# The speculative-verify op (kda_verify): same family variable; FlyDSL has no verify kernel yet.
VERIFY_REGISTRY = OpRegistry(
    "kda_verify",
    env_var="FLYDSL_BACKENDS_KDA",
    preference={"cuda": ("triton", "torch"), "cpu": ("torch", "triton")},
    also_known=("flydsl",),
)
VERIFY_REGISTRY.register(Implementation("torch", lambda: (True, "always (reference, FP32 loop over tokens)"),
                                        lambda p: (True, "ok"), run_verify_reference,
                                        "reference: readable torch, FP32"))
VERIFY_REGISTRY.register(Implementation("triton", _triton.available, _triton.supports_verify, _triton.run_verify,
                                        "one Triton launch per verify step (NVIDIA, AMD; CPU via TRITON_INTERPRET=1)"))

REGISTRIES = {"kda": REGISTRY, "kda_verify": VERIFY_REGISTRY}  # the family's ops (the CLI lists each)
