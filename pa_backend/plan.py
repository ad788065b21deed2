"""Import-compatible names of the plan, which lives beside its contract in ``pa_backend.contract``
(the adapters import ``PAPlan``, ``plan_decode`` and ``plan_prefill`` from here; new code imports them from
``pa_backend.contract`` or ``pa_backend``)."""

from .contract import PAPlan, plan_decode, plan_prefill

__all__ = ["PAPlan", "plan_decode", "plan_prefill"]
