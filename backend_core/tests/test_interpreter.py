"""Triton's interpreter reads FP8 NaN bytes as NaN in this project's test sessions (backend_core.interpreter):
without it a poisoned cache page read as +-480 and a stray read could not show on CPU. Also maxNum and BF16
widening as on a GPU."""

import pytest
import torch

from backend_core import platform
from backend_core.interpreter import faithful_interpreter

pytestmark = pytest.mark.skipif(platform.has_gpu() or not platform.triton_available()
                                or not platform.triton_interpreter_enabled(),
                                reason="checks Triton's CPU interpreter (no GPU, Triton installed, TRITON_INTERPRET=1)")


def test_the_session_patched_the_interpreter():
    """conftest applies it; a Triton without the functions this wraps must be noticed, not silently lose it."""
    from backend_core import interpreter

    assert interpreter._patched and interpreter._bf16_patched and faithful_interpreter()
    assert interpreter.scalar_loop_bounds()


def test_bf16_widens_exactly_as_a_gpu_does():
    """Every BF16 pattern widens to FP32 as ``bits << 16`` (Triton 3.6's interpreter lost the 254 subnormal ones)."""
    import triton
    import triton.language as tl

    @triton.jit
    def widen(x, y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y + o, tl.load(x + o).to(tl.float32))

    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    y = torch.zeros(65536)
    widen[(1,)](every, y, N=65536)
    want = every.float()
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))


def test_maxnum_returns_the_number_as_a_gpu_does():
    import triton
    import triton.language as tl

    @triton.jit
    def extremes(x, y, N: tl.constexpr):
        o = tl.arange(0, N)
        a = tl.load(x + o)
        b = tl.load(x + N + o)
        tl.store(y + o, tl.maximum(a, b))
        tl.store(y + N + o, tl.minimum(a, b))

    nan = float("nan")
    x = torch.tensor([nan, 1.0, nan, -3.0, 2.0, nan, nan, 5.0])
    y = torch.zeros(8)
    extremes[(1,)](x, y, N=4)
    assert y[:4].nan_to_num(7.0).tolist() == [2.0, 1.0, 7.0, 5.0]  # NaN only where both are NaN
    assert y[4:].nan_to_num(7.0).tolist() == [2.0, 1.0, 7.0, -3.0]


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


@pytest.mark.filterwarnings("error:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
def test_loop_bounds_read_from_memory_take_the_element():
    """A trip count loaded from memory reaches ``range`` as a 1-element array; ``int()`` of it is deprecated
    in NumPy 2.x and an error from 2.3 (the warning is made an error here, so this fails on older NumPy too
    without the patch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def count(n_ptr, y):
        n = tl.load(n_ptr)
        acc = 0
        for i in range(0, n):
            acc += i
        tl.store(y, acc)

    y = torch.zeros(1, dtype=torch.int32)
    count[(1,)](torch.tensor([5], dtype=torch.int32), y)
    assert y.item() == 10
