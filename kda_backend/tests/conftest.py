import pytest
import torch

from backend_core import platform

HAS_GPU = platform.has_gpu()
DEVICE = torch.device("cuda") if HAS_GPU else torch.device("cpu")


def _triton_usable() -> bool:
    from kda_backend import REGISTRY

    return REGISTRY.get("triton").is_available()[0]


IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not _triton_usable(),
                                                                  reason="triton not usable here"))]


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param
