"""Host time of one layer's attention call through the vLLM adapter, as vLLM's model runner makes it: the
metadata builder runs once per step (one plan per batch), then every layer calls
``do_kv_cache_update`` (write_kv) and ``forward`` (plan.run). The paged ops run on the ``null``
implementation (``pa_backend.benchmark.null_kernels``: validated, planned and dispatched, then nothing is
launched), so the figures are the adapter's and this package's Python, on any machine. On a GPU the
kernels' launch costs come on top (``flydsl-backends bench pa`` times ``plan.run`` with them).

Real vLLM 0.33 objects (``attn_harness``): a decode step of B sequences of ``context`` tokens, block tables
``table_tokens`` wide (a server's max-model-len), the harness's tiny heads (Hq 4, Hkv 2, D 64: the host
work does not depend on them).

Run: VLLM_TARGET_DEVICE=cpu python -m integration_tests.vllm.host_time [layers]
     python -m integration_tests.vllm.host_time [layers] --gpu   (a GPU: the Triton kernels launched)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from integration_tests.host_timing import parse, time_step_and_layers


def adapter_host_time(layers: int = 400, B: int = 8, context: int = 1024, table_tokens: int = 131072,
                      block_size: int = 16, device: str = "cpu", impl: str = "null") -> dict:
    """{"build": us per step, "layer": us per layer call, "calls": null-kernel calls per op in the timed layer
    calls, "triton_attn_build": us per step of vLLM's TRITON_ATTN builder on the same metadata}. ``device="cuda"`` with
    ``impl="triton"``: the kernels are launched (queued, not awaited), as in a
    server's eager step."""
    from vllm.config import set_current_vllm_config

    import pa_backend.vllm as pav
    from integration_tests.vllm import attn_harness as H
    from pa_backend.benchmark import null_kernels

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    spec = H.backend_spec(block_size=block_size)
    with tempfile.TemporaryDirectory() as tmp:
        vc = H.vllm_config(H.tiny_llama_dir(Path(tmp)), block_size=block_size)
        with set_current_vllm_config(vc):
            builder = pav.FlyDSLAttentionMetadataBuilder(spec, names, vc, torch.device(device))
            from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

            # vLLM's own backend's builder on the same metadata: the per-step host cost to compare with
            own = TritonAttentionMetadataBuilder(spec, names, vc, torch.device(device))
    per_seq = -(-context // block_size)
    b = H.Batch(prefix_lens=[context - 1] * B, query_lens=[1] * B, block_size=block_size,
                num_blocks=B * per_seq + 1)
    cam = H.common_metadata(b, H.block_rows(b, max_blocks=table_tokens // block_size), device=device)
    kv = H.allocate(spec, b.num_blocks, names, device=device)[names[0]]
    impl = H.make_impl(pa_impl=impl)
    layer = H.layer_with_scales(0.5, 0.25, device=device)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H.HQ, H.D, generator=g).bfloat16().to(device)
    k, v = (torch.randn(B, H.HKV, H.D, generator=g).bfloat16().to(device) for _ in range(2))
    out = torch.empty_like(q)

    def one_layer(md):
        impl.do_kv_cache_update(layer, k, v, kv, cam.slot_mapping)
        impl.forward(layer, q, k, v, kv, md, out)

    with null_kernels() as calls:
        # vLLM's runner refills the same metadata buffers every step: the builder reuses its plan
        build_us, layer_us = time_step_and_layers(lambda: builder.build(0, cam), one_layer, layers, device,
                                                  before_layers=calls.clear)
    own_us, _ = time_step_and_layers(lambda: own.build(0, cam), lambda md: None, layers, device)
    return {"build": build_us, "layer": layer_us, "calls": dict(calls), "triton_attn_build": own_us}


def main(argv=None) -> int:
    layers, device, impl = parse(argv)
    r = adapter_host_time(layers, device=device, impl=impl)
    print(f"vLLM 0.33 adapter, host time ({device}, {impl} kernels; B=8 decode, 1k context, 128k-token tables):")
    print(f"  metadata builder (once per step): {r['build']:8.1f} us   (vLLM's TRITON_ATTN builder, same "
          f"metadata: {r['triton_attn_build']:.1f} us)")
    print(f"  one layer (do_kv_cache_update + forward): {r['layer']:8.1f} us   calls per op: {r['calls']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
