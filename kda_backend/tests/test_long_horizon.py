"""Long-horizon drift: many decode steps of one KDA layer, kernel vs the same recurrence in float64.

Tolerance reasoning (written down because it sets the numbers below):

* Each step the kernel's state carries the rounding of its storage dtype, relative size
  u = 2**-9 (bf16, round to nearest) or 2**-24 (fp32), and an FP32 summation-order error ~1e-7.
* The recurrence forgets: the decay exp(g) < 1 and the delta-rule projection (I - β k kᵀ) has norm
  <= 1, so an error made at step t is multiplied by at most ρ = exp(mean g) per later step.
  Independent per-step errors then add like a geometric series of variances: the steady-state
  relative error is about u / sqrt(1 - ρ²), not u·steps. The test measures ρ from the gates it
  generated and allows 4x that bound (plus the FP32 floor).
* The output is bf16, so it also carries one final rounding (<= 2**-8 relative; the Triton
  interpreter truncates, 2**-7 worst case): out tolerance = 1e-2 + the state bound.
* Triton's CPU interpreter truncates FP32 -> BF16 instead of rounding to nearest: a biased error
  of up to 2**-8 per step whose sum does not average out, so under the interpreter the bf16 bound
  is the geometric sum itself, 2**-8 / (1 - ρ) (still bounded: no growth with steps).
A drift that grows with the number of steps (a bias, not rounding noise) fails these bounds long
before 2,000 steps.
"""

import dataclasses
import math

import pytest
import torch

from kda_backend.reference import kda_gate, run_reference
from kda_backend.cases import make_case, rel_err

from .conftest import DEVICE

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -9}


def drift_run(steps, B, H, K, state_dtype, device, impl, seed=0, with_f_b=False):
    device = torch.device(device)
    case = make_case(B, H, K, 4, slots=B + 1, state_dtype=state_dtype, device=device, seed=seed,
                     with_f_b=with_f_b, state_scale=0.1, include_slot0=True)
    kw = case.kwargs
    kw["A_log"].fill_(math.log(0.05))  # slow forgetting: the hardest case for accumulated rounding
    twin_conv = kw["conv_state"].clone()
    state64 = kw["state"].double()
    out64 = torch.empty(kw["out"].shape, dtype=torch.float64, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    live = case.live_rows
    max_out_err, log_decay = 0.0, []
    for step in range(steps):
        for name in ("x", "a", "f_a", "b", "output_gate"):
            if kw.get(name) is not None:
                kw[name].copy_(torch.randn(kw[name].shape, generator=g).to(kw[name].dtype))
        if kw.get("a") is not None:
            log_decay.append(kda_gate(kw["a"].double().view(B, H, K), kw["A_log"].double(),
                                      kw["dt_bias"].double().view(H, K), None).mean().item())
        p64 = case.problem()
        p64 = dataclasses.replace(p64, state=state64, out=out64, conv_state=twin_conv)
        run_reference(p64, compute_dtype=torch.float64)
        case.call(impl)
        max_out_err = max(max_out_err, rel_err(kw["out"][live], out64[live]))
    state_err = rel_err(kw["state"][case.live_slots], state64[case.live_slots])
    rho = math.exp(sum(log_decay) / len(log_decay)) if log_decay else 0.999
    truncating = impl == "triton" and device.type == "cpu" and state_dtype == torch.bfloat16
    if truncating:
        state_tol = 2.0 ** -8 / (1 - rho) + 1e-6
    else:
        state_tol = 4 * U[state_dtype] / math.sqrt(1 - rho ** 2) + 1e-6
    return dict(max_out_err=max_out_err, state_err=state_err, rho=rho, state_tol=state_tol,
                out_tol=1e-2 + state_tol, conv_equal=torch.equal(twin_conv, kw["conv_state"]))


def _check(res):
    print(res)
    assert res["conv_equal"]
    assert res["state_err"] <= res["state_tol"], res
    assert res["max_out_err"] <= res["out_tol"], res


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_drift_short_cpu(state_dtype, impl):
    _check(drift_run(120 if impl == "triton" else 60, B=2, H=1, K=32, state_dtype=state_dtype, device=DEVICE, impl=impl))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_drift_2000_steps_gpu(state_dtype):
    _check(drift_run(2000, B=4, H=12, K=128, state_dtype=state_dtype, device=DEVICE, impl="triton"))
