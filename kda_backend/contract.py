"""The KDA decode contract: argument validation and the normalized problem every implementation
receives. docs/design.md §3 is the specification; each check below names the argument it rejects.

Validation never reads tensor data on the device (no host sync) except the opt-in debug slot
check (``FLYDSL_BACKENDS_KDA_SLOT_CHECK=1``), which is skipped while a CUDA graph is being captured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from backend_core.validation import (
    CheckMemo,
    arg_key,
    checked_tensor,
    require_data,
    require_disjoint,
    require_dtype,
    require_float,
    require_int32_span,
    require_non_overlapping,
    require_shape,
    require_tensor,
    require_unit_stride,
    span_elements,
)

from .registry import REGISTRY

__all__ = ["KDAProblem", "prepare", "kda_decode", "kda_decode_with_f_b", "SLOT_CHECK", "SLOT_CHECK_PADDING_SLOT",
           "STATE_DTYPES"]

ACT_DTYPES = (torch.bfloat16,)
STATE_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _env_int(name: str, default: Optional[int]) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


# Read once at import: a malformed value fails loudly here, not inside a decode step.
SLOT_CHECK_ENV = "FLYDSL_BACKENDS_KDA_SLOT_CHECK"
SLOT_CHECK_PADDING_ENV = "FLYDSL_BACKENDS_KDA_SLOT_CHECK_PADDING_SLOT"
SLOT_CHECK: bool = bool(_env_int(SLOT_CHECK_ENV, 0))
SLOT_CHECK_PADDING_SLOT: Optional[int] = _env_int(SLOT_CHECK_PADDING_ENV, None)


class LayerFacts:
    """What the decode and verify problems both derive from their tensors."""

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def has_conv(self) -> bool:
        return self.conv_weight is not None

    @property
    def has_norm(self) -> bool:
        return self.norm_weight is not None

    @property
    def has_f_b(self) -> bool:
        return self.f_b_weight is not None

    @property
    def R(self) -> int:
        return 0 if self.f_a is None else int(self.f_a.shape[1])


@dataclass
class KDAProblem(LayerFacts):
    """A validated KDA decode call. Tensors are the caller's (views, no copies)."""

    B: int
    H: int
    K: int
    V: int
    W: int  # conv width; 0 when the conv stage is off
    x: torch.Tensor  # [B, 3HK]
    conv_weight: Optional[torch.Tensor]  # [3HK, W]
    conv_bias: Optional[torch.Tensor]  # [3HK]
    conv_state: Optional[torch.Tensor]  # [slots, 3HK, W-1] (any strides)
    a: Optional[torch.Tensor]  # [B, HK]    (None in the f_b variant)
    f_a: Optional[torch.Tensor]  # [B, R]      (f_b variant)
    f_b_weight: Optional[torch.Tensor]  # [H, K, R] (f_b variant)
    b: torch.Tensor  # [B, H] view
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [HK]
    state: torch.Tensor  # [slots, H, V, K]
    state_indices: torch.Tensor  # [B]
    output_gate: Optional[torch.Tensor]  # [B, H, V]
    norm_weight: Optional[torch.Tensor]  # [V]
    lower_bound: Optional[float]
    norm_eps: float
    scale: float
    out: torch.Tensor  # [B, H, V]
    num_slots: int  # rows with index outside [0, num_slots) are padding
    # (bytes, name, what) of the largest piece a kernel addresses from one base: a whole parameter tensor, one
    # row, one cache slot, one f_b head (the FlyDSL kernel's buffer accesses take 32-bit byte offsets)
    largest_piece: Tuple[int, str, str] = (0, "", "")

    def kernel_tensors(self) -> list:
        """The tensor arguments the kernels take, in their order (x, conv_weight, conv_bias,
        conv_state, a, f_a, f_b_weight, b, A_log, dt_bias, state, state_indices, output_gate,
        norm_weight, out); an absent one is replaced by ``x`` (never read: its stage is compiled out)."""
        d = self.x
        return [t if t is not None else d for t in (
            self.x, self.conv_weight, self.conv_bias, self.conv_state, self.a, self.f_a, self.f_b_weight, self.b,
            self.A_log, self.dt_bias, self.state, self.state_indices, self.output_gate, self.norm_weight, self.out)]

    def kernel_scalars(self) -> list:
        """(num_slots, scale, lower_bound or 0, norm_eps) in the kernels' order."""
        return [int(self.num_slots), float(self.scale),
                float(self.lower_bound if self.lower_bound is not None else 0.0), float(self.norm_eps)]

    def kernel_strides(self) -> list:
        """Element strides in the kernels' order (0 for an absent tensor): x row; conv_weight 0, 1;
        conv_state 0, 1, 2; a row; f_a row; f_b_weight 0, 1; b 0, 1; state slot; state_indices;
        output_gate 0, 1; out 0, 1."""
        def st(t, *dims):
            return [int(t.stride(d)) if t is not None else 0 for d in dims]

        return (st(self.x, 0) + st(self.conv_weight, 0, 1) + st(self.conv_state, 0, 1, 2) + st(self.a, 0)
                + st(self.f_a, 0) + st(self.f_b_weight, 0, 1) + st(self.b, 0, 1) + st(self.state, 0)
                + st(self.state_indices, 0) + st(self.output_gate, 0, 1) + st(self.out, 0, 1))


def _check_x_and_state(x, state, dt_bias=None):
    """x [B, 3*H*K] and the recurrent state [slots, H, V, K] fix B, H, K, V. When they disagree, ``dt_bias``
    [H*K] (checked fully later) says which one is wrong: the error names ``state`` when x agrees with it."""
    x = require_tensor(x, "x")
    require_dtype(x, "x", ACT_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"x: expected shape [B, 3*H*K], got {list(x.shape)}")
    require_unit_stride(x, "x")
    B = int(x.shape[0])
    state = checked_tensor(state, "state", x.device, STATE_DTYPES, anchor="x")
    if state.dim() != 4:
        raise ValueError(f"state: expected shape [slots, H, V, K], got {list(state.shape)}")
    slots, H, V, K = (int(s) for s in state.shape)
    if slots < 1 or H < 1 or K < 1:
        raise ValueError(f"state: expected a non-empty [slots, H, V, K], got {list(state.shape)}")
    if V != K:
        raise ValueError(f"state: expected V == K (one head dim for keys and values), got V={V}, K={K}")
    if state.stride(3) != 1 or state.stride(2) != K or state.stride(1) != V * K:
        raise ValueError(
            f"state: expected each slot contiguous (strides [*, {V * K}, {K}, 1]), got strides {tuple(state.stride())}"
        )
    if slots > 1 and state.stride(0) < H * V * K:
        raise ValueError(
            f"state: slots overlap (slot stride {state.stride(0)} < slot size {H * V * K} elements)"
        )
    C = int(x.shape[1])
    if C != 3 * H * K and C % 3 == 0 and isinstance(dt_bias, torch.Tensor) and tuple(dt_bias.shape) == (C // 3,):
        raise ValueError(f"state: expected [slots, H, V, K] with H*K = {C // 3} (x [B, 3*H*K] and dt_bias [H*K] "
                         f"say so), got {list(state.shape)}")
    require_shape(x, "x", (B, 3 * H * K), "[B, 3*H*K]")
    return x, state, B, H, V, K, slots


def _check_conv(conv_weight, conv_state, conv_bias, C: int, slots: int, device):
    """The conv stage (off when conv_weight is None: conv_state is then not touched).
    Returns (conv_weight, conv_state, conv_bias, W, live slot count)."""
    if conv_weight is None:
        if conv_bias is not None:
            raise ValueError("conv_bias: given without conv_weight (the conv stage is off when conv_weight is None)")
        return None, None, None, 0, slots
    conv_weight = checked_tensor(conv_weight, "conv_weight", device, (torch.float32,), anchor="x")
    if conv_weight.dim() != 2 or int(conv_weight.shape[0]) != C:
        raise ValueError(f"conv_weight: expected shape [3*H*K, W] = [{C}, W], got {list(conv_weight.shape)}")
    W = int(conv_weight.shape[1])
    if W < 2:
        raise ValueError(f"conv_weight: expected conv width W >= 2, got W={W}")
    if conv_weight.stride(0) != 1 and conv_weight.stride(1) != 1:
        raise ValueError(
            "conv_weight: expected one unit-stride axis (channel-major or width-major), got strides "
            f"{tuple(conv_weight.stride())}"
        )
    conv_state = checked_tensor(conv_state, "conv_state", device, ACT_DTYPES, anchor="x")
    if conv_state.dim() == 3 and int(conv_state.shape[1]) == C and int(conv_state.shape[2]) != W - 1:
        # only the conv width disagrees, and nothing else carries it: either argument may be the wrong one
        raise ValueError(f"conv_weight / conv_state: the conv width disagrees: conv_weight [3*H*K, W] = "
                         f"{list(conv_weight.shape)} has W={W}, conv_state [slots, 3*H*K, W-1] = "
                         f"{list(conv_state.shape)} has W-1={int(conv_state.shape[2])}")
    if conv_state.dim() != 3 or int(conv_state.shape[1]) != C or int(conv_state.shape[2]) != W - 1:
        raise ValueError(
            f"conv_state: expected shape [slots, 3*H*K, W-1] = [slots, {C}, {W - 1}], got {list(conv_state.shape)}"
        )
    if int(conv_state.shape[0]) < 1:
        raise ValueError("conv_state: expected at least one slot, got 0")
    require_non_overlapping(conv_state, "conv_state")
    require_int32_span(conv_state[0], "conv_state", "one slot")
    require_int32_span(conv_weight, "conv_weight")
    if conv_bias is not None:
        conv_bias = checked_tensor(conv_bias, "conv_bias", device, (torch.float32,), anchor="x")
        require_shape(conv_bias, "conv_bias", (C,), "[3*H*K]")
        require_unit_stride(conv_bias, "conv_bias")
    return conv_weight, conv_state, conv_bias, W, min(slots, int(conv_state.shape[0]))


def _check_gate(a, b, A_log, dt_bias, f_a, f_b_weight, with_f_b: bool, B: int, H: int, K: int, device):
    """The gate inputs: ``a`` [B, H*K], or ``f_a`` [B, R] and ``f_b_weight`` [H, K, R]; ``b``; A_log; dt_bias."""
    if with_f_b:
        f_a = checked_tensor(f_a, "f_a", device, ACT_DTYPES, anchor="x")
        if f_a.dim() != 2 or int(f_a.shape[0]) != B or int(f_a.shape[1]) < 1:
            raise ValueError(f"f_a: expected shape [B, R] with B={B}, got {list(f_a.shape)}")
        require_unit_stride(f_a, "f_a")
        R = int(f_a.shape[1])
        f_b_weight = checked_tensor(f_b_weight, "f_b_weight", device, ACT_DTYPES, anchor="x")
        if f_b_weight.dim() == 3 and tuple(f_b_weight.shape[:2]) == (H, K) and int(f_b_weight.shape[2]) != R:
            # only the rank disagrees, and nothing else carries it: either argument may be the wrong one
            raise ValueError(f"f_a / f_b_weight: the rank R disagrees: f_a [B, R] = {list(f_a.shape)} has R={R}, "
                             f"f_b_weight [H, K, R] = {list(f_b_weight.shape)} has R={int(f_b_weight.shape[2])}")
        require_shape(f_b_weight, "f_b_weight", (H, K, R), "[H, K, R]")
        require_unit_stride(f_b_weight, "f_b_weight")
        require_non_overlapping(f_b_weight, "f_b_weight")
        require_int32_span(f_b_weight, "f_b_weight")
        a = None
    else:
        a = checked_tensor(a, "a", device, ACT_DTYPES, anchor="x")
        require_shape(a, "a", (B, H * K), "[B, H*K]")
        require_unit_stride(a, "a")
        f_a = f_b_weight = None
    b = checked_tensor(b, "b", device, ACT_DTYPES, anchor="x")
    if b.dim() == 3 and int(b.shape[0]) == 1:
        b = b[0]
    require_shape(b, "b", (B, H), "[B, H] or [1, B, H]")
    A_log = checked_tensor(A_log, "A_log", device, (torch.float32,), anchor="x")
    require_shape(A_log, "A_log", (H,), "[H]")
    require_unit_stride(A_log, "A_log")
    dt_bias = checked_tensor(dt_bias, "dt_bias", device, (torch.float32,), anchor="x")
    require_shape(dt_bias, "dt_bias", (H * K,), "[H*K]")
    require_unit_stride(dt_bias, "dt_bias")
    return a, b, A_log, dt_bias, f_a, f_b_weight


def _check_norm(output_gate, norm_weight, B: int, H: int, V: int, device):
    """The gated-norm stage: both or neither of output_gate [B, H, V] and norm_weight [V]."""
    if (output_gate is None) != (norm_weight is None):
        missing = "norm_weight" if norm_weight is None else "output_gate"
        raise ValueError(f"{missing}: output_gate and norm_weight go together (both for the gated norm, neither for "
                         "raw o)")
    if output_gate is None:
        return None, None
    output_gate = checked_tensor(output_gate, "output_gate", device, ACT_DTYPES, anchor="x")
    require_shape(output_gate, "output_gate", (B, H, V), "[B, H, V]")
    require_unit_stride(output_gate, "output_gate")
    norm_weight = checked_tensor(norm_weight, "norm_weight", device, (torch.bfloat16, torch.float32), anchor="x")
    require_shape(norm_weight, "norm_weight", (V,), "[V]")
    require_unit_stride(norm_weight, "norm_weight")
    return output_gate, norm_weight


def _checked_out(out, x, B: int, H: int, V: int):
    if out is None:
        return torch.empty((B, H, V), dtype=x.dtype, device=x.device)
    out = checked_tensor(out, "out", x.device, (x.dtype,), anchor="x")
    require_shape(out, "out", (B, H, V), "[B, H, V]")
    require_unit_stride(out, "out")
    require_non_overlapping(out, "out")
    return out


def prepare(
    *,
    x,
    conv_weight,
    conv_state,
    a,
    b,
    A_log,
    dt_bias,
    state,
    state_indices,
    output_gate,
    norm_weight,
    conv_bias=None,
    lower_bound=None,
    norm_eps=1e-5,
    scale=None,
    out=None,
    f_a=None,
    f_b_weight=None,
    with_f_b: bool = False,
) -> KDAProblem:
    """Validate a ``kda_decode`` / ``kda_decode_with_f_b`` call and normalize it. Nothing is written.

    Memoized on what the checks read (``backend_core.validation.CheckMemo``: every tensor's address,
    shape, strides, dtype and device, every other argument with its type): a server's decode step
    passes the same buffers layer after layer, step after step, so each distinct call is checked in
    full once and later ones only rebuild the problem around the caller's tensors."""
    args = (x, conv_weight, conv_state, a, b, A_log, dt_bias, state, state_indices, output_gate, norm_weight,
            conv_bias, lower_bound, norm_eps, scale, out, f_a, f_b_weight)
    key = (bool(with_f_b), *(arg_key(v) for v in args))
    hit = _CALL_MEMO.get(key)
    if hit is None:
        problem = _prepare(*args, with_f_b=with_f_b)
        _CALL_MEMO.put(key, problem.device, (problem.B, problem.H, problem.K, problem.V, problem.W, problem.num_slots,
                                             problem.lower_bound, problem.norm_eps, problem.scale,
                                             problem.largest_piece))
    else:
        B, H, K, V, W, num_slots, lower_bound, norm_eps, scale, largest_piece = hit
        if out is None:
            out = torch.empty((B, H, V), dtype=x.dtype, device=x.device)
        has_conv = conv_weight is not None
        problem = KDAProblem(
            B=B, H=H, K=K, V=V, W=W, x=x, conv_weight=conv_weight, conv_bias=conv_bias if has_conv else None,
            conv_state=conv_state if has_conv else None, a=None if with_f_b else a,
            f_a=f_a if with_f_b else None, f_b_weight=f_b_weight if with_f_b else None,
            b=b[0] if b.dim() == 3 else b, A_log=A_log, dt_bias=dt_bias, state=state, state_indices=state_indices,
            output_gate=output_gate, norm_weight=norm_weight, lower_bound=lower_bound, norm_eps=norm_eps,
            scale=scale, out=out, num_slots=num_slots, largest_piece=largest_piece,
        )
    if SLOT_CHECK:
        check_unique_slots(problem, SLOT_CHECK_PADDING_SLOT)
    return problem


_CALL_MEMO = CheckMemo(4096)  # (KDA layers x decode batch sizes) of a few models


def _prepare(x, conv_weight, conv_state, a, b, A_log, dt_bias, state, state_indices, output_gate, norm_weight,
             conv_bias, lower_bound, norm_eps, scale, out, f_a, f_b_weight, *, with_f_b: bool) -> KDAProblem:
    x, state, B, H, V, K, slots = _check_x_and_state(x, state, dt_bias)
    device = x.device
    state_indices = checked_tensor(state_indices, "state_indices", device, INDEX_DTYPES, anchor="x")
    require_shape(state_indices, "state_indices", (B,), "[B]")
    conv_weight, conv_state, conv_bias, W, num_slots = _check_conv(conv_weight, conv_state, conv_bias, 3 * H * K,
                                                                   slots, device)
    a, b, A_log, dt_bias, f_a, f_b_weight = _check_gate(a, b, A_log, dt_bias, f_a, f_b_weight, with_f_b, B, H, K,
                                                        device)
    output_gate, norm_weight = _check_norm(output_gate, norm_weight, B, H, V, device)
    lower_bound = require_float(lower_bound, "lower_bound", optional=True)
    norm_eps = require_float(norm_eps, "norm_eps", positive=True)
    scale = require_float(scale, "scale", optional=True)
    if scale is None:
        scale = K ** -0.5
    out = _checked_out(out, x, B, H, V)

    # offsets inside one slot and one row are 32-bit in the kernels (rows and slots: 64-bit)
    require_int32_span(state[0], "state", "one slot")
    for name, t in (("x", x), ("a", a), ("f_a", f_a), ("output_gate", output_gate), ("out", out)):
        if t is not None and t.shape[0] > 0:
            require_int32_span(t[0], name, "one row")

    require_data(x, "x")  # shapes and strides are checked on meta tensors too
    # outputs and in-place caches share no memory with any other argument (no host sync)
    require_disjoint(
        [("out", out), ("state", state), ("conv_state", conv_state)],
        [("x", x), ("conv_weight", conv_weight), ("conv_bias", conv_bias), ("a", a), ("f_a", f_a),
         ("f_b_weight", f_b_weight), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias),
         ("state_indices", state_indices), ("output_gate", output_gate), ("norm_weight", norm_weight)])

    problem = KDAProblem(
        B=B, H=H, K=K, V=V, W=W, x=x, conv_weight=conv_weight, conv_bias=conv_bias, conv_state=conv_state,
        a=a, f_a=f_a, f_b_weight=f_b_weight, b=b,
        A_log=A_log, dt_bias=dt_bias, state=state, state_indices=state_indices,
        output_gate=output_gate, norm_weight=norm_weight, lower_bound=lower_bound,
        norm_eps=norm_eps, scale=scale, out=out, num_slots=num_slots,
    )
    problem.largest_piece = max((span_elements(t) * t.element_size(), name, what)
                                for name, t, what in _pieces(problem))
    return problem


def _pieces(p: KDAProblem):
    """(name, tensor, what) of every piece a kernel addresses from one base: whole parameter tensors, one row
    of the per-row tensors, one slot of the caches, one head of f_b_weight."""
    for name, t in (("conv_weight", p.conv_weight), ("conv_bias", p.conv_bias), ("dt_bias", p.dt_bias),
                    ("A_log", p.A_log), ("norm_weight", p.norm_weight)):
        if t is not None:
            yield name, t, "the tensor"
    for name, t in (("x", p.x), ("a", p.a), ("f_a", p.f_a), ("output_gate", p.output_gate), ("out", p.out)):
        if t is not None and t.shape[0] > 0:
            yield name, t[0], "one row"
    for name, t in (("conv_state", p.conv_state), ("state", p.state)):
        if t is not None and t.shape[0] > 0:
            yield name, t[0], "one slot"
    if p.f_b_weight is not None:
        yield "f_b_weight", p.f_b_weight[0], "one head"


def check_unique_slots(p: KDAProblem, padding_slot: Optional[int]) -> None:
    """Debug check (host sync): live rows must use distinct slots, except ``padding_slot``."""
    if p.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    idx = p.state_indices.detach().to("cpu", torch.int64)
    live = idx[(idx >= 0) & (idx < p.num_slots)]
    if padding_slot is not None:
        live = live[live != padding_slot]
    uniq, counts = torch.unique(live, return_counts=True)
    dup = uniq[counts > 1]
    if dup.numel():
        raise ValueError(
            f"state_indices: live rows share slots {dup.tolist()[:8]} ({SLOT_CHECK_ENV}=1; "
            f"set {SLOT_CHECK_PADDING_ENV}=<n> if one scratch slot may repeat)"
        )


# -- the ops: checked here, then run by the implementation the registry chooses ---------------------------------

def kda_decode(x, conv_weight, conv_state, a, b, A_log, dt_bias, state, state_indices, output_gate, norm_weight, *,
               conv_bias=None, lower_bound: Optional[float] = None, norm_eps: float = 1e-5,
               scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
               backend: str = "auto") -> torch.Tensor:
    """One fused KDA decode step for B single-token requests (docs/design.md §3).

    Shapes (H heads, K = V head dim, C = 3*H*K channels, W conv width):

    * ``x`` [B, C] bf16: q | k | v channels, pre-conv (or post-conv and activated when
      ``conv_weight`` is None).
    * ``conv_weight`` [C, W] fp32 or None; ``conv_bias`` [C] fp32 or None.
    * ``conv_state`` [slots, C, W-1] bf16, channel-major or the ``transpose(-1, -2)`` view of a
      width-major [slots, W-1, C] buffer, any slot stride. **Updated in place** (window shifted,
      x appended) for live rows; ignored when ``conv_weight`` is None.
    * ``a`` [B, H*K] bf16 raw forget gate; ``b`` [B, H] (or [1, B, H]) bf16 raw beta.
    * ``A_log`` [H] fp32; ``dt_bias`` [H*K] fp32.
    * ``state`` [slots, H, V, K] fp32 or bf16, contiguous within a slot, any slot stride.
      **Updated in place** for live rows (FP32 math; bf16 rounded once on store).
    * ``state_indices`` [B] int32 (or int64): slot of each row. A row whose index is negative or
      >= the number of slots (the smaller of the two caches) is padding: its output row is zero
      and neither cache changes. Slot 0 is a live slot.
    * ``output_gate`` [B, H, V] bf16 and ``norm_weight`` [V] bf16: the sigmoid-gated RMSNorm;
      both None returns the raw readout ``o``.
    * ``lower_bound``: the safe gate ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``
      instead of ``-exp(A_log) * softplus(a + dt_bias)``.
    * ``scale`` defaults to K**-0.5; ``norm_eps`` to 1e-5.
    * ``out`` [B, H, V] bf16, any disjoint row layout with unit stride along V, filled in place
      and returned; allocated when None.

    Live rows must use distinct slots: two rows on one slot race on a GPU (the last writer wins; the
    reference applies them in row order). ``FLYDSL_BACKENDS_KDA_SLOT_CHECK=1`` checks it, with a host sync.
    Bad input raises ValueError/TypeError naming the argument before anything is written.
    No host synchronization and a shape-fixed grid: safe inside CUDA-graph capture.
    """
    p = prepare(x=x, conv_weight=conv_weight, conv_state=conv_state, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                state=state, state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight,
                conv_bias=conv_bias, lower_bound=lower_bound, norm_eps=norm_eps, scale=scale, out=out)
    return REGISTRY.select(p, backend, device_type=p.device.type, site_depth=1).run(p)


def kda_decode_with_f_b(f_a, f_b_weight, x, conv_weight, conv_state, b, A_log, dt_bias, state, state_indices,
                        output_gate, norm_weight, *, conv_bias=None, lower_bound: Optional[float] = None,
                        norm_eps: float = 1e-5, scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                        backend: str = "auto") -> torch.Tensor:
    """``kda_decode`` with the forget-gate projection fused: ``a[n, h] = f_a[n] @ f_b_weight[h]^T``.

    ``f_a`` [B, R] bf16 and ``f_b_weight`` [H, K, R] bf16 replace ``a``; the product is formed in
    FP32 inside the kernel and never rounded to bf16 or written to memory. Everything else is as
    in :func:`kda_decode`.
    """
    p = prepare(x=x, conv_weight=conv_weight, conv_state=conv_state, a=None, b=b, A_log=A_log, dt_bias=dt_bias,
                state=state, state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight,
                conv_bias=conv_bias, lower_bound=lower_bound, norm_eps=norm_eps, scale=scale, out=out,
                f_a=f_a, f_b_weight=f_b_weight, with_f_b=True)
    return REGISTRY.select(p, backend, device_type=p.device.type, site_depth=1).run(p)
