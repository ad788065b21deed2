"""Public KDA ops: ``kda_decode``, ``kda_decode_with_f_b``, ``is_kda_decode_supported``; the speculative verify
step ``kda_verify``, ``kda_verify_with_f_b``.

docs/design.md §3 is the contract. The ops live beside their checks in ``contract.py``; the implementations
(``torch`` reference, ``triton``, ``flydsl``) in ``registry.py``, chosen by ``backend_core.registry``;
``FLYDSL_BACKENDS_KDA=torch|triton|flydsl`` forces one when ``backend="auto"``.
"""

from __future__ import annotations

import functools

from .contract import kda_decode, kda_decode_with_f_b
from .registry import REGISTRY, VERIFY_REGISTRY
from .verify_contract import kda_verify, kda_verify_with_f_b

__all__ = [
    "kda_decode",
    "kda_decode_with_f_b",
    "is_kda_decode_supported",
    "REGISTRY",
    "kda_decode_ref",
    "kda_decode_with_f_b_ref",
    "kda_decode_triton",
    "kda_decode_with_f_b_triton",
    "kda_verify",
    "kda_verify_with_f_b",
    "VERIFY_REGISTRY",
]


def is_kda_decode_supported(device=None, backend: str = "flydsl") -> bool:
    """Whether ``backend`` can run KDA decode on ``device`` (None: the current device). For
    ``flydsl``: flydsl installed and the device an AMD GPU whose arch (gcnArchName, memoized per
    device index) is FlyDSL's build target; shapes are checked per call."""
    return REGISTRY.supported_on(backend, device)


kda_decode_ref = functools.partial(kda_decode, backend="torch")
kda_decode_with_f_b_ref = functools.partial(kda_decode_with_f_b, backend="torch")
kda_decode_triton = functools.partial(kda_decode, backend="triton")
kda_decode_with_f_b_triton = functools.partial(kda_decode_with_f_b, backend="triton")
