"""The KDA speculative-verify contract: argument checks and the normalized problem every implementation
receives (docs/design.md §3 for the per-step math, §3.1 for verify).

A verify call runs T decode steps of each of B requests in one launch: request b's draft tokens are rows
``query_start_loc[b] .. query_start_loc[b+1]`` of ``x``, its state stays on chip from one token to the
next, and the state after every token is written where the framework keeps it. Two destination forms
cover vLLM's and SGLang's caches without any per-layer index work in the adapters:

* **slot form** (vLLM: ``step_state`` is None): ``state_indices`` [B, T] names a state slot per step;
  the state after token t goes to slot ``state_indices[b, t]``; the state read first is slot
  ``state_indices[b, num_accepted_tokens[b] - 1]``; the conv window of width W-1 sits at offset
  ``num_accepted_tokens[b] - 1`` of a conv state of width ``W - 2 + T`` in slot ``state_indices[b, 0]``,
  which is rewritten in place as ``[window[1:], x_0, .., x_{T_b-1}]``.
* **buffer form** (SGLang: ``step_state`` given): ``state_indices`` [B] names the committed slot of
  both caches, which are only read; the state after token t goes to ``step_state[step_state_indices[b],
  t]`` and, with the conv stage, the conv window after token t to ``step_conv_state[step_state_indices[b],
  t]``. ``parent_indices`` [B, T] turns the T tokens into a tree (EAGLE, topk > 1): token t continues
  from the state after token ``parent_indices[b, t]`` instead of t - 1.

Validation never reads tensor data on the device (no host sync); everything a kernel could address out
of bounds from device data (T_b, num_accepted_tokens, parents, slots) is clamped or masked in the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from backend_core.validation import (
    CheckMemo,
    arg_key,
    checked_tensor,
    require_data,
    require_disjoint,
    require_float,
    require_int32_span,
    require_non_overlapping,
    require_shape,
    require_unit_stride,
    span_elements,
)

from .contract import (
    ACT_DTYPES,
    INDEX_DTYPES,
    LayerFacts,
    _check_gate,
    _check_norm,
    _check_x_and_state,
    _checked_out,
)
from .registry import VERIFY_REGISTRY

__all__ = ["KDAVerifyProblem", "prepare_verify", "kda_verify", "kda_verify_with_f_b", "MAX_VERIFY_TOKENS"]

MAX_VERIFY_TOKENS = 8  # draft tokens per request: MTP / EAGLE / ngram verify in both frameworks stays below


@dataclass
class KDAVerifyProblem(LayerFacts):
    """A validated KDA verify call. Tensors are the caller's (views, no copies)."""

    B: int  # requests
    T: int  # token capacity per request (the step axis of state_indices / step_state)
    N: int  # token rows of x
    H: int
    K: int
    V: int
    W: int  # conv width; 0 when the conv stage is off
    x: torch.Tensor  # [N, 3HK]
    conv_weight: Optional[torch.Tensor]  # [3HK, W]
    conv_bias: Optional[torch.Tensor]  # [3HK]
    conv_state: Optional[torch.Tensor]  # [slots, 3HK, L] (any strides)
    a: Optional[torch.Tensor]  # [N, HK]
    f_a: Optional[torch.Tensor]  # [N, R]
    f_b_weight: Optional[torch.Tensor]  # [H, K, R]
    b: torch.Tensor  # [N, H] view
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [HK]
    state: torch.Tensor  # [slots, H, V, K]
    state_indices: torch.Tensor  # [B, T] slot form, [B] buffer form
    query_start_loc: Optional[torch.Tensor]  # [B+1]; None: request b is rows b*T .. b*T+T
    num_accepted_tokens: Optional[torch.Tensor]  # [B] (slot form)
    step_state: Optional[torch.Tensor]  # [rows, T, H, V, K] (buffer form)
    step_state_indices: Optional[torch.Tensor]  # [B] (buffer form)
    step_conv_state: Optional[torch.Tensor]  # [rows, T, 3HK, W-1] (buffer form with conv)
    parent_indices: Optional[torch.Tensor]  # [B, T] (buffer form, trees)
    output_gate: Optional[torch.Tensor]  # [N, H, V]
    norm_weight: Optional[torch.Tensor]  # [V]
    lower_bound: Optional[float]
    norm_eps: float
    scale: float
    out: torch.Tensor  # [N, H, V]
    num_slots: int  # slot indices outside [0, num_slots) are padding (slot form: skipped step writes)
    num_rows: int  # step_state_indices outside [0, num_rows) are padding (buffer form)
    largest_piece: Tuple[int, str, str] = (0, "", "")

    @property
    def slot_form(self) -> bool:
        return self.step_state is None

    @property
    def has_parents(self) -> bool:
        return self.parent_indices is not None


def _index(t, name: str, shape, what: str, device):
    t = checked_tensor(t, name, device, INDEX_DTYPES, anchor="x")
    require_shape(t, name, shape, what)
    return t


def _check_forms(state_indices, num_accepted_tokens, step_state, step_state_indices, step_conv_state,
                 parent_indices, query_start_loc, state, has_conv: bool, N: int, H: int, V: int, K: int, device):
    """The destination form, B and T; every index tensor and step buffer checked."""
    state_indices = checked_tensor(state_indices, "state_indices", device, INDEX_DTYPES, anchor="x")
    if step_state is None:
        for name, v in (("step_state_indices", step_state_indices), ("step_conv_state", step_conv_state),
                        ("parent_indices", parent_indices)):
            if v is not None:
                raise ValueError(f"{name}: given without step_state (the per-step buffers and trees belong to the "
                                 "buffer form; the slot form writes each step to state[state_indices[b, t]])")
        if state_indices.dim() != 2:
            raise ValueError(f"state_indices: expected shape [B, T] (one slot per step) when step_state is None, "
                             f"got {list(state_indices.shape)}")
        B, T = (int(s) for s in state_indices.shape)
        if num_accepted_tokens is not None:
            num_accepted_tokens = _index(num_accepted_tokens, "num_accepted_tokens", (B,), "[B]", device)
        rows = 0
    else:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: given with step_state (the buffer form reads the committed "
                             "slot state_indices[b]; num_accepted_tokens belongs to the slot form)")
        if state_indices.dim() != 1:
            raise ValueError(f"state_indices: expected shape [B] (the committed slot) when step_state is given, got "
                             f"{list(state_indices.shape)}")
        B = int(state_indices.shape[0])
        step_state = checked_tensor(step_state, "step_state", device, (state.dtype,), anchor="x")
        if step_state.dim() != 5 or tuple(int(s) for s in step_state.shape[2:]) != (H, V, K):
            raise ValueError(f"step_state: expected shape [rows, T, H, V, K] = [rows, T, {H}, {V}, {K}], got "
                             f"{list(step_state.shape)}")
        if step_state.stride(4) != 1 or step_state.stride(3) != K or step_state.stride(2) != V * K:
            raise ValueError(f"step_state: expected each step's state contiguous (strides [*, *, {V * K}, {K}, 1]), "
                             f"got strides {tuple(step_state.stride())}")
        T = int(step_state.shape[1])
        rows = int(step_state.shape[0])
        if rows < 1:
            raise ValueError("step_state: expected at least one row, got 0")
        require_non_overlapping(step_state, "step_state")
        step_state_indices = _index(step_state_indices, "step_state_indices", (B,), "[B]", device)
        if not has_conv and step_conv_state is not None:
            raise ValueError("step_conv_state: given without conv_weight (the conv stage is off)")
        if parent_indices is not None:
            parent_indices = _index(parent_indices, "parent_indices", (B, T), "[B, T]", device)
    if not 1 <= T <= MAX_VERIFY_TOKENS:
        src = "state_indices [B, T]" if step_state is None else "step_state [rows, T, H, V, K]"
        raise ValueError(f"{src.split()[0]}: expected 1 <= T <= {MAX_VERIFY_TOKENS} tokens per request ({src}), "
                         f"got T={T}")
    if query_start_loc is not None:
        query_start_loc = _index(query_start_loc, "query_start_loc", (B + 1,), "[B+1]", device)
    elif N != B * T:
        raise ValueError(f"x: expected B*T = {B}*{T} = {B * T} rows when query_start_loc is None (every request "
                         f"has T tokens), got {N}")
    return (B, T, rows, state_indices, num_accepted_tokens, step_state, step_state_indices, parent_indices,
            query_start_loc)


def _check_step_conv(step_conv_state, rows: int, T: int, C: int, W: int, device):
    """The per-step conv windows of the buffer form: [rows, T, C, W-1] bf16, any strides."""
    step_conv_state = checked_tensor(step_conv_state, "step_conv_state", device, ACT_DTYPES, anchor="x")
    require_shape(step_conv_state, "step_conv_state", (None, T, C, W - 1), "[rows, T, 3*H*K, W-1]")
    if int(step_conv_state.shape[0]) < 1:
        raise ValueError("step_conv_state: expected at least one row, got 0")
    require_non_overlapping(step_conv_state, "step_conv_state")
    require_int32_span(step_conv_state[0, 0], "step_conv_state", "one step")
    return step_conv_state, min(rows, int(step_conv_state.shape[0]))


def _check_verify_conv(conv_weight, conv_state, conv_bias, C: int, T: int, slot_form: bool, device):
    """The conv stage: conv_state [slots, C, L] with L >= W-2+T in the slot form (the window moves by the
    accepted count), L >= W-1 in the buffer form (read only)."""
    if conv_weight is None:
        if conv_bias is not None:
            raise ValueError("conv_bias: given without conv_weight (the conv stage is off when conv_weight is None)")
        return None, None, None, 0
    conv_weight = checked_tensor(conv_weight, "conv_weight", device, (torch.float32,), anchor="x")
    if conv_weight.dim() != 2 or int(conv_weight.shape[0]) != C:
        raise ValueError(f"conv_weight: expected shape [3*H*K, W] = [{C}, W], got {list(conv_weight.shape)}")
    W = int(conv_weight.shape[1])
    if W < 2:
        raise ValueError(f"conv_weight: expected conv width W >= 2, got W={W}")
    if conv_weight.stride(0) != 1 and conv_weight.stride(1) != 1:
        raise ValueError("conv_weight: expected one unit-stride axis (channel-major or width-major), got strides "
                         f"{tuple(conv_weight.stride())}")
    conv_state = checked_tensor(conv_state, "conv_state", device, ACT_DTYPES, anchor="x")
    need = W - 2 + T if slot_form else W - 1
    what = f"W-2+T = {need}" if slot_form else f"W-1 = {need}"
    if conv_state.dim() != 3 or int(conv_state.shape[1]) != C or int(conv_state.shape[2]) < need:
        raise ValueError(f"conv_state: expected shape [slots, 3*H*K, L] = [slots, {C}, L] with L >= {what}, got "
                         f"{list(conv_state.shape)}")
    if int(conv_state.shape[0]) < 1:
        raise ValueError("conv_state: expected at least one slot, got 0")
    require_non_overlapping(conv_state, "conv_state")
    require_int32_span(conv_state[0], "conv_state", "one slot")
    require_int32_span(conv_weight, "conv_weight")
    if conv_bias is not None:
        conv_bias = checked_tensor(conv_bias, "conv_bias", device, (torch.float32,), anchor="x")
        require_shape(conv_bias, "conv_bias", (C,), "[3*H*K]")
        require_unit_stride(conv_bias, "conv_bias")
    return conv_weight, conv_state, conv_bias, W


_ARG_NAMES = ("x", "conv_weight", "conv_state", "a", "b", "A_log", "dt_bias", "state", "state_indices",
              "output_gate", "norm_weight", "query_start_loc", "num_accepted_tokens", "step_state",
              "step_state_indices", "step_conv_state", "parent_indices", "conv_bias", "lower_bound", "norm_eps",
              "scale", "out", "f_a", "f_b_weight")


def prepare_verify(*, x, conv_weight, conv_state, a, b, A_log, dt_bias, state, state_indices, output_gate,
                   norm_weight, query_start_loc=None, num_accepted_tokens=None, step_state=None,
                   step_state_indices=None, step_conv_state=None, parent_indices=None, conv_bias=None,
                   lower_bound=None, norm_eps=1e-5, scale=None, out=None, f_a=None, f_b_weight=None,
                   with_f_b: bool = False) -> KDAVerifyProblem:
    """Validate a ``kda_verify`` / ``kda_verify_with_f_b`` call and normalize it. Nothing is written.
    Memoized like ``contract.prepare``: each distinct argument set is checked in full once."""
    args = dict(x=x, conv_weight=conv_weight, conv_state=conv_state, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                state=state, state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight,
                query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens, step_state=step_state,
                step_state_indices=step_state_indices, step_conv_state=step_conv_state,
                parent_indices=parent_indices, conv_bias=conv_bias, lower_bound=lower_bound, norm_eps=norm_eps,
                scale=scale, out=out, f_a=f_a, f_b_weight=f_b_weight)
    key = (bool(with_f_b), *(arg_key(args[n]) for n in _ARG_NAMES))
    hit = _VERIFY_MEMO.get(key)
    if hit is None:
        p = _prepare_verify(**args, with_f_b=with_f_b)
        _VERIFY_MEMO.put(key, p.device, (p.B, p.T, p.N, p.H, p.K, p.V, p.W, p.num_slots, p.num_rows,
                                         p.lower_bound, p.norm_eps, p.scale, p.largest_piece))
        return p
    B, T, N, H, K, V, W, num_slots, num_rows, lower_bound, norm_eps, scale, largest_piece = hit
    if out is None:
        out = torch.empty((N, H, V), dtype=x.dtype, device=x.device)
    has_conv = conv_weight is not None
    buffer_form = step_state is not None
    return KDAVerifyProblem(
        B=B, T=T, N=N, H=H, K=K, V=V, W=W, x=x, conv_weight=conv_weight, conv_bias=conv_bias if has_conv else None,
        conv_state=conv_state if has_conv else None, a=None if with_f_b else a, f_a=f_a if with_f_b else None,
        f_b_weight=f_b_weight if with_f_b else None, b=b[0] if b.dim() == 3 else b, A_log=A_log, dt_bias=dt_bias,
        state=state, state_indices=state_indices, query_start_loc=query_start_loc,
        num_accepted_tokens=None if buffer_form else num_accepted_tokens, step_state=step_state,
        step_state_indices=step_state_indices if buffer_form else None,
        step_conv_state=step_conv_state if buffer_form and has_conv else None,
        parent_indices=parent_indices if buffer_form else None, output_gate=output_gate, norm_weight=norm_weight,
        lower_bound=lower_bound, norm_eps=norm_eps, scale=scale, out=out, num_slots=num_slots, num_rows=num_rows,
        largest_piece=largest_piece)


_VERIFY_MEMO = CheckMemo(4096)


def _prepare_verify(*, x, conv_weight, conv_state, a, b, A_log, dt_bias, state, state_indices, output_gate,
                    norm_weight, query_start_loc, num_accepted_tokens, step_state, step_state_indices,
                    step_conv_state, parent_indices, conv_bias, lower_bound, norm_eps, scale, out, f_a, f_b_weight,
                    with_f_b: bool) -> KDAVerifyProblem:
    x, state, N, H, V, K, slots = _check_x_and_state(x, state, dt_bias)
    device = x.device
    C = 3 * H * K
    (B, T, rows, state_indices, num_accepted_tokens, step_state, step_state_indices, parent_indices,
     query_start_loc) = _check_forms(state_indices, num_accepted_tokens, step_state, step_state_indices,
                                     step_conv_state, parent_indices, query_start_loc, state, conv_weight is not None,
                                     N, H, V, K, device)
    conv_weight, conv_state, conv_bias, W = _check_verify_conv(conv_weight, conv_state, conv_bias, C, T,
                                                               step_state is None, device)
    if step_state is not None and conv_weight is not None:
        step_conv_state, rows = _check_step_conv(step_conv_state, rows, T, C, W, device)
    else:
        step_conv_state = None
    num_slots = slots if conv_state is None else min(slots, int(conv_state.shape[0]))
    a, b, A_log, dt_bias, f_a, f_b_weight = _check_gate(a, b, A_log, dt_bias, f_a, f_b_weight, with_f_b, N, H, K,
                                                        device)
    output_gate, norm_weight = _check_norm(output_gate, norm_weight, N, H, V, device)
    lower_bound = require_float(lower_bound, "lower_bound", optional=True)
    norm_eps = require_float(norm_eps, "norm_eps", positive=True)
    scale = require_float(scale, "scale", optional=True)
    if scale is None:
        scale = K ** -0.5
    out = _checked_out(out, x, N, H, V)

    require_int32_span(state[0], "state", "one slot")
    for name, t in (("x", x), ("a", a), ("f_a", f_a), ("output_gate", output_gate), ("out", out)):
        if t is not None and t.shape[0] > 0:
            require_int32_span(t[0], name, "one row")
    require_data(x, "x")
    # the slot form writes state and conv_state; the buffer form only reads them, but a step buffer that
    # aliased them would still corrupt a committed state, so they are disjoint from everything written
    written = [("out", out), ("step_state", step_state), ("step_conv_state", step_conv_state)]
    read = [("x", x), ("conv_weight", conv_weight), ("conv_bias", conv_bias), ("a", a), ("f_a", f_a),
            ("f_b_weight", f_b_weight), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias),
            ("state_indices", state_indices), ("query_start_loc", query_start_loc),
            ("num_accepted_tokens", num_accepted_tokens), ("step_state_indices", step_state_indices),
            ("parent_indices", parent_indices), ("output_gate", output_gate), ("norm_weight", norm_weight)]
    caches = [("state", state), ("conv_state", conv_state)]
    require_disjoint(written + caches, read)

    p = KDAVerifyProblem(
        B=B, T=T, N=N, H=H, K=K, V=V, W=W, x=x, conv_weight=conv_weight, conv_bias=conv_bias, conv_state=conv_state,
        a=a, f_a=f_a, f_b_weight=f_b_weight, b=b, A_log=A_log, dt_bias=dt_bias, state=state,
        state_indices=state_indices, query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens,
        step_state=step_state, step_state_indices=step_state_indices, step_conv_state=step_conv_state,
        parent_indices=parent_indices, output_gate=output_gate, norm_weight=norm_weight, lower_bound=lower_bound,
        norm_eps=norm_eps, scale=scale, out=out, num_slots=num_slots, num_rows=rows)
    pieces = [(span_elements(t) * t.element_size(), name, "the tensor") for name, t in (
        ("conv_weight", conv_weight), ("f_b_weight", f_b_weight)) if t is not None]
    for name, t, what in (("state", state[0], "one slot"), ("conv_state", None if conv_state is None else
                                                           conv_state[0], "one slot"),
                          ("step_state", None if step_state is None else step_state[0, 0], "one step"),
                          ("step_conv_state", None if step_conv_state is None else step_conv_state[0, 0],
                           "one step")):
        if t is not None:
            pieces.append((span_elements(t) * t.element_size(), name, what))
    p.largest_piece = max(pieces)
    return p


# -- the ops ------------------------------------------------------------------------------------------------------

def kda_verify(x, conv_weight, conv_state, a, b, A_log, dt_bias, state, state_indices, output_gate, norm_weight, *,
               query_start_loc=None, num_accepted_tokens=None, step_state=None, step_state_indices=None,
               step_conv_state=None, parent_indices=None, conv_bias=None, lower_bound: Optional[float] = None,
               norm_eps: float = 1e-5, scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
               backend: str = "auto") -> torch.Tensor:
    """One fused KDA speculative-verify step: B requests of up to T draft tokens each (1 <= T <= 8).

    Token n of request b runs the ``kda_decode`` math (conv, SiLU, L2 norms, gate, beta, delta rule,
    readout, gated RMSNorm) on the state its predecessor left, kept on chip; the state after each token
    is rounded to the state dtype (as a decode step stores it) before the next token uses it, so keeping
    the first k tokens equals k ``kda_decode`` steps.

    Shapes (N token rows, H heads, K = V head dim, C = 3*H*K, W conv width, T tokens per request):

    * ``x`` [N, C] bf16, ``a`` [N, H*K] bf16, ``b`` [N, H] (or [1, N, H]) bf16, ``output_gate`` [N, H, V]
      bf16: one row per token, as in ``kda_decode``; ``conv_weight``, ``conv_bias``, ``A_log``,
      ``dt_bias``, ``norm_weight``, ``lower_bound``, ``scale``, ``norm_eps``: as in ``kda_decode``.
    * ``query_start_loc`` [B+1] int32/int64: request b owns rows ``query_start_loc[b] ..
      query_start_loc[b+1]`` (T_b of them, 0 <= T_b <= T; rows past T are not processed). None: every
      request has T tokens and N == B*T. Rows of ``out`` outside every request are not written.
    * ``state`` [slots, H, V, K] fp32 or bf16, contiguous within a slot, any slot stride.
    * Slot form (vLLM), ``step_state`` None: ``state_indices`` [B, T]. The first state is read from slot
      ``state_indices[b, num_accepted_tokens[b] - 1]`` (``num_accepted_tokens`` [B], None means 1); the
      state after token t is **written** to slot ``state_indices[b, t]`` (an index outside [0, min(state
      slots, conv slots)) skips that write: vLLM's null block 0 is mapped to -1 by the adapter).
      ``conv_state`` [slots, C, L], L >= W-2+T (vLLM allocates W-1+num_spec), channel-major
      or the transpose view of a width-major buffer, in slot ``state_indices[b, 0]``: the window is read
      at offset ``num_accepted_tokens[b] - 1`` and the slot is **rewritten** as ``[window[1:], x_0, ..,
      x_{T_b-1}]`` in positions 0 .. W-3+T_b, so the next call's offset (its accepted count - 1) finds
      the window that ends at the last accepted token.
    * Buffer form (SGLang), ``step_state`` [rows, T, H, V, K] (same dtype as ``state``, each step's state
      contiguous, any row and step strides): ``state_indices`` [B] is the committed slot of ``state`` and
      of ``conv_state`` [slots, C, L >= W-1] (window in positions 0 .. W-2); both are only read. The state
      after token t is **written** to ``step_state[step_state_indices[b], t]`` and, with the conv stage,
      the window after token t (W-1 entries, newest last) to ``step_conv_state[step_state_indices[b], t]``
      ([rows, T, C, W-1] bf16, any strides: the transpose view of a [rows, T, W-1, C] buffer works).
      ``parent_indices`` [B, T] (optional): token t >= 1 continues from the state and conv window after
      token ``parent_indices[b, t]`` (an entry outside [0, t) means t-1; column 0 is not read); None: a chain.
    * ``out`` [N, H, V] bf16 (unit stride along V), filled in place and returned; allocated when None.

    Padding: a request whose first-read slot or conv slot is outside [0, min(state slots, conv slots)),
    whose ``num_accepted_tokens`` is outside [1, T], or (buffer form) whose ``step_state_indices`` entry is
    outside the rows of the step buffers, gets zero output rows and changes no cache or buffer.
    Live requests must not share slots or rows. Bad input raises ValueError/TypeError naming the
    argument before anything is written. No host synchronization; a shape-fixed grid (CUDA graphs).

    Example (vLLM-style: B=2 requests of T=3 tokens, H=2, K=V=32, W=4, so C=192 and N=6)::

        idx = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device=dev)  # a slot per step
        acc = torch.tensor([1, 2], dtype=torch.int32, device=dev)  # request 1 accepted 2 tokens last step
        out = kda_verify(x, conv_weight, conv_state, a, b, A_log, dt_bias, state, idx, gate, norm_w,
                         num_accepted_tokens=acc)
        # x [6, 192], conv_state [slots, 192, 5], out [6, 2, 32]; request 1 read slot 5 and wrote its
        # three states to slots 4, 5, 6; its conv slot 4 now ends with x[3], x[4], x[5].
    """
    p = prepare_verify(x=x, conv_weight=conv_weight, conv_state=conv_state, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                       state=state, state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight,
                       query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens,
                       step_state=step_state, step_state_indices=step_state_indices,
                       step_conv_state=step_conv_state, parent_indices=parent_indices, conv_bias=conv_bias,
                       lower_bound=lower_bound, norm_eps=norm_eps, scale=scale, out=out)
    return VERIFY_REGISTRY.select(p, backend, device_type=p.device.type, site_depth=1).run(p)


def kda_verify_with_f_b(f_a, f_b_weight, x, conv_weight, conv_state, b, A_log, dt_bias, state, state_indices,
                        output_gate, norm_weight, *, query_start_loc=None, num_accepted_tokens=None,
                        step_state=None, step_state_indices=None, step_conv_state=None, parent_indices=None,
                        conv_bias=None, lower_bound: Optional[float] = None, norm_eps: float = 1e-5,
                        scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                        backend: str = "auto") -> torch.Tensor:
    """``kda_verify`` with the forget-gate projection fused: ``a[n, h] = f_a[n] @ f_b_weight[h]^T`` in FP32
    (``f_a`` [N, R] bf16, ``f_b_weight`` [H, K, R] bf16), as in ``kda_decode_with_f_b``."""
    p = prepare_verify(x=x, conv_weight=conv_weight, conv_state=conv_state, a=None, b=b, A_log=A_log,
                       dt_bias=dt_bias, state=state, state_indices=state_indices, output_gate=output_gate,
                       norm_weight=norm_weight, query_start_loc=query_start_loc,
                       num_accepted_tokens=num_accepted_tokens, step_state=step_state,
                       step_state_indices=step_state_indices, step_conv_state=step_conv_state,
                       parent_indices=parent_indices, conv_bias=conv_bias, lower_bound=lower_bound,
                       norm_eps=norm_eps, scale=scale, out=out, f_a=f_a, f_b_weight=f_b_weight, with_f_b=True)
    return VERIFY_REGISTRY.select(p, backend, device_type=p.device.type, site_depth=1).run(p)
