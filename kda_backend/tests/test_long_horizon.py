"""Long-horizon drift: many decode steps of one KDA layer, kernel vs the same recurrence in float64
(``kda_backend.accuracy.drift``, whose docstring gives the bounds' reasoning: rounding noise stays within
u / sqrt(1 - rho**2) whatever the step count; a drift that grows with the steps, a bias, fails them long
before 2,000 steps)."""

import pytest
import torch

from kda_backend.accuracy import drift

from .conftest import DEVICE


def drift_run(steps, B, H, K, state_dtype, device, impl, seed=0, with_f_b=False):
    return drift(steps, B, H, K, state_dtype, device, impl, seed=seed, with_f_b=with_f_b)


def _check(res):
    print(res)
    assert res["conv_equal"] and res["padding_zero"]
    assert res["state_err"] <= res["state_tol"], res
    assert res["max_out_err"] <= res["out_tol"], res


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_drift_short_cpu(state_dtype, impl):
    _check(drift_run(120 if impl == "triton" else 60, B=2, H=1, K=32, state_dtype=state_dtype, device=DEVICE,
                     impl=impl))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_drift_2000_steps_gpu(state_dtype):
    _check(drift_run(2000, B=4, H=12, K=128, state_dtype=state_dtype, device=DEVICE, impl="triton"))
