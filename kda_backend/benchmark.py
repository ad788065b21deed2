"""``flydsl-backends bench kda``: the fused KDA decode step timed by CUDA-graph replay.

Each configuration rotates over enough independent state pools (>= 256 MB touched per cycle) that
the L2 cache cannot hold the working set between calls, as in a real model where other layers run
in between. Bytes are counted logically: every input read once, every cache row read and written
once, weights once.

When ``fla`` (fla-core) is importable, the composed chain a user would otherwise run is timed in
the same process on the same shapes: fla's ``causal_conv1d_update`` (on a contiguous per-row cache,
the layout it supports), ``fused_recurrent_kda_fwd`` (gate, beta sigmoid and q/k L2-norm in
kernel, state updated in place through slot indices) and ``rms_norm_gated`` (sigmoid); the f_b
variant adds the f_a @ f_b^T projection as a torch matmul.
"""

from __future__ import annotations

import math
import sys
from typing import Dict, List, Optional, Sequence

import torch

from backend_core.timing import bench_context, result_row, time_cuda_graph

from .cases import make_case

__all__ = ["run_bench", "step_bytes"]

TOUCH_BYTES = 256 << 20


def step_bytes(B: int, H: int, K: int, W: int, state_elt: int, with_f_b: bool, R: int) -> int:
    C = 3 * H * K
    n = 2 * B * H * K * K * state_elt  # state read + write
    n += 2 * B * C * (W - 1) * 2  # conv window read + write (bf16)
    n += B * C * 2 + C * W * 4  # x, conv weight
    n += (B * R * 2 + H * K * R * 2) if with_f_b else B * H * K * 2  # gate input
    n += B * H * 2 + H * K * 4 + H * 4  # b, dt_bias, A_log
    n += 2 * B * H * K * 2 + K * 2  # output gate, out, norm weight
    n += B * 4  # indices
    return n


def _fla_chain(case_sets, H: int, K: int, with_f_b: bool):
    """Build a callable i -> one composed fla step on input set i (or None if fla is missing)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:
        return None
    prepared = []
    for c in case_sets:
        kw = c.kwargs
        B = kw["x"].shape[0]
        C = 3 * H * K
        W = kw["conv_weight"].shape[1]
        cache = torch.randn(B, C, W, device=kw["x"].device).to(torch.bfloat16)  # fla keeps W entries
        prepared.append((kw, cache))

    def step(i: int):
        kw, cache = prepared[i % len(prepared)]
        B = kw["x"].shape[0]
        y, _ = causal_conv1d_update(kw["x"], cache, weight=kw["conv_weight"], bias=None, activation="silu")
        q, k, v = (t.contiguous().view(B, 1, H, K) for t in y.split(H * K, dim=-1))
        if with_f_b:
            a = torch.matmul(kw["f_a"], kw["f_b_weight"].view(H * K, -1).t())
        else:
            a = kw["a"]
        o, _ = fused_recurrent_kda_fwd(
            q=q, k=k, v=v, g=a.view(B, 1, H, K), beta=kw["b"].reshape(B, 1, H).contiguous(), A_log=kw["A_log"],
            dt_bias=kw["dt_bias"], initial_state=kw["state"], scale=K ** -0.5, inplace_final_state=True,
            ssm_state_indices=kw["state_indices"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, state_v_first=True, lower_bound=kw.get("lower_bound"))
        return rms_norm_gated(x=o, g=kw["output_gate"].view(B, 1, H, K), weight=kw["norm_weight"], bias=None,
                              activation="sigmoid", eps=1e-5)

    return step


def run_bench(batches: Sequence[int] = (1, 32, 128), H: int = 12, K: int = 128, W: int = 4,
              state_dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
              f_b_modes: Sequence[bool] = (False, True), lower_bound: Optional[float] = None,
              impls: Sequence[str] = ("triton",), trials: int = 50, with_fla: bool = True,
              progress=print) -> List[Dict[str, object]]:
    """Time every configuration; return CSV rows (see backend_core.timing.RESULT_FIELDS)."""
    from .api import REGISTRY

    run = bench_context(progress)
    dev, copy = run.device, run.copy_gbps
    rows: List[Dict[str, object]] = []
    for state_dtype in state_dtypes:
        elt = torch.empty((), dtype=state_dtype).element_size()
        for with_f_b in f_b_modes:
            for B in batches:
                per_set = B * H * K * K * elt
                n_sets = max(2, min(64, math.ceil(TOUCH_BYTES / per_set)))
                sets = [make_case(B, H, K, W, slots=B, state_dtype=state_dtype, with_f_b=with_f_b,
                                  lower_bound=lower_bound, include_slot0=True, device=dev, seed=s,
                                  state_scale=0.1) for s in range(n_sets)]
                inner = max(n_sets, 16)
                nbytes = step_bytes(B, H, K, W, elt, with_f_b, K)
                shape = (f"B={B} H={H} K=V={K} W={W} state={str(state_dtype).replace('torch.', '')} "
                         f"f_b={'on' if with_f_b else 'off'}{' lb' if lower_bound is not None else ''}")
                floor_us = nbytes / (copy * 1e9) * 1e6
                measured: Dict[str, float] = {}
                for impl in impls:
                    ok, why = REGISTRY.get(impl).can_serve(sets[0].problem())
                    if not ok:
                        progress(f"  {shape}: {impl} skipped ({why})")
                        continue
                    t = time_cuda_graph(lambda i: sets[i % n_sets].call(impl), inner=inner, trials=trials, device=dev)
                    measured[impl] = t.median_us
                    rows.append(result_row(run, "kda_decode", impl, shape, t, nbytes, f"copy floor {floor_us:.2f} us"))
                if with_fla:
                    chain = _fla_chain(sets, H, K, with_f_b)
                    if chain is None:
                        progress("  fla (fla-core) not importable: composed-chain baseline skipped")
                        with_fla = False
                    else:
                        t = time_cuda_graph(chain, inner=inner, trials=trials, device=dev)
                        measured["fla_chain"] = t.median_us
                        rows.append(result_row(run, "kda_decode", "fla_chain", shape, t, nbytes,
                                               "fla causal_conv1d_update + fused_recurrent_kda_fwd + rms_norm_gated"))
                line = f"  {shape}: " + ", ".join(f"{k} {v:.2f} us" for k, v in measured.items())
                line += f" | copy floor {floor_us:.2f} us"
                if "fla_chain" in measured:
                    for k, v in measured.items():
                        if k != "fla_chain":
                            line += f" | {k} {measured['fla_chain'] / v:.2f}x faster than fla"
                progress(line)
                sets = None  # the cases' tensors go before the next shape allocates
                torch.cuda.empty_cache()
    return rows


def add_bench_args(parser) -> None:
    """``flydsl-backends bench kda`` flags."""
    from backend_core.cliargs import comma_list, finite_float, positive_int

    parser.add_argument("--batches", default=[1, 32, 128], type=comma_list(item=positive_int),
                        help="kda: comma list of batch sizes (default 1,32,128)")
    parser.add_argument("--heads", type=positive_int, default=12, help="kda: heads per rank")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="kda: K = V")
    parser.add_argument("--state-dtypes", default=["fp32", "bf16"], type=comma_list(("fp32", "bf16")),
                        help="kda: comma list of fp32/bf16 (default both)")
    parser.add_argument("--f-b", default=["off", "on"], type=comma_list(("off", "on")),
                        help="kda: comma list of off/on (default both)")
    parser.add_argument("--lower-bound", type=finite_float, default=None,
                        help="kda: safe-gate lower bound (Kimi-K3: -5)")
    parser.add_argument("--no-fla", action="store_true", help="kda: skip the composed fla-core baseline")


def bench_cli(args):
    """``flydsl-backends bench kda``: rows for the CLI to write (or an exit status: ``--host`` is the paged
    ops' host-time mode; the KDA decode is one launch per layer, timed by the rows themselves)."""
    if getattr(args, "host", False):
        print("--host: the per-layer host time is measured for the paged ops (`bench pa --host`); "
              "`bench kda` times the decode itself, on a GPU", file=sys.stderr)
        return 2
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return run_bench(batches=args.batches, H=args.heads, K=args.head_dim,
                     state_dtypes=[dtypes[d] for d in args.state_dtypes],
                     f_b_modes=[m == "on" for m in args.f_b], lower_bound=args.lower_bound,
                     impls=args.impl, trials=args.trials, with_fla=not args.no_fla)
