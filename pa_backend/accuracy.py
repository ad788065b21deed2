"""``flydsl-backends accuracy`` for the paged-attention ops: a long decode the way a server runs it.

B sequences decode ``steps`` tokens each from short random prompts: every step writes the new token's K/V
through ``write_kv`` (the implementation under test) into FP8 pages scattered over the cache, and runs one
decode through a plan made once for the whole run (shape-only, as under CUDA graphs: the context lengths
grow in place on the device, the block table is as wide as a server's and its entries past each sequence's
pages name other sequences' pages, every unused slot holds NaN bytes). A twin cache is written by the
reference writer and the decode is checked each step against the float64 reference on the twin:

* the two caches stay byte-identical (the writer is exact: same FP8 bytes, same per-token scales);
* every step's output is within the verify tolerance of the float64 reference (attention keeps no state,
  so an error is per step: a bound that does not grow with the context length, which reaches ``steps``);
* nothing is read past a sequence's context (NaN there would poison the output).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, Sequence

import torch

from .fp8 import fp8_dtype_for, fp8_max, fp8_nan_byte

__all__ = ["long_decode", "accuracy_grid", "run_accuracy"]


def long_decode(steps: int, B: int, Hq: int, Hkv: int, D: int, block_size: int, device, impl: str, seed: int = 0,
                scales: str = "tensor", v_layout: str = "4d", progress=None) -> Dict[str, object]:
    """Run the long decode on ``impl``; returns the largest per-step error, the step it happened at, the final
    context lengths and whether the caches stayed byte-identical to the reference writer's."""
    from . import plan_decode, write_kv
    from .contract import prepare_attention
    from .reference import run_attention
    from .verify import tolerance

    device = torch.device(device)
    rng = random.Random(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    fp8 = fp8_dtype_for(device)
    prompts = [rng.randint(1, 2 * block_size) for _ in range(B)]
    finals = [p + steps for p in prompts]
    blocks = [-(-n // block_size) for n in finals]
    NB = sum(blocks) + 4
    perm = list(range(NB))
    rng.shuffle(perm)
    width = max(blocks) * 2 + 3  # a table wider than any sequence needs, as a server's is
    table = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for s, n in enumerate(blocks):
        table[s, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    for s, n in enumerate(blocks):  # entries past a sequence's pages: other sequences' pages (stale ids)
        for j in range(n, width):
            table[s, j] = perm[rng.randrange(at)]
    t_cpu, table = table, table.to(device)  # slots are computed from the host copy (no sync per step)
    nan = fp8_nan_byte(fp8)

    def caches():
        kc = torch.full((NB, Hkv, D // 16, block_size, 16), nan, dtype=torch.uint8, device=device).view(fp8)
        vshape = (NB, Hkv, D, block_size) if v_layout == "4d" else (NB, Hkv, block_size // 16, D, 16)
        vc = torch.full(vshape, nan, dtype=torch.uint8, device=device).view(fp8)
        if scales == "tensor":
            ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.015, device=device)
        else:
            ks = torch.full((NB, Hkv, block_size), float("nan"), device=device)
            vs = torch.full((NB, Hkv, block_size), float("nan"), device=device)
        return kc, vc, ks, vs

    from .registry import WRITE

    writer = impl if impl in WRITE.names() else "auto"  # flydsl has no writer: what auto picks on the device
    test, twin = caches(), caches()
    amp = 0.02 * fp8_max(fp8) / 3

    def write(positions: List[List[int]]):
        rows = [(s, p) for s in range(B) for p in positions[s]]
        if not rows:
            return
        slots = torch.tensor([int(t_cpu[s, p // block_size]) * block_size + p % block_size for s, p in rows],
                             dtype=torch.int64, device=device)
        k = (torch.randn(len(rows), Hkv, D, generator=g) * amp).to(torch.bfloat16).to(device)
        v = (torch.randn(len(rows), Hkv, D, generator=g) * amp * 0.75).to(torch.bfloat16).to(device)
        write_kv(k, v, *test[:2], slots, *test[2:], backend=writer)
        write_kv(k, v, *twin[:2], slots, *twin[2:], backend="torch")

    write([list(range(p - 1)) for p in prompts])  # the prompts but their last token (written by step 0)
    ctx = torch.tensor([p - 1 for p in prompts], dtype=torch.int32, device=device)
    plan = plan_decode(table, ctx, backend=impl)  # once: shape-only, the lengths are read on the device
    out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=device)
    ref = torch.empty(B, Hq, D, dtype=torch.float64, device=device)
    tol = tolerance(device)
    worst, worst_step, over = 0.0, 0, 0
    lens = [p - 1 for p in prompts]
    for step in range(steps):
        write([[n] for n in lens])
        lens = [n + 1 for n in lens]
        ctx.add_(1)
        q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).to(device)
        out.fill_(float("nan"))
        plan.run(q, *test, out=out)
        p = prepare_attention(query=q, key_cache=twin[0], value_cache=twin[1], block_tables=table, context_lengths=ctx,
                              key_scale=twin[2], value_scale=twin[3])
        run_attention(dataclasses.replace(p, out=ref), compute_dtype=torch.float64)
        err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not torch.isfinite(out).all():
            err = float("inf")
        if err > worst:
            worst, worst_step = err, step
        over += err > tol
        if progress and steps >= 10 and (step + 1) % (steps // 10) == 0:
            progress(step + 1)
    same = all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.nan_to_num(1e30),
                           b.view(torch.uint8) if b.element_size() == 1 else b.nan_to_num(1e30))
               for a, b in zip(test, twin))
    return dict(max_out_err=worst, worst_step=worst_step, steps_over_tol=over, tol=tol, caches_equal=same,
                final_context=max(lens))


def accuracy_grid(small: bool) -> List[Dict[str, object]]:
    """``small`` for the CPU interpreter; otherwise GQA 8 at D 128 (and per-token scales with 64-token pages)."""
    if small:
        return [dict(B=2, Hq=4, Hkv=1, D=64, block_size=16),
                dict(B=2, Hq=4, Hkv=2, D=64, block_size=32, scales="token", v_layout="5d")]
    return [dict(B=8, Hq=16, Hkv=2, D=128, block_size=16),
            dict(B=8, Hq=16, Hkv=2, D=128, block_size=64, scales="token", v_layout="5d")]


def run_accuracy(impls: Sequence[str], device: torch.device, steps: int, small: bool, progress=None,
                 step_progress=None) -> List[Dict[str, object]]:
    """Rows {impl, case, ok, out_err, ...}: one per implementation and grid point. An implementation that
    cannot serve the decode is skipped with the reason; ``write_kv`` runs on the same implementation, or on
    what ``auto`` picks where the op has none of that name (flydsl)."""
    from backend_core.ops import accuracy_rows

    from .registry import DECODE

    def run_one(impl, params, tick):
        if impl not in DECODE.names():
            return dict(ok=True, skipped=f"pa_decode has no {impl} implementation")
        try:
            d = long_decode(steps, device=device, impl=impl, progress=tick, **params)
        except ValueError as exc:
            if "cannot serve" in str(exc):  # outside this implementation's coverage: reported, not a failure
                return dict(ok=True, skipped=str(exc))
            raise
        res = dict(out_err=d["max_out_err"], bound=d["tol"], ok=d["max_out_err"] <= d["tol"] and d["caches_equal"],
                   detail=f"worst at step {d['worst_step']}, final context {d['final_context']}")
        if not d["caches_equal"]:
            res["error"] = "the caches differ from the reference writer's"
        return res

    cases = [(f"{steps} steps B={p['B']} Hq={p['Hq']} Hkv={p['Hkv']} D={p['D']} bs={p['block_size']} "
              f"{p.get('scales', 'tensor')} {p.get('v_layout', '4d')}", p) for p in accuracy_grid(small)]
    return accuracy_rows(impls, cases, run_one, steps, progress, step_progress)
