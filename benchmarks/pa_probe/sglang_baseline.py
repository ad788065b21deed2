"""SGLang 0.5.23's own Triton decode attention on a ``bench_case`` problem: the baseline the decode probes
time this repo's FP8 paged attention against, at the same inputs.

What it mirrors (SGLang 0.5.23, ``--attention-backend triton``, FP8 e4m3 KV cache, ``--page-size 16``,
server defaults: ``triton_attention_num_kv_splits`` = 8, no split tile size, not deterministic, no
static splits, no DCP, no sliding window, no sinks, no logit cap):

* the pool, ``sglang/srt/mem_cache/memory_pool.py`` ``MHATokenToKVPool`` (NHD layout, the CUDA default):
  per layer a K and a V buffer of ``size + page_size`` token slots, ``[slots, Hkv, D]``, stored as uint8
  and read through ``.view(float8_e4m3fn)`` (``get_key_buffer`` / ``get_value_buffer``), K and V the two
  halves of one allocation (``_create_buffers_normal``); slot ``page * page_size + offset``, page 0 the
  padding page. The repo's block ``b`` becomes SGLang page ``b + 1`` here, the same FP8 bytes.
* the per-step metadata, ``sglang/srt/layers/attention/triton_backend.py`` ``TritonAttnBackend``:
  ``init_forward_metadata`` (eager) / ``_apply_cuda_graph_metadata`` (CUDA graphs) for a decode batch.
  ``kv_indptr`` int32 [B + 1] = cumsum(seq_lens) and ``kv_indices`` int64 = one TOKEN SLOT id per live
  token (``_fill_kv_indptr_and_indices`` -> ``KVIndexTranslator.pack_read_stream``), also at page_size
  16; ``attn_logits`` fp32 [B, Hq, max_kv_splits, Dv], ``attn_lse`` fp32 [B, Hq, max_kv_splits],
  ``num_kv_splits`` int32 [B] and ``uneven_batch`` int32 [1] filled on the device by
  ``TritonAttnBackend.get_num_kv_splits`` (its Triton kernel ``get_num_kv_splits_triton`` in
  ``sglang/kernels/ops/attention/metadata.py``; called here as SGLang's own method, unbound, on an object
  carrying the backend's attributes).
* the per-layer call, ``TritonAttnBackend.forward_decode`` -> ``decode_attention_fwd``
  (``sglang/kernels/ops/attention/decode_attention.py``): the pool buffers, ``sm_scale`` = D ** -0.5
  (``layer.scaling``), ``k_scale`` / ``v_scale`` the per-tensor floats (``layer.k_scale_float``),
  ``page_size`` = the block size, ``use_pdl`` = ``is_arch_support_pdl()`` (sm_90+, CUDA only).
  ``decode_attention_fwd`` then runs ``decode_attention_fwd_grouped`` (Hq > Hkv: ``_fwd_grouped_kernel_stage1``,
  Q cast to FP8 and P cast to FP8 for its two ``tl.dot``) or ``decode_attention_fwd_normal`` (Hq == Hkv:
  ``_fwd_kernel_stage1``, Q.K products in bf16, P.V in fp32), then ``_fwd_kernel_stage2`` (the split
  reduce, times v_scale). Accuracy is SGLang's: the FP8 Q and P of the grouped kernel give a relative
  error of ~3e-2 against the float64 reference on bench_case inputs (the MHA kernel ~3e-3), so the
  repo's 3e-3 target does not apply to this baseline.

Once per step vs per layer: SGLang computes ``kv_indptr`` / ``kv_indices`` / ``num_kv_splits`` ONCE PER
STEP, before the layers (eagerly in ``init_forward_metadata``; with CUDA graphs in
``init_forward_metadata_out_graph``, i.e. launched outside the captured graph before each replay), and
runs ``decode_attention_fwd`` (2 kernels) PER LAYER. ``launch()`` runs the one device-side per-step
piece (the ``get_num_kv_splits`` kernel: 1 launch) and then one layer; ``launch.step`` and
``launch.layer`` run each part alone (time ``launch.layer`` for the per-layer cost).

What it does not mirror: the Lean (work-centric) decode path of ``decode_attention_fwd`` (ROCm only:
``_is_hip``; on CUDA ``enable_lean`` is ignored, so it is passed as False); the gfx950 MLA tuning
(``_mla_launch_plan``: ROCm + MLA only); per-token KV scales (SGLang's Triton backend has per-tensor
scales only: refused here); query_length > 1 (speculative verify goes through SGLang's extend kernels:
refused); the KV write of the step's own token (``set_kv_buffer``: the cache here is already filled);
the per-layer ``o = torch.empty_like(q)`` (written into the preallocated ``out`` instead); the per-step
packing of ``kv_indptr`` / ``kv_indices`` (SGLang: a cumsum and a gather kernel from ``req_to_token`` through
its ``KVIndexTranslator``; here built once in ``build``, not part of ``launch.step``); CUDA-graph batch
padding (SGLang pads B up to a captured batch size whose extra rows have seq_len 1, and sizes its graph
buffers for the largest captured batch: not done here).

On CPU (TRITON_INTERPRET=1) the grouped kernel's results are wrong because of Triton 3.6's interpreter,
not SGLang or this file: ``triton/runtime/interpreter.py`` ``_convert_float`` rounds an fp32/bf16 -> fp8
downcast half-up and loses the carry of a mantissa overflow into the exponent (0.4921875 -> 0.25,
1.953125 -> 1.0), which hits the Q -> FP8 and P -> FP8 casts. The MHA kernel has no such cast.
"""

from __future__ import annotations

import types
from typing import Callable, Dict, Tuple

import torch

__all__ = ["build"]


def build(kw: Dict[str, object], max_kv_splits: int = 8, *, device_core_count: int = None,
          use_pdl: bool = None) -> Tuple[Callable[[], None], torch.Tensor]:
    """``(launch, out)``: ``launch()`` runs what SGLang's Triton backend runs for one decode step of one
    layer on ``kw`` (a ``pa_backend.benchmark.bench_case`` dict, per-tensor scales, query_length 1): its
    ``get_num_kv_splits`` kernel (once per step in SGLang) and ``decode_attention_fwd`` (per layer),
    writing ``out`` [B, Hq, D] bf16. ``launch.step()`` / ``launch.layer()`` run the two parts alone;
    ``launch.buffers`` holds SGLang's buffers (pool views, kv_indptr, kv_indices, num_kv_splits, ...).
    Everything is allocated here, so ``launch`` allocates nothing and can be captured in a CUDA graph.

    ``max_kv_splits``: ``--triton-attention-num-kv-splits`` (server default 8). ``device_core_count``:
    what SGLang's ``get_device_core_count`` gives (default: the GPU's SM count; 0 on CPU, where SGLang
    then fills every sequence's split count with ``max_kv_splits`` instead of running the kernel).
    ``use_pdl``: default SGLang's ``is_arch_support_pdl()`` on CUDA, False elsewhere."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from probe_util import decode_problem

    q, kc, vc, bt, lens, ks, vs, NB, Hkv, D, bs, B, Hq = decode_problem(
        kw, "SGLang's Triton decode", "its Triton backend has no per-token scales")
    D16, X = D // 16, 16
    dev = q.device

    # The pool: [2, slots, Hkv, D] uint8 (K half, V half), slots = (NB + 1) pages of bs, page 0 the padding page.
    slots = (NB + 1) * bs
    fused = torch.zeros((2, slots, Hkv, D), dtype=torch.uint8, device=dev)
    # key_cache[b, h, d // 16, t, d % 16] -> slot (b + 1) * bs + t, [h, d]
    fused[0, bs:].view(NB, bs, Hkv, D16, X).copy_(kc.view(torch.uint8).permute(0, 3, 1, 2, 4))
    # value_cache[b, h, d, t] -> slot (b + 1) * bs + t, [h, d]
    fused[1, bs:].view(NB, bs, Hkv, D).copy_(vc.view(torch.uint8).permute(0, 3, 1, 2))
    k_buffer = fused[0].view(torch.float8_e4m3fn)  # what get_key_buffer(layer) returns
    v_buffer = fused[1].view(torch.float8_e4m3fn)

    # Per-step metadata: token-granular CSR over the live tokens only (SGLang's seq_lens are int64).
    seq_lens = lens.to(device=dev, dtype=torch.int64)
    kv_indptr = torch.zeros((B + 1,), dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(seq_lens, dim=0)
    total = int(kv_indptr[-1])
    seq = torch.repeat_interleave(torch.arange(B, device=dev), seq_lens)
    j = torch.arange(total, device=dev) - kv_indptr[:-1].long()[seq]
    kv_indices = (bt.long()[seq, j // bs] + 1) * bs + j % bs  # int64 token slot ids

    attn_logits = torch.zeros((B, Hq, max_kv_splits, D), dtype=torch.float32, device=dev)
    attn_lse = torch.zeros((B, Hq, max_kv_splits), dtype=torch.float32, device=dev)
    num_kv_splits = torch.full((B,), max_kv_splits, dtype=torch.int32, device=dev)
    uneven_batch = torch.zeros((1,), dtype=torch.int32, device=dev)
    out = torch.empty((B, Hq, D), dtype=torch.bfloat16, device=dev)

    if device_core_count is None:
        device_core_count = (torch.cuda.get_device_properties(dev).multi_processor_count
                             if dev.type == "cuda" else 0)
    if use_pdl is None:
        use_pdl = False
        if dev.type == "cuda":
            from sglang.kernels.jit.utils.arch import is_arch_support_pdl
            use_pdl = is_arch_support_pdl()
    # The attributes TritonAttnBackend.get_num_kv_splits reads, as TritonAttnBackend.__init__ sets them
    # under the server defaults (SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS unset, no deterministic
    # inference, triton_attention_split_tile_size None).
    backend = types.SimpleNamespace(static_kv_splits=False, device_core_count=device_core_count,
                                    enable_deterministic=False, max_kv_splits=max_kv_splits,
                                    split_tile_size=None, num_head=Hq, num_kv_head=Hkv)
    sm_scale = D ** -0.5
    k_scale, v_scale = float(ks), float(vs)

    def step():
        TritonAttnBackend.get_num_kv_splits(backend, num_kv_splits, seq_lens, uneven_batch)

    def layer():
        decode_attention_fwd(q, k_buffer, v_buffer, out, kv_indptr, kv_indices, attn_logits, attn_lse,
                             num_kv_splits, max_kv_splits, sm_scale, k_scale, v_scale,
                             logit_cap=0.0, sinks=None, xai_temperature_len=-1, has_mla=False,
                             use_pdl=use_pdl, page_size=bs, score_mod=None, aux_tensors=None,
                             enable_lean=False, uneven_batch=uneven_batch)

    def launch():
        step()
        layer()

    launch.step, launch.layer = step, layer
    launch.buffers = dict(k_buffer=k_buffer, v_buffer=v_buffer, kv_indptr=kv_indptr, kv_indices=kv_indices,
                          num_kv_splits=num_kv_splits, uneven_batch=uneven_batch, attn_logits=attn_logits,
                          attn_lse=attn_lse)
    return launch, out
