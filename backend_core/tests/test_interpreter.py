"""Triton's interpreter reads FP8 NaN bytes as NaN in this project's test sessions (backend_core.interpreter):
without it a poisoned cache page read as +-480 and a stray read could not show on CPU."""

import pytest
import torch

from backend_core import platform
from backend_core.interpreter import faithful_fp8_nan

pytestmark = pytest.mark.skipif(platform.has_gpu() or not platform.triton_available()
                                or not platform.triton_interpreter_enabled(),
                                reason="checks Triton's CPU interpreter (no GPU, Triton installed, TRITON_INTERPRET=1)")


def test_the_session_patched_the_interpreter():
    """conftest applies it; a Triton without the converter this wraps must be noticed, not silently lose it."""
    from backend_core import interpreter

    assert interpreter._patched and faithful_fp8_nan()


def test_fp8_bytes_decode_as_torch_decodes_them():
    import triton
    import triton.language as tl

    @triton.jit
    def widen(x, y, N: tl.constexpr):
        o = tl.arange(0, N)
        b = tl.load(x + o)
        tl.store(y + o, b.to(tl.float32))
        tl.store(y + N + o, b.to(tl.float16).to(tl.float32))
        tl.store(y + 2 * N + o, b.to(tl.bfloat16).to(tl.float32))

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    y = torch.zeros(3 * 256)
    widen[(1,)](every, y, N=256)
    want = every.float()
    assert want.isnan().sum() == 2  # 0x7F and 0xFF
    for got in y.view(3, 256):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~want.isnan()], want[~want.isnan()])
