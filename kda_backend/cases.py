"""Inputs and comparisons for KDA decode and verify tests, ``flydsl-backends verify`` and benchmarks.

``make_case`` builds one call's arguments the way the frameworks lay them out: optional
width-major conv_state view (SGLang / vLLM "SD"), page-strided caches (vLLM), heads-outer ``out``
rows, padding and out-of-range rows. Unused cache slots hold a sentinel (1e30) and ``out`` starts
as NaN so that stray reads and unwritten outputs show up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from backend_core.validation import span_elements

SENTINEL = 1e30

__all__ = ["SENTINEL", "KDACase", "make_case", "clone_caches", "rel_err", "compare_runs", "KDAVerifyCase",
           "make_verify_case", "clone_verify", "compare_verify"]


@dataclass
class KDACase:
    kwargs: Dict[str, object]  # keyword arguments of kda_decode / kda_decode_with_f_b
    with_f_b: bool
    live_rows: List[int]
    live_slots: List[int]
    desc: str = ""
    # storage behind the caches (page buffers), to check that nothing outside the views changes
    storage: Dict[str, torch.Tensor] = field(default_factory=dict)

    def problem(self):
        """The validated problem of this call (allocates nothing but ``out`` when it is None)."""
        from .contract import prepare

        kw = dict(self.kwargs)
        kw.setdefault("a", None)
        return prepare(**kw, with_f_b=self.with_f_b)

    def call(self, backend: str = "auto", **overrides):
        from . import kda_decode, kda_decode_with_f_b

        kw = dict(self.kwargs)
        kw.update(overrides)
        fn = kda_decode_with_f_b if self.with_f_b else kda_decode
        return fn(**kw, backend=backend)


def make_case(
    B: int,
    H: int,
    K: int = 128,
    W: int = 4,
    *,
    slots: Optional[int] = None,
    state_dtype: torch.dtype = torch.float32,
    conv: bool = True,
    conv_layout: str = "width",  # "width" (view of [slots, W-1, C]) or "channel" ([slots, C, W-1])
    conv_bias: bool = False,
    norm: bool = True,
    with_f_b: bool = False,
    R: Optional[int] = None,
    lower_bound: Optional[float] = None,
    page_pad: int = 0,  # extra elements per slot (vLLM-style page stride)
    out_layout: str = "batch",  # "batch" ([B, H, V] contiguous) or "heads" (view of [H, B, V])
    padding: Sequence[int] = (),  # rows that are padding
    out_of_range: Sequence[int] = (),  # rows whose index is >= slots
    include_slot0: bool = True,
    index_dtype: torch.dtype = torch.int32,
    device="cpu",
    seed: int = 0,
    state_scale: float = 0.5,
) -> KDACase:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    V = K
    HK = H * K
    C = 3 * HK
    slots = slots if slots is not None else max(2 * B + 3, 4)
    bf16 = torch.bfloat16

    pad_rows = set(padding)
    oor_rows = set(out_of_range)
    live_rows = [n for n in range(B) if n not in pad_rows and n not in oor_rows]
    perm = torch.randperm(slots, generator=g).tolist()
    if include_slot0 and live_rows and 0 in perm:
        perm.remove(0)
        perm.insert(0, 0)  # slot 0 is live
    if len(live_rows) > slots:
        raise ValueError(f"make_case: {len(live_rows)} live rows need at least that many slots, got {slots}")
    live_slots = perm[: len(live_rows)]
    idx = torch.empty(B, dtype=torch.int64)
    for n in range(B):
        if n in pad_rows:
            idx[n] = -1 - (n % 3)
        elif n in oor_rows:
            idx[n] = slots + (n % 5)
    for n, s in zip(live_rows, live_slots):
        idx[n] = s
    state_indices = idx.to(index_dtype).to(device)

    # Recurrent state: [slots, H, V, K] inside pages of H*V*K + page_pad elements.
    slot_elems = HK * V
    state_buf = torch.full((slots, slot_elems + page_pad), SENTINEL, dtype=state_dtype, device=device)
    state = state_buf[:, :slot_elems].view(slots, H, V, K) if page_pad == 0 else \
        torch.as_strided(state_buf, (slots, H, V, K), (slot_elems + page_pad, V * K, K, 1))
    for s in live_slots:
        state[s] = rnd(H, V, K, scale=state_scale, dtype=state_dtype)

    storage = {"state": state_buf}
    kwargs: Dict[str, object] = {}
    x = rnd(B, C, dtype=bf16)
    kwargs["x"] = x
    if conv:
        conv_weight = rnd(C, W, scale=0.5)
        if conv_layout == "width":
            cbuf = torch.full((slots, (W - 1) * C + page_pad), SENTINEL, dtype=bf16, device=device)
            conv_state = torch.as_strided(cbuf, (slots, C, W - 1), ((W - 1) * C + page_pad, 1, C))
        elif conv_layout == "channel":
            cbuf = torch.full((slots, C * (W - 1) + page_pad), SENTINEL, dtype=bf16, device=device)
            conv_state = torch.as_strided(cbuf, (slots, C, W - 1), (C * (W - 1) + page_pad, W - 1, 1))
        else:
            raise ValueError(f"conv_layout: expected 'width' or 'channel', got {conv_layout!r}")
        for s in live_slots:
            conv_state[s] = rnd(C, W - 1, dtype=bf16)
        storage["conv_state"] = cbuf
        kwargs.update(conv_weight=conv_weight, conv_state=conv_state)
        if conv_bias:
            kwargs["conv_bias"] = rnd(C, scale=0.1)
    else:
        kwargs["x"] = torch.nn.functional.silu(x.float()).to(bf16)  # post-conv, activated
        kwargs.update(conv_weight=None, conv_state=None)

    if with_f_b:
        R = R or K
        kwargs["f_a"] = rnd(B, R, dtype=bf16)
        kwargs["f_b_weight"] = rnd(H, K, R, scale=R ** -0.5, dtype=bf16)
    else:
        kwargs["a"] = rnd(B, HK, dtype=bf16)
    kwargs["b"] = rnd(1, B, H, dtype=bf16)  # SGLang's [1, B, H] view
    kwargs["A_log"] = rnd(H, scale=0.5)
    kwargs["dt_bias"] = rnd(HK, scale=0.5)
    kwargs["state"] = state
    kwargs["state_indices"] = state_indices
    if norm:
        kwargs["output_gate"] = rnd(B, H, V, dtype=bf16)
        kwargs["norm_weight"] = (1.0 + rnd(V, scale=0.1)).to(bf16)
    else:
        kwargs["output_gate"] = None
        kwargs["norm_weight"] = None
    if lower_bound is not None:
        kwargs["lower_bound"] = lower_bound
    if out_layout == "batch":
        out = torch.full((B, H, V), float("nan"), dtype=bf16, device=device)
    elif out_layout == "heads":
        out = torch.full((H, B, V), float("nan"), dtype=bf16, device=device).transpose(0, 1)
    else:
        raise ValueError(f"out_layout: expected 'batch' or 'heads', got {out_layout!r}")
    kwargs["out"] = out
    desc = (f"B={B} H={H} K={K} W={W if conv else '-'} state={str(state_dtype).replace('torch.', '')} "
            f"conv={conv_layout if conv else 'off'} norm={'on' if norm else 'off'} f_b={'on' if with_f_b else 'off'}"
            f"{' lb=' + str(lower_bound) if lower_bound is not None else ''}"
            f"{' pad=' + str(page_pad) if page_pad else ''}"
            f" out={out_layout} padding={len(pad_rows) + len(oor_rows)}")
    return KDACase(kwargs=kwargs, with_f_b=with_f_b, live_rows=live_rows, live_slots=live_slots, desc=desc,
                   storage=storage)


def clone_caches(case: KDACase) -> KDACase:
    """A copy of ``case`` whose caches (and their page storage) and ``out`` are fresh copies."""
    kw = dict(case.kwargs)
    storage = {}
    for name, buf in case.storage.items():
        new = buf.clone()
        storage[name] = new
        view = kw[name]
        kw[name] = torch.as_strided(new, view.shape, view.stride(), view.storage_offset() - buf.storage_offset())
    kw["out"] = torch.full_like(case.kwargs["out"], float("nan"))  # keeps the row layout (strides)
    return KDACase(kwargs=kw, with_f_b=case.with_f_b, live_rows=case.live_rows, live_slots=case.live_slots,
                   desc=case.desc, storage=storage)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN anywhere gives inf)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a64).all() or not torch.isfinite(b64).all():
        return float("inf")
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else num


def compare_runs(test: KDACase, ref: KDACase, original: KDACase, *, out_tol: float,
                 state_tol: float) -> Dict[str, object]:
    """Compare two runs of one case (``original`` is the untouched input). Returns errors and 'ok'.

    Checks: output and state of live rows within tolerance, padding rows exactly zero, conv_state
    of live slots bit-identical, and every cache byte outside the live slots' views (other slots,
    page padding) bit-identical to the original.
    """
    res: Dict[str, object] = {}
    live = test.live_rows
    out_t, out_r = test.kwargs["out"], ref.kwargs["out"]
    res["out_err"] = rel_err(out_t[live], out_r[live]) if live else 0.0
    dead = [n for n in range(out_t.shape[0]) if n not in live]
    res["padding_zero"] = bool((out_t[dead] == 0).all().item()) if dead else True
    ls = test.live_slots
    res["state_err"] = rel_err(test.kwargs["state"][ls], ref.kwargs["state"][ls]) if ls else 0.0
    ok = res["out_err"] <= out_tol and res["state_err"] <= state_tol and res["padding_zero"]
    if test.kwargs.get("conv_state") is not None:
        res["conv_exact"] = bool(torch.equal(test.kwargs["conv_state"][ls], ref.kwargs["conv_state"][ls]))
        ok = ok and res["conv_exact"]
    res["untouched_ok"] = all(_untouched(test, original, name) for name in test.storage)
    res["ok"] = bool(ok and res["untouched_ok"])
    return res


def _untouched(test: KDACase, original: KDACase, name: str) -> bool:
    """Bytes of ``name``'s page storage outside the live slots' views equal the original's.

    ``make_case`` lays each slot's view at the start of its storage row, followed by the page
    padding: rows of other slots must be unchanged whole, live rows past the view's span too.
    """
    after, before = test.storage[name], original.storage[name]
    span = span_elements(test.kwargs[name][0])
    dead = torch.ones(after.shape[0], dtype=torch.bool, device=after.device)
    dead[test.live_slots] = False
    live = ~dead
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731  (NaN-safe bitwise compare)
    return bool(torch.equal(as_bytes(after[dead]), as_bytes(before[dead]))
                and torch.equal(as_bytes(after[live][:, span:]), as_bytes(before[live][:, span:])))


# -- the verify op (kda_verify) ----------------------------------------------------------------------------------

@dataclass
class KDAVerifyCase:
    kwargs: Dict[str, object]  # keyword arguments of kda_verify / kda_verify_with_f_b
    with_f_b: bool
    storage: Dict[str, torch.Tensor]  # name -> the buffer behind that argument (caches, step buffers, out)
    live: List[int]  # live requests
    desc: str = ""

    def problem(self):
        from .verify_contract import prepare_verify

        kw = dict(self.kwargs)
        kw.setdefault("a", None)
        return prepare_verify(**kw, with_f_b=self.with_f_b)

    def call(self, backend: str = "auto", **overrides):
        from . import kda_verify, kda_verify_with_f_b

        kw = dict(self.kwargs)
        kw.update(overrides)
        fn = kda_verify_with_f_b if self.with_f_b else kda_verify
        return fn(**kw, backend=backend)


def make_verify_case(
    B: int,
    H: int,
    K: int = 32,
    W: int = 4,
    T: int = 4,
    *,
    form: str = "slot",  # "slot" (vLLM: a state slot per step) or "buffer" (SGLang: step buffers)
    lengths: Optional[Sequence[int]] = None,  # tokens per request (ragged, via query_start_loc); None: all T
    extra_rows: int = 0,  # rows of x after the last request (no request owns them: out stays NaN there)
    accepted: Optional[Sequence[int]] = None,  # num_accepted_tokens per request (slot form)
    tree: bool = False,  # random parent_indices (buffer form)
    state_dtype: torch.dtype = torch.float32,
    conv: bool = True,
    conv_layout: str = "width",  # conv caches as views of width-major buffers, or channel-major
    conv_bias: bool = False,
    norm: bool = True,
    with_f_b: bool = False,
    R: Optional[int] = None,
    lower_bound: Optional[float] = None,
    padding: Sequence[int] = (),  # padding requests (negative slot)
    index_dtype: torch.dtype = torch.int32,
    device="cpu",
    seed: int = 0,
    state_scale: float = 0.5,
) -> KDAVerifyCase:
    """One ``kda_verify`` call laid out as a framework would: the slots a request does not read hold the
    sentinel, step buffers and ``out`` start as NaN, so stray reads and unwritten results show up."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    V, HK = K, H * K
    C = 3 * HK
    bf16 = torch.bfloat16
    lengths = list(lengths) if lengths is not None else [T] * B
    if len(lengths) != B or any(not 0 <= n <= T for n in lengths):
        raise ValueError(f"make_verify_case: lengths {lengths}: expected B={B} entries in 0..{T}")
    live = [n for n in range(B) if n not in set(padding)]
    N = sum(lengths) + extra_rows
    slots = B * T + 3 if form == "slot" else B + 3
    perm = torch.randperm(slots, generator=g).tolist()
    kw: Dict[str, object] = {}
    storage: Dict[str, torch.Tensor] = {}

    state = torch.full((slots, H, V, K), SENTINEL, dtype=state_dtype, device=device)
    L = W - 2 + T if form == "slot" else W - 1
    if conv:
        if conv_layout == "width":
            cbuf = torch.full((slots, L, C), SENTINEL, dtype=bf16, device=device)
            conv_state = cbuf.transpose(1, 2)
        else:
            cbuf = torch.full((slots, C, L), SENTINEL, dtype=bf16, device=device)
            conv_state = cbuf
        storage["conv_state"] = cbuf
    storage["state"] = state

    if form == "slot":
        idx = torch.full((B, T), -1, dtype=torch.int64)
        acc = list(accepted) if accepted is not None else [1] * B
        for n in range(B):
            idx[n] = torch.tensor(perm[n * T:(n + 1) * T])
            if n in padding:
                idx[n, :] = -1 - n % 3
                continue
            s_read = int(idx[n, acc[n] - 1]) if 1 <= acc[n] <= T else None
            if s_read is not None:
                state[s_read] = rnd(H, V, K, scale=state_scale, dtype=state_dtype)
            if conv:
                conv_state[int(idx[n, 0])] = rnd(C, L, dtype=bf16)
        kw["state_indices"] = idx.to(index_dtype).to(device)
        if accepted is not None:
            kw["num_accepted_tokens"] = torch.tensor(acc, dtype=index_dtype, device=device)
    elif form == "buffer":
        idx = torch.tensor(perm[:B], dtype=torch.int64)
        rows = B + 2
        row_idx = torch.randperm(rows, generator=g)[:B]
        for n in range(B):
            if n in padding:
                idx[n] = -1 - n % 3
                continue
            state[int(idx[n])] = rnd(H, V, K, scale=state_scale, dtype=state_dtype)
            if conv:
                conv_state[int(idx[n])] = rnd(C, L, dtype=bf16)
        kw["state_indices"] = idx.to(index_dtype).to(device)
        kw["step_state_indices"] = row_idx.to(index_dtype).to(device)
        step_state = torch.full((rows, T, H, V, K), float("nan"), dtype=state_dtype, device=device)
        kw["step_state"] = step_state
        storage["step_state"] = step_state
        if conv:
            if conv_layout == "width":
                sbuf = torch.full((rows, T, W - 1, C), float("nan"), dtype=bf16, device=device)
                kw["step_conv_state"] = sbuf.transpose(2, 3)
            else:
                sbuf = torch.full((rows, T, C, W - 1), float("nan"), dtype=bf16, device=device)
                kw["step_conv_state"] = sbuf
            storage["step_conv_state"] = sbuf
        if tree:
            par = torch.full((B, T), -1, dtype=torch.int64)
            for n in range(B):
                for t in range(1, T):
                    par[n, t] = int(torch.randint(0, t, (1,), generator=g))
            kw["parent_indices"] = par.to(index_dtype).to(device)
    else:
        raise ValueError(f"form: expected 'slot' or 'buffer', got {form!r}")

    if lengths != [T] * B or extra_rows:
        qsl = [0]
        for n in lengths:
            qsl.append(qsl[-1] + n)
        kw["query_start_loc"] = torch.tensor(qsl, dtype=index_dtype, device=device)
    x = rnd(N, C, dtype=bf16)
    if conv:
        kw.update(x=x, conv_weight=rnd(C, W, scale=0.5), conv_state=conv_state)
        if conv_bias:
            kw["conv_bias"] = rnd(C, scale=0.1)
    else:
        kw.update(x=torch.nn.functional.silu(x.float()).to(bf16), conv_weight=None, conv_state=None)
    if with_f_b:
        R = R or K
        kw["f_a"] = rnd(N, R, dtype=bf16)
        kw["f_b_weight"] = rnd(H, K, R, scale=R ** -0.5, dtype=bf16)
    else:
        kw["a"] = rnd(N, HK, dtype=bf16)
    kw["b"] = rnd(1, N, H, dtype=bf16)
    kw["A_log"] = rnd(H, scale=0.5)
    kw["dt_bias"] = rnd(HK, scale=0.5)
    kw["state"] = state
    if norm:
        kw["output_gate"] = rnd(N, H, V, dtype=bf16)
        kw["norm_weight"] = (1.0 + rnd(V, scale=0.1)).to(bf16)
    else:
        kw["output_gate"] = kw["norm_weight"] = None
    if lower_bound is not None:
        kw["lower_bound"] = lower_bound
    out = torch.full((N, H, V), float("nan"), dtype=bf16, device=device)
    kw["out"] = out
    storage["out"] = out
    desc = (f"{form} B={B} T={T} H={H} K={K} W={W if conv else '-'} state={str(state_dtype).replace('torch.', '')}"
            f" conv={conv_layout if conv else 'off'} norm={'on' if norm else 'off'} f_b={'on' if with_f_b else 'off'}"
            f"{' lb=' + str(lower_bound) if lower_bound is not None else ''}"
            f"{' lengths=' + str(lengths) if lengths != [T] * B else ''}"
            f"{' acc=' + str(list(accepted)) if accepted else ''}"
            f"{' tree' if tree else ''} padding={len(padding)}")
    return KDAVerifyCase(kwargs=kw, with_f_b=with_f_b, storage=storage, live=live, desc=desc)


def clone_verify(case: KDAVerifyCase) -> KDAVerifyCase:
    """A copy of ``case`` whose written buffers (caches, step buffers, out) are fresh copies."""
    kw = dict(case.kwargs)
    storage = {}
    for name, buf in case.storage.items():
        new = buf.clone()
        storage[name] = new
        view = kw[name]
        kw[name] = torch.as_strided(new, view.shape, view.stride(), view.storage_offset() - buf.storage_offset())
    return KDAVerifyCase(kwargs=kw, with_f_b=case.with_f_b, storage=storage, live=case.live, desc=case.desc)


def compare_verify(test: KDAVerifyCase, ref: KDAVerifyCase, original: KDAVerifyCase, *, out_tol: float,
                   state_tol: float) -> Dict[str, object]:
    """Compare two runs of one verify case buffer by buffer (``original``: the untouched input).

    Every element the reference left as it was must be bit-identical in ``test`` (nothing stray written);
    the elements the reference wrote must agree within tolerance (out, states) or exactly (conv windows,
    which are copies); output rows the reference zeroed (padding) must be exactly zero."""
    as_bytes = lambda t: t.contiguous().view(torch.uint8).view(t.numel(), -1)  # noqa: E731  (NaN-safe)
    res: Dict[str, object] = {"ok": True}
    for name, orig in original.storage.items():
        a, r = test.storage[name], ref.storage[name]
        if name in ("conv_state", "step_conv_state"):  # copies of bf16 inputs: the same bytes everywhere
            err = 0.0 if torch.equal(as_bytes(a), as_bytes(r)) else float("inf")
            res[f"{name}_err"] = err
            res["ok"] = bool(res["ok"] and err == 0.0)
            continue
        # a slot (a row x step, an out row) counts as written when the reference changed any of it: a
        # rounded state element may come back bit-identical to the original
        lead = 2 if name == "step_state" else 1
        same = lambda t: (as_bytes(t) == as_bytes(orig)).all(-1).view(orig.shape)  # noqa: E731
        unit_ref = same(r).flatten(lead).all(-1)
        unit_test = same(a).flatten(lead).all(-1)
        untouched = bool((unit_test | ~unit_ref).all().item())
        written = ~unit_ref
        err = rel_err(a[written], r[written]) if bool(written.any()) else 0.0
        tol = out_tol if name == "out" else state_tol
        res[f"{name}_err"] = err
        res[f"{name}_untouched"] = untouched
        res["ok"] = bool(res["ok"] and untouched and err <= tol)
    out_t, out_r = test.storage["out"], ref.storage["out"]
    zero_rows = (out_r == 0).flatten(1).all(-1)
    res["padding_zero"] = bool((out_t[zero_rows] == 0).all().item()) if bool(zero_rows.any()) else True
    res["ok"] = bool(res["ok"] and res["padding_zero"])
    return res
