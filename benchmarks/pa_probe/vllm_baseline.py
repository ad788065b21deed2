"""vLLM 0.33.0's own Triton decode attention (``TRITON_ATTN``) on a ``bench_case`` problem: the baseline the
decode probes time this repo's FP8 paged attention against, at the same inputs.

What it mirrors (vLLM 0.33.0, ``--attention-backend TRITON_ATTN``, ``--kv-cache-dtype fp8`` (per-tensor FP8
e4m3, no checkpoint scales: ``_q_scale`` 1.0, ``_k_scale`` / ``_v_scale`` set here to bench_case's scales),
``--block-size 16``, ``cudagraph_mode=FULL_DECODE_ONLY``, no speculative decoding, no sliding window, no
sinks, no ALiBi, no softcap, not batch-invariant, ``VLLM_TRITON_USE_TD`` unset):

* the KV cache, ``vllm/v1/worker/utils.py`` ``allocate_kv_cache``: one backing allocation viewed per layer
  as the logical ``[num_blocks, Hkv, block_size, 2 * D]`` uint8 page (``create_kv_cache_views`` in
  ``vllm/v1/kv_cache_interface.py``; K in the first D bytes of the last axis, V in the second), in the
  layout ``get_supported_kv_cache_layouts([TritonAttentionBackend])[0]`` resolves to (the backend declares
  none, so vLLM's default preference: ``LBNHC``, physically ``[num_blocks, block_size, Hkv, 2 * D]`` per
  layer). The spec is ``FullAttentionSpec`` of dtype ``STR_DTYPE_TO_TORCH_DTYPE["fp8"]`` (uint8) and
  ``get_kv_quant_mode("fp8")`` (FP8_PER_TENSOR), through ``customize_attention_spec``. The repo's block
  ``b`` is vLLM block ``b`` (same ids, same FP8 bytes; vLLM reserves block 0 as its null block, here it
  may hold live tokens, which the kernel does not care about).
* the per-step metadata, ``vllm/v1/attention/backends/triton_attn.py``: ``TritonAttentionMetadataBuilder``
  constructed (its real ``__init__``) on a stand-in VllmConfig carrying the fields it reads, then its
  ``build`` on a real ``CommonAttentionMetadata`` of a pure decode batch: ``query_start_loc`` =
  arange(B + 1), ``max_query_len`` 1, ``seq_lens`` = context_lengths, the block table as given (its full
  width: vLLM's tables are max_model_len wide too), ``max_seq_len`` = ``max_model_len`` (what both model
  runners pass when capturing a FULL graph, ``for_capture`` in ``v1/worker/gpu/model_states/default.py``,
  ``for_cudagraph_capture`` in ``v1/worker/gpu_model_runner.py``; the kernel launcher ignores it on this
  path anyway). ``__init__`` sets ``seq_threshold_3D`` = ``MIN_LAUNCH_GRID_SIZE_2D // Hkv`` snapped to the
  nearest CUDA-graph capture size, ``num_par_softmax_segments`` = ``NUM_PAR_SOFTMAX_SEGMENTS`` (16; 64 on
  SM120 only) and the ``softmax_segm_output`` / ``_max`` / ``_expsum`` fp32 scratch of
  ``min(seq_threshold_3D, max_num_seqs)`` rows. The capture sizes are vLLM's defaults, from
  ``VllmConfig._set_cudagraph_sizes`` (run, unbound, on a stand-in with a real ``CompilationConfig``),
  with ``max_num_seqs`` / ``max_num_batched_tokens`` from ``EngineArgs.get_batch_defaults`` for the API
  server on this device (H200: 1024 / 8192, so sizes 1, 2, 4, 8, 16, ..., 248, 256, 272, ..., 512).
* the per-layer call, ``TritonAttentionImpl.forward`` itself (a real ``TritonAttentionImpl(Hq, D, D ** -0.5,
  Hkv, None, None, "fp8")`` and a stand-in layer holding ``_q_scale`` / ``_k_scale`` / ``_v_scale``): it
  splits the page into K / V views (``transpose(1, 2).split(D, -1)``, viewed as float8_e4m3fn), expands the
  k/v descales to ``[B, Hkv]`` and calls ``unified_attention`` (``v1/attention/ops/triton_unified_attention.py``)
  with causal True, window (-1, -1), softcap 0. For B <= seq_threshold_3D that is the 3D (split-softmax)
  ``kernel_unified_attention`` over 16 segments plus ``reduce_segments`` (2 kernels); above it the 2D kernel
  (1 kernel).
* the query: on CUDA, ``Attention.forward`` (``vllm/model_executor/layers/attention/attention.py``) first
  quantizes the query to FP8 with ``QuantFP8(static=True, GroupShape.PER_TENSOR)`` and ``_q_scale`` (1.0)
  because ``TritonAttentionImpl.supports_quant_query_input`` is ``current_platform.is_cuda()``. The kernel
  then takes ``Q_IS_FP8``: K / V stay FP8, Q.K is an FP8 x FP8 dot (scaled by q_scale * k_scale), and
  P * 256 is cast to FP8 for the FP8 P.V dot (then / 256, times v_scale). ``quant_query`` (default: True
  for a CUDA problem, as vLLM on CUDA) does that quantization once, here in ``build`` (vLLM's
  ``QuantFP8.forward_native``, called unbound: the torch code that torch.compile fuses into the op before
  attention), so ``launch`` times the attention kernels alone. With ``quant_query=False`` (the default off
  CUDA) Q stays bf16, K / V are dequantized to bf16 in the kernel and P is cast to bf16. Accuracy is
  vLLM's: the FP8 Q and P put it near ~3e-2 against the float64 reference (the bf16 path ~3e-3), so the
  repo's 3e-3 target does not apply to this baseline (short_probe holds baselines to 6e-2).

Once per step vs per layer: the builder does no device work for this batch (its tensors are the model
runner's persistent input buffers; the scratch is allocated once in ``__init__``), so ``launch.step`` is a
no-op, and ``launch()`` = ``launch.layer()`` = one ``TritonAttentionImpl.forward``.

What it does not mirror: the KV write of the step's own token (``do_kv_cache_update``,
``triton_reshape_and_cache_flash``: the cache here is already filled); the query quantization kernel (done
in ``build``, see above); the model runner's per-step input copies (seq_lens, query_start_loc, block table
rows to the GPU); CUDA-graph batch padding (vLLM pads B up to a capture size, padded rows with seq_len 0
and the null block; here B is used as is, which is what vLLM runs when B is a capture size, e.g. 16, 64,
128); per-token-head and INT4 KV modes (refused); query_length > 1 (speculative verify: refused); the
per-layer ``torch.empty`` of the output (written into the preallocated ``out``); the piecewise / eager
modes (the same kernels, but ``max_seq_len`` would be the batch max, unused by the launcher either way).

On CPU (TRITON_INTERPRET=1) Triton 3.6's interpreter, not vLLM or this file, breaks two of the kernel's
paths (``triton/runtime/interpreter.py``): ``create_dot`` multiplies bf16 operands as their raw uint16 bits
(FP8 operands it converts to fp16 first), so a bf16 query with ``quant_query=False`` gives garbage (~1e9
relative error): check the bf16-free path by casting ``kw["query"]`` to fp16 first (Q fp16, K / V and P
fp16: ~3e-3); and ``_convert_float`` rounds fp32 -> fp8 downcasts without the carry into the exponent, which
hits the P -> FP8 cast of ``quant_query=True`` (3e-2 .. 6e-2 instead of ~3e-2). Its fp32 -> bf16 casts
truncate, too. On a machine without a GPU, vLLM swaps Triton for a placeholder unless
``CUDA_VISIBLE_DEVICES`` is set and empty when ``vllm.triton_utils`` is first imported
(``triton_utils/importing.py``): ``build`` sets it (setdefault) for a CPU problem if vLLM is not imported
yet. ``VLLM_TARGET_DEVICE=cpu`` (the CPU platform) or none (``UnspecifiedPlatform``) both work.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Callable, Dict, Tuple

import torch

__all__ = ["build"]

LAYER = "model.layers.0.self_attn.attn"


def _capture_sizes(max_num_seqs: int, max_num_batched_tokens: int):
    """vLLM's default CUDA-graph capture sizes for FULL_DECODE_ONLY: ``VllmConfig._set_cudagraph_sizes`` run
    (unbound) on a stand-in VllmConfig with a real ``CompilationConfig`` and ``SchedulerConfig`` values."""
    from vllm.config import CompilationConfig, CUDAGraphMode, VllmConfig

    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=False), compilation_config=cc,
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens),
        uniform_decode_query_len=1, speculative_config=None, performance_mode="balanced")
    VllmConfig._set_cudagraph_sizes(cfg)
    return list(cc.cudagraph_capture_sizes)


def build(kw: Dict[str, object], *, max_model_len: int = None, quant_query: bool = None,
          max_num_seqs: int = None, max_num_batched_tokens: int = None,
          capture_sizes=None) -> Tuple[Callable[[], None], torch.Tensor]:
    """``(launch, out)``: ``launch()`` runs what vLLM's TRITON_ATTN backend runs for one decode step of one
    layer on ``kw`` (a ``pa_backend.benchmark.bench_case`` dict, per-tensor scales, query_length 1):
    ``TritonAttentionImpl.forward`` (per layer; nothing per step on the device), writing ``out`` [B, Hq, D]
    bf16. ``launch.step()`` is a no-op and ``launch.layer()`` the forward, for symmetry with
    sglang_baseline; ``launch.buffers`` holds vLLM's buffers (kv_cache page view, key/value cache views,
    query, metadata tensors, softmax_segm_* scratch) and ``launch.metadata`` the TritonAttentionMetadata.
    Everything is allocated here, so ``launch`` allocates nothing and can be captured in a CUDA graph.

    ``max_model_len``: the engine's (default: the block table's width in tokens; under FULL graphs vLLM
    captures with ``max_seq_len`` = max_model_len). ``quant_query``: quantize the query to FP8 as vLLM's
    Attention layer does for this backend on CUDA (default: True for a CUDA problem, False on CPU).
    ``max_num_seqs`` / ``max_num_batched_tokens``: the scheduler's (default vLLM's API-server defaults for
    this device, ``EngineArgs.get_batch_defaults``); they set the capture sizes and the scratch rows.
    ``capture_sizes``: override vLLM's default capture sizes (the 3D threshold snaps to the nearest)."""
    if kw["query"].device.type == "cpu" and "vllm.triton_utils" not in sys.modules:
        # vLLM decides at import whether Triton is usable; with no GPU driver it says no (and swaps in a
        # placeholder module) unless CUDA_VISIBLE_DEVICES is set and empty.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise RuntimeError("vLLM found Triton unusable (vllm.triton_utils.HAS_TRITON is False); on a machine "
                           "without a GPU, set CUDA_VISIBLE_DEVICES= before anything imports vllm.triton_utils")
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                        TritonAttentionMetadataBuilder)
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                            compute_layout_strides, get_kv_quant_mode)
    from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec

    from probe_util import decode_problem

    q, kc, vc, bt, lens, ks, vs, NB, Hkv, D, bs, B, Hq = decode_problem(
        kw, "vLLM's TRITON_ATTN", "its fp8 KV cache is per tensor (the per-token-head modes quantize differently)")
    D16, X = D // 16, 16
    if not TritonAttentionBackend.supports_block_size(bs):
        raise ValueError(f"TRITON_ATTN takes block sizes that are multiples of 16, not {bs}")
    dev = q.device
    width = int(bt.shape[1])
    if max_model_len is None:
        max_model_len = width * bs
    if quant_query is None:  # TritonAttentionImpl.supports_quant_query_input = current_platform.is_cuda()
        quant_query = dev.type == "cuda"
    if max_num_seqs is None or max_num_batched_tokens is None:
        tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
        max_num_seqs = max_num_seqs or seqs[UsageContext.OPENAI_API_SERVER]
        max_num_batched_tokens = max_num_batched_tokens or tokens[UsageContext.OPENAI_API_SERVER]
    if capture_sizes is None:
        capture_sizes = _capture_sizes(max_num_seqs, max_num_batched_tokens)

    # The KV cache spec and allocation, as the worker does for this backend.
    kv_cache_dtype = "fp8"
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=Hkv, head_size=D,
                             dtype=STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype],
                             kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    spec = customize_attention_spec(TritonAttentionBackend, spec)
    layout = get_supported_kv_cache_layouts([TritonAttentionBackend])[0]
    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, NB, 1, layout)
    tensor = KVCacheTensor(size=spec.page_size_bytes * NB, layers=[LAYER], layer_stride=layer_stride,
                           block_stride=block_stride)
    kv_cache = allocate_kv_cache(KVCacheConfig(num_blocks=NB, kv_cache_tensors=[tensor],
                                               kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)]),
                                 dev, layout)[LAYER]  # logical [NB, Hkv, bs, 2 * D] uint8
    if tuple(kv_cache.shape) != (NB, Hkv, bs, 2 * D):
        raise RuntimeError(f"vLLM's page view is {tuple(kv_cache.shape)}, expected {(NB, Hkv, bs, 2 * D)}")
    page = kv_cache.view(torch.uint8)
    # key_cache[b, h, d // 16, t, d % 16] -> page[b, h, t, d]; value_cache[b, h, d, t] -> page[b, h, t, D + d]
    page[..., :D].view(NB, Hkv, bs, D16, X).copy_(kc.view(torch.uint8).permute(0, 1, 3, 2, 4))
    page[..., D:].copy_(vc.view(torch.uint8).permute(0, 1, 3, 2))

    # The metadata builder, on a stand-in VllmConfig with the fields its __init__ reads.
    model_config = types.SimpleNamespace(
        get_num_attention_heads=lambda parallel_config: Hq, get_num_kv_heads=lambda parallel_config: Hkv,
        get_head_size=lambda: D, rswa_window=None, max_model_len=max_model_len)
    vllm_config = types.SimpleNamespace(
        model_config=model_config, parallel_config=types.SimpleNamespace(),
        compilation_config=types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY,
                                                 cudagraph_capture_sizes=list(capture_sizes),
                                                 static_forward_context={}),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens),
        speculative_config=None, cache_config=types.SimpleNamespace(block_size=bs, cache_dtype=kv_cache_dtype))
    builder = TritonAttentionMetadataBuilder(spec, [LAYER], vllm_config, dev)

    # The model runner's persistent input buffers for this step: a pure decode batch.
    query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=dev)
    seq_lens = lens.to(device=dev, dtype=torch.int32).clone()
    block_table = bt.to(device=dev, dtype=torch.int32).contiguous()
    slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=dev)  # the KV write is not mirrored
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.cpu(), seq_lens=seq_lens,
        num_reqs=B, num_actual_tokens=B, max_query_len=1, max_seq_len=max_model_len,
        block_table_tensor=block_table, slot_mapping=slot_mapping, causal=True,
        seq_lens_cpu_upper_bound=seq_lens.cpu(), is_prefilling=torch.zeros(B, dtype=torch.bool))
    metadata = builder.build(0, common)

    # The layer: its impl and the scales it carries (vLLM's registered buffers are 0-d float32).
    impl = TritonAttentionImpl(num_heads=Hq, head_size=D, scale=D ** -0.5, num_kv_heads=Hkv, alibi_slopes=None,
                               sliding_window=None, kv_cache_dtype=kv_cache_dtype)
    layer = types.SimpleNamespace(_q_scale=torch.tensor(1.0, dtype=torch.float32, device=dev),
                                  _k_scale=ks.to(device=dev, dtype=torch.float32).clone(),
                                  _v_scale=vs.to(device=dev, dtype=torch.float32).clone())
    query = q
    if quant_query:
        # QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR).forward_native, called unbound on the
        # attributes it reads (a CustomOp cannot be constructed outside a vLLM config context).
        quant = types.SimpleNamespace(is_group_quant=False, static=True, group_shape=GroupShape.PER_TENSOR,
                                      num_token_padding=None)
        query, _ = QuantFP8.forward_native(quant, q.reshape(B, Hq * D), layer._q_scale)
        query = query.view(B, Hq, D)
    out = torch.empty((B, Hq, D), dtype=torch.bfloat16, device=dev)

    def step():
        pass

    def forward():
        impl.forward(layer, query, None, None, kv_cache, metadata, out)

    def launch():
        forward()

    launch.step, launch.layer = step, forward
    launch.metadata, launch.impl = metadata, impl
    key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    launch.buffers = dict(kv_cache=kv_cache, key_cache=key_cache.view(torch.float8_e4m3fn),
                          value_cache=value_cache.view(torch.float8_e4m3fn), query=query,
                          query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                          softmax_segm_output=metadata.softmax_segm_output,
                          softmax_segm_max=metadata.softmax_segm_max,
                          softmax_segm_expsum=metadata.softmax_segm_expsum)
    return launch, out
