"""A long decode the way a server runs it (``pa_backend.accuracy.long_decode``): one shape-only plan, the cache
written token by token through ``write_kv``, every step against float64 and the cache byte-equal to the
reference writer's."""

import pytest
import torch

from pa_backend import REGISTRY
from pa_backend.accuracy import long_decode

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0],
                                                                  reason="triton not usable here"))]


def _check(res):
    print(res)
    assert res["caches_equal"], res
    assert res["max_out_err"] <= res["tol"], res


@pytest.mark.parametrize("impl", IMPLS)
def test_long_decode_short_cpu(impl):
    _check(long_decode(12, B=2, Hq=4, Hkv=2, D=64, block_size=16, device=DEVICE, impl=impl, scales="token",
                       v_layout="5d"))


@pytest.mark.gpu
@pytest.mark.parametrize("bs,scales,v_layout", [(16, "tensor", "4d"), (64, "token", "5d")])
def test_long_decode_1000_steps_gpu(bs, scales, v_layout):
    _check(long_decode(1000, B=8, Hq=16, Hkv=2, D=128, block_size=bs, device=DEVICE, impl="triton", scales=scales,
                       v_layout=v_layout))
