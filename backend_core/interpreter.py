"""Triton's CPU interpreter, made to treat NaN as the GPUs do: FP8 NaN bytes read as NaN, and
``tl.maximum`` / ``tl.minimum`` return the non-NaN operand (IEEE maxNum / minNum, PTX's max / min).

The checks of this project poison every unused cache page with FP8 NaN bytes, so a stray read turns
the output into NaN. Triton 3.6's interpreter decodes FP8 with plain bit arithmetic
(``triton.runtime.interpreter._convert_float``): an e4m3fn NaN (0x7F / 0xFF) reads as +-480, so on
CPU a stray read gave a finite, plausible answer and a kernel's NaN guard could be deleted with every
CPU test still passing. ``faithful_fp8_nan()`` wraps that function so those
bytes decode to NaN; everything else decodes as before. (The interpreter does not take e4m3fnuz, AMD's
FP8 of gfx942, at all: the CPU tests run those kernels only where they compile them.)

The interpreter's maxNum was NaN-propagating ``np.maximum``, so the paged decode's NVIDIA clear of V's
NaN bytes (a maxNum with -448) could not run on CPU at all; with ``faithful_maxnum()`` a test runs it there.

Its BF16 -> FP32 widening lost BF16 subnormals (254 of the 65,536 patterns: 2^-133 read as 0, 5e-39 as 8e-39),
so the Triton KV writer's bytes differed from the reference's for rows of subnormal BF16 on CPU only;
``faithful_bf16_widening()`` makes that widening the exact ``bits << 16`` it is on a GPU.

Its loop bounds read from memory (a kernel's dynamic trip count) reach Python's ``range`` through
``tensor.__index__``, which it writes as ``int(array)`` on a 1-element array: NumPy 2.3 refuses that for arrays
of ndim > 0, so every such kernel failed on CPU with a newer NumPy; ``scalar_loop_bounds()`` takes the one
element instead.

``faithful_interpreter()`` applies all four. Called by the test session (``conftest.py``) and by the CLI when
it routes Triton through the interpreter (``verify`` / ``accuracy`` on a machine without a GPU). Nothing
is patched on a GPU or where Triton is not installed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["faithful_interpreter", "faithful_fp8_nan", "faithful_maxnum", "faithful_bf16_widening",
           "scalar_loop_bounds"]

_patched = False
_bf16_patched = False

# FP8 formats with NaN encodings the interpreter loses: Triton dtype name -> (mask, NaN value after the mask)
_NAN_BYTES = {"fp8e4nv": (0x7F, 0x7F)}  # e4m3fn: S.1111.111


def faithful_interpreter() -> bool:
    """The four patches below; True where all are in place."""
    return faithful_fp8_nan() & faithful_maxnum() & faithful_bf16_widening() & scalar_loop_bounds()


def _index(self) -> int:
    data = self.handle.data
    return int(data.item()) if getattr(data, "size", None) == 1 else int(data)


def scalar_loop_bounds() -> bool:
    """Make the interpreter's ``tensor.__index__`` read a 1-element array's element (``.item()``) instead of
    ``int(array)``, which NumPy >= 2.3 refuses for ndim > 0 (loop bounds loaded from memory). The interpreter
    installs its tensor methods at every launch (``_patch_lang_tensor``, undone after it), so that function is
    wrapped. Idempotent; False where Triton or that function is missing."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return False
    if getattr(patch, "_scalar_index", False):
        return True

    def _patch_lang_tensor(tensor, scope, *args, **kwargs):
        patch(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", _index)

    _patch_lang_tensor._scalar_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


def _wrap_convert_float(make) -> bool:
    """Replace the interpreter's ``_convert_float`` with ``make(the current one)``; False where Triton or that
    function is missing (another Triton version: the conversion then stays as that version does it)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return False
    interpreter._convert_float = make(convert)
    return True


def faithful_bf16_widening() -> bool:
    """Patch the interpreter's float conversion so BF16 -> FP32 is exact (``bits << 16``; Triton 3.6 renormalizes
    BF16 subnormals wrongly). Idempotent; returns whether the patch is in place."""
    global _bf16_patched

    def make(convert):
        import triton.language as tl

        def _convert_float(input, input_dtype, output_dtype, rounding_mode):
            if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
                bits = np.frombuffer(np.ascontiguousarray(input).tobytes(), dtype=np.uint16).astype(np.uint32) << 16
                return bits.reshape(np.shape(input))
            return convert(input, input_dtype, output_dtype, rounding_mode)
        return _convert_float

    _bf16_patched = _bf16_patched or _wrap_convert_float(make)
    return _bf16_patched


def faithful_maxnum() -> bool:
    """Patch the interpreter's ``maxnumf`` / ``minnumf`` (what ``tl.maximum`` / ``tl.minimum`` lower to) to IEEE
    maxNum / minNum, as on NVIDIA GPUs (PTX max / min return the non-NaN operand; Triton 3.6's interpreter uses
    NaN-propagating ``np.maximum``). Then a kernel path that relies on it (the paged decode's NVIDIA clear of V's
    NaN bytes) can run on CPU. Idempotent; False where the interpreter's builder lacks them."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_maxnumf") or not hasattr(builder, "binary_op"):
        return False
    builder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    builder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
    return True


def faithful_fp8_nan() -> bool:
    """Patch the interpreter's float conversion so FP8 NaN bytes decode to NaN (once, idempotent). Returns
    whether the patch is in place."""
    global _patched

    def make(convert):
        def _convert_float(input, input_dtype, output_dtype, rounding_mode):
            out = convert(input, input_dtype, output_dtype, rounding_mode)
            rule = _NAN_BYTES.get(getattr(input_dtype, "name", ""))
            if rule is None or output_dtype.primitive_bitwidth not in (16, 32):
                return out
            mask, value = rule
            nan = (np.frombuffer(np.ascontiguousarray(input).tobytes(), dtype=np.uint8).reshape(np.shape(out))
                   & mask) == value
            if not nan.any():
                return out
            bits = output_dtype.primitive_bitwidth
            if output_dtype.is_bf16():
                nan_bits = np.uint16(0x7FC0)
            else:
                nan_bits = np.array(np.nan, dtype=np.float16 if bits == 16 else np.float32).view(f"uint{bits}")
            out = np.array(out, copy=True)
            out[nan] = nan_bits
            return out
        return _convert_float

    _patched = _patched or _wrap_convert_float(make)
    return _patched
