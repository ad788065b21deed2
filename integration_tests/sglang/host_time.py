"""Host time of one layer's attention call through the SGLang adapter, as SGLang's model runner makes it:
``init_forward_metadata`` once per step (one plan per batch), then every layer's ``RadixAttention``
forward (the pool's ``set_kv_buffer`` -> write_kv, then plan.run). The paged ops run on the ``null``
implementation (``pa_backend.benchmark.null_kernels``: validated, planned and dispatched, then nothing is
launched), so the figures are SGLang's layer wrapper, the adapter's and this package's Python, on any
machine. On a GPU the kernels' launch costs come on top (``flydsl-backends bench pa`` times ``plan.run``
with them).

Real SGLang 0.5.23 objects (``harness``): an eager decode step of B sequences of ``context`` tokens,
``req_to_token`` rows ``table_tokens`` wide, the harness's tiny heads (Hq 8, Hkv 2, D 64: the host work does
not depend on them).

Run: PYTHONPATH=integration_tests/stubs:. python -m integration_tests.sglang.host_time [layers]
     ... host_time [layers] --gpu   (a GPU: the Triton kernels launched)
"""

from __future__ import annotations

import torch

from integration_tests.host_timing import parse, time_step_and_layers


def adapter_host_time(layers: int = 400, B: int = 8, context: int = 1024, table_tokens: int = 16384,
                      page_size: int = 16, device: str = "cpu", impl: str = "null") -> dict:
    """{"metadata": us per step, "layer": us per layer call, "calls": null-kernel calls per op}. ``device="cuda"``
    with ``impl="triton"``: the kernels are launched (queued, not awaited), as in a server's eager step."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from integration_tests.sglang import harness as H
    from pa_backend.benchmark import null_kernels

    case = H.Case(mode="decode", page_size=page_size, prefix_lens=(context - 1,) * B)
    side, _ = H.build_side(case, "flydsl", pa_impl=impl, num_layers=1, max_context_len=table_tokens, device=device)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, case.num_heads * case.head_dim, generator=g).bfloat16().to(device)
    k, v = (torch.randn(B, case.num_kv_heads * case.head_dim, generator=g).bfloat16().to(device) for _ in range(2))
    layer, fb, backend = side.layers[0], side.forward_batch, side.backend
    with null_kernels() as calls, torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        meta_us, layer_us = time_step_and_layers(lambda: backend.init_forward_metadata(fb),
                                                 lambda _: layer(q, k, v, fb), layers, device,
                                                 before_layers=calls.clear)
    return {"metadata": meta_us, "layer": layer_us, "calls": dict(calls)}


def main(argv=None) -> int:
    layers, device, impl = parse(argv)
    r = adapter_host_time(layers, device=device, impl=impl)
    print(f"SGLang 0.5.23 adapter, host time ({device}, {impl} kernels; B=8 eager decode, 1k context, "
          "16k-token rows):")
    print(f"  init_forward_metadata (once per step): {r['metadata']:8.1f} us")
    print(f"  one layer (RadixAttention forward: set_kv_buffer + attention): {r['layer']:8.1f} us   "
          f"calls per op: {r['calls']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
