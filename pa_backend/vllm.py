"""vLLM 0.33.0 adapter: ``--attention-backend FLYDSL`` (or ``CUSTOM``) for MHA/GQA models
over an FP8 paged KV cache.

An adapter only: it turns vLLM's ``CommonAttentionMetadata`` and KV-cache view into the arguments of
:func:`pa_backend.write_kv` and one paged-attention plan per step (:func:`pa_backend.plan_decode` /
:func:`pa_backend.plan_prefill`, built by the metadata builder from ``query_start_loc_cpu`` and
``max_seq_len``; every layer's ``forward`` runs it: no host sync, planning or re-validation of the
batch per layer; docs/design.md §4.1). Decode plans depend on shapes only, so the builder keeps the
plan of its persistent buffers per request count and power-of-two context bound and reuses it. No
kernel code lives here. Like vLLM's own backends, the module imports vLLM: vLLM imports it when it
resolves the backend's path, which the plugin registers.

The cache (``customize_spec``): each block holds two head slots of ``block_size x (Hkv*D)`` bytes —
slot 0 the K page, slot 1 the V page — so vLLM's logical layer view is ``[num_blocks, 2, N, Hkv*D]``
uint8. With the (N, C)-innermost layouts this backend asks for (``LBHNC``, ``LHBNC``) each (block,
slot) region is one contiguous run of ``N*Hkv*D`` bytes, which the impl reads as the docs/design.md §4 pages:
K ``[Hkv, D/16, N, 16]`` and V ``[Hkv, N/16, D, 16]``. Block and slot strides are taken from the tensor
(vLLM's layouts and hybrid page padding change them); vLLM never interprets those bytes itself.

Batches: a batch whose requests all have the same query length ``n`` in 1..4 (decode, uniform
spec-decode; CUDA-graph padded requests have query length 0 and ``seq_len`` 0 and read nothing) runs
``pa_decode(query_length=n)``; every other batch (prefill, chunked prefill, mixed) runs
``pa_prefill``. The K/V write is separate (``forward_includes_kv_cache_update = False``):
``do_kv_cache_update`` calls ``write_kv`` with vLLM's slot mapping (``-1`` padding slots skipped) and
the layer's per-tensor ``_k_scale`` / ``_v_scale``. FP8 is ``current_platform.fp8_dtype()``
(e4m3fnuz on gfx942, e4m3fn elsewhere).

CUDA graphs: ``UNIFORM_BATCH`` — uniform batches (decode and spec-decode up to 4 tokens per request)
run the split-K decode whose grid depends on shapes only (the capture plan is shape-only; the
kernels split each sequence's real context on the device; the planner's workspace is reserved in
the builder's ``__init__``), and every tensor it reads is one of the runner's persistent buffers.
Prefill/mixed batches run on work items made from the step's host query offsets, so they are not
declared graph-safe. With more than 3 speculative tokens the support drops to
``UNIFORM_SINGLE_TOKEN_DECODE``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch
from vllm.config import CUDAGraphMode
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from . import contract as _contract
from .api import write_kv
from .contract import PAPlan, plan_decode, plan_prefill

__all__ = ["FlyDSLAttentionBackend", "FlyDSLAttentionMetadataBuilder", "FlyDSLAttentionImpl",
           "FlyDSLAttentionMetadata", "BACKEND_NAME", "kv_cache_views", "uniform_query_length"]

log = logging.getLogger("flydsl_backends.pa.vllm")

BACKEND_NAME = "FLYDSL"
BLOCK_SIZES = _contract.BLOCK_SIZES  # 16, 32, ..., 128
HEAD_DIMS = _contract.HEAD_DIMS  # (64, 128, 256)
KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_WORKING = ("--attention-backend FLYDSL --kv-cache-dtype fp8 --block-size 16 (any multiple of 16 up to 128), "
            "--dtype bfloat16, an MHA/GQA decoder with head size 64, 128 or 256")


@dataclass
class FlyDSLAttentionMetadata:
    num_actual_tokens: int  # tokens of this step, CUDA-graph padding included
    num_reqs: int
    max_query_len: int
    query_length: int  # n > 0: every request has n query tokens (or 0: padding) -> pa_decode; 0 -> pa_prefill
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 (device)
    seq_lens: torch.Tensor  # [num_reqs] int32, context + new tokens (padded requests: 0)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32 kernel block ids (padded rows: null block 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    plan: Optional[PAPlan] = None  # the batch's paged-attention plan (one per step, run by every layer)


def uniform_query_length(query_start_loc_cpu: torch.Tensor, num_reqs: int, num_actual_tokens: int,
                         max_query_len: int) -> int:
    """n when each of the ``num_reqs`` requests has n query tokens except trailing CUDA-graph padding
    requests with 0 (and the token count is ``num_reqs * n``), n in 1..MAX_QUERY_LENGTH; else 0."""
    n = int(max_query_len)
    if not 1 <= n <= _contract.MAX_QUERY_LENGTH or num_actual_tokens != num_reqs * n or num_reqs == 0:
        return 0
    # on every step's host path: a NumPy view reads two offsets in ~1 us (indexing the tensor costs ~2.5)
    qsl = query_start_loc_cpu.numpy()
    if int(qsl[num_reqs]) - int(qsl[0]) == num_actual_tokens:
        return n  # no request over n tokens (max_query_len is the longest) and n per request in all: all n
    lens = (qsl[1:num_reqs + 1] - qsl[:num_reqs]).tolist()
    live = lens.count(n)
    return n if lens[:live] == [n] * live and not any(lens[live:]) else 0


def kv_cache_views(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int, fp8_dtype: torch.dtype):
    """(key_cache [B, Hkv, D/16, N, 16], value_cache [B, Hkv, N/16, D, 16]) FP8 views of vLLM's layer
    view ``[B, 2, N, Hkv*D]`` (uint8 or FP8). Each (block, slot) region must be ``N*Hkv*D`` contiguous
    bytes (the (N, C)-innermost layouts); block and slot strides are read from the tensor."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 4 or int(kv_cache.shape[1]) != 2 or int(kv_cache.shape[3]) != num_kv_heads * head_size:
        raise ValueError(f"kv_cache: expected the flydsl layer view [num_blocks, 2, block_size, "
                         f"{num_kv_heads}*{head_size}], got {list(kv_cache.shape)} (is the backend's customize_spec "
                         "in effect?)")
    if kv_cache.element_size() != 1:
        raise ValueError(f"kv_cache: expected a 1-byte (uint8 / FP8) cache, got {kv_cache.dtype}")
    B, _, N, C = (int(s) for s in kv_cache.shape)
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != C:
        raise ValueError(f"kv_cache: each block's K and V page must be contiguous (strides [.., .., {C}, 1]), got "
                         f"strides {tuple(kv_cache.stride())}; use a KV cache layout with tokens and content "
                         "innermost (VLLM_KV_CACHE_LAYOUT=LBHNC or LHBNC)")
    if N % 16:
        raise ValueError(f"kv_cache: block_size {N} is not a multiple of 16")
    D, H = head_size, num_kv_heads
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
    sb, ss = raw.stride(0), raw.stride(1)
    off = raw.storage_offset()
    k = raw.as_strided((B, H, D // 16, N, 16), (sb, N * D, N * 16, 16, 1), off)
    v = raw.as_strided((B, H, N // 16, D, 16), (sb, N * D, 16 * D, 16, 1), off + ss)
    return k.view(fp8_dtype), v.view(fp8_dtype)


# ----------------------------------------------------------------------------------------------
# the vLLM classes


def _spec_query_length(vllm_config) -> int:
    """Query tokens per request of a speculative decode step (1 + speculative tokens; 1 without)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 1 + (int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0)


def _refuse_multi_step_draft_on_rocm(vllm_config) -> None:
    """A draft model on FLYDSL (``speculative_config.attention_backend``) drafting more than one token in steps:
    on ROCm, vLLM 0.33's drafter checks every draft step's metadata against its own backends' types
    (``v1/spec_decode/llm_base_proposer.py``, ``allowed_attn_types``) and would raise at the first drafting step.
    Refused here, at start-up, with what works."""
    spec = getattr(vllm_config, "speculative_config", None)
    backend = getattr(spec, "attention_backend", None)
    n = int(getattr(spec, "num_speculative_tokens", 0) or 0)
    if backend is None or n <= 1 or getattr(spec, "parallel_drafting", False):
        return
    try:
        path = backend.get_path()
    except Exception:  # an enum member without a registered class: not this backend
        return
    from vllm.platforms import current_platform

    if path == f"{__name__}.FlyDSLAttentionBackend" and current_platform.is_rocm():
        raise ValueError(f"speculative_config.attention_backend={backend.name} with num_speculative_tokens={n}: on "
                         "ROCm, vLLM 0.33 drafts several tokens only on its own attention backends. Leave the "
                         "draft's attention_backend unset (vLLM picks one for the draft; the target model still "
                         "runs on FLYDSL), or draft one token per step")


def _fp8_dtype():
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


class FlyDSLAttentionBackend(AttentionBackend):
    """``--attention-backend FLYDSL``: FP8 paged attention (pa_decode / pa_prefill / write_kv)."""

    supported_dtypes = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes = list(KV_CACHE_DTYPES)
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return FlyDSLAttentionImpl

    @staticmethod
    def get_builder_cls():
        return FlyDSLAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return list(BLOCK_SIZES)

    @classmethod
    def supports_block_size(cls, block_size) -> bool:
        return block_size is None or block_size in BLOCK_SIZES

    @classmethod
    def get_supported_head_sizes(cls):
        return list(HEAD_DIMS)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # the pages are the docs/design.md §4 layout, not what connectors expect

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # the builder plans from query_start_loc_cpu (decode rows per request, prefill work items):
        # adaptive verification's drafts trimmed on the device would not match the plan
        return False

    @classmethod
    def customize_spec(cls, spec):
        """Two head slots per block (K page, V page) of ``Hkv * D`` bytes per token."""
        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size != spec.head_size_v:
            return spec  # unchanged: kv_cache_views refuses it at the first forward (no vLLM 0.33 model
            # routes such layers here: the two that have them hard-wire their own backends)
        return replace(spec, num_head_slots=2,
                       state_content_bytes=spec.num_kv_heads * spec.head_size * get_dtype_size(spec.dtype))

    @classmethod
    def supported_kv_cache_layouts(cls):
        # tokens and content innermost: each (block, K|V) page is one contiguous region
        return (KVCacheLayout.LBHNC, KVCacheLayout.LHBNC)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability):
        reasons = []
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            reasons.append(f"flydsl reads an FP8 KV cache: use --kv-cache-dtype fp8 (got {kv_cache_dtype!r})")
        if block_size is not None and block_size not in BLOCK_SIZES:
            reasons.append(f"flydsl pages hold a multiple of 16 tokens up to 128: use --block-size 16 "
                           f"(got {block_size})")
        if head_size not in HEAD_DIMS:
            reasons.append(f"flydsl supports head sizes {HEAD_DIMS} (got {head_size})")
        return "; ".join(reasons) + f" ({_WORKING})" if reasons else None


class FlyDSLAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Copies vLLM's per-step tensors (all persistent runner buffers) and decides, on the host, whether
    the batch is uniform (pa_decode) or ragged (pa_prefill)."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        if _spec_query_length(vllm_config) > _contract.MAX_QUERY_LENGTH:
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        _refuse_multi_step_draft_on_rocm(vllm_config)
        if getattr(kv_cache_spec, "non_causal", False):
            # e.g. a prefix-LM decoder (PrefillPrefixLMAttention), whose layers validate as plain decoders
            raise ValueError(f"--attention-backend FLYDSL serves causal attention; layers {list(layer_names)[:2]} "
                             "attend non-causally (prefix LM): use --attention-backend TRITON_ATTN for this "
                             f"model ({_WORKING})")
        mode = vllm_config.compilation_config.cudagraph_mode
        full_graphs = mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL)
        if torch.device(device).type == "cuda" and full_graphs:
            # the split-K workspace for the largest graph batch, allocated before any capture
            from .planner import reserve

            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            bs = int(kv_cache_spec.block_size)
            # the runner's tables are ceil(max_model_len / block) pages wide: size for all their tokens
            reserve(int(vllm_config.scheduler_config.max_num_seqs), int(mc.get_num_attention_heads(pc)),
                    int(mc.get_num_kv_heads(pc)), int(mc.get_head_size()), -(-int(mc.max_model_len) // bs) * bs,
                    bs, query_length=min(_spec_query_length(vllm_config), _contract.MAX_QUERY_LENGTH),
                    device=torch.device(device))
        self._plans = {}  # shape -> (buffer addresses, decode plan) (``_decode_plan``)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cam = common_attn_metadata
        if common_prefix_len:
            raise NotImplementedError("flydsl attention: cascade attention (common_prefix_len > 0) is not "
                                      "supported")
        if cam.causal is not True:  # a wrapper asking for non-causal attention: never computed causally
            raise NotImplementedError(f"flydsl attention: non-causal attention (causal={cam.causal!r}) is not "
                                      "supported; use --attention-backend TRITON_ATTN for this model")
        n = uniform_query_length(cam.query_start_loc_cpu, cam.num_reqs, cam.num_actual_tokens, cam.max_query_len)
        # the runner's persistent int32 buffers, as they are (a copy would break CUDA-graph replay)
        md = FlyDSLAttentionMetadata(
            num_actual_tokens=int(cam.num_actual_tokens), num_reqs=int(cam.num_reqs),
            max_query_len=int(cam.max_query_len), query_length=n, query_start_loc=cam.query_start_loc,
            seq_lens=cam.seq_lens, block_tables=cam.block_table_tensor, slot_mapping=cam.slot_mapping)
        md.plan = self._plan(md, cam, max_context=int(cam.max_seq_len) or None)
        return md

    def _plan(self, md, cam, max_context):
        """One plan per step from what vLLM holds on the host (query_start_loc_cpu, max_seq_len)."""
        R = md.num_reqs
        if md.query_length:
            return self._decode_plan(md, max_context)
        return plan_prefill(md.block_tables[:R], md.query_start_loc[:R + 1], md.seq_lens[:R],
                            query_start_loc_host=cam.query_start_loc_cpu[:R + 1], max_context=max_context)

    def _decode_plan(self, md, max_context):
        """A decode plan depends on shapes only (the kernels read tables and lengths on the device),
        so the plan of the runner's persistent buffers is made once per (requests, query length,
        context bound rounded up to a power of two, layouts) and reused by every later step: the
        per-step host cost is a dict lookup. A plan holds views of its buffers; each shape keeps one
        plan, the one of the last buffers it saw, so tensors made afresh every step (e.g. the virtual
        batches of chunked local attention, Llama-4) are planned anew and never pile up."""
        R, block_tables, seq_lens = md.num_reqs, md.block_tables, md.seq_lens
        bound = None if max_context is None else 1 << max(int(max_context) - 1, 0).bit_length()
        shape = (R, md.query_length, bound, block_tables.dtype, block_tables.shape[1], block_tables.stride(),
                 seq_lens.dtype, seq_lens.stride(), block_tables.device)
        addresses = (block_tables.data_ptr(), seq_lens.data_ptr())
        plans = self._plans
        held = plans.get(shape)
        if held is not None and held[0] == addresses:
            return held[1]
        plan = plan_decode(block_tables[:R], seq_lens[:R], query_length=md.query_length, max_context=bound)
        if held is None and len(plans) >= 512:
            plans.clear()
        plans[shape] = (addresses, plan)
        return plan

    def build_for_cudagraph_capture(self, common_attn_metadata):
        md = self.build(0, common_attn_metadata)
        if md.query_length == 0:
            raise NotImplementedError("flydsl attention: CUDA graphs are declared for uniform batches only "
                                      f"(query length 1..{_contract.MAX_QUERY_LENGTH} per request)")
        # shape-only plan (no context bound): the captured kernels split whatever contexts the replays bring
        md.plan = self._decode_plan(md, None)
        md.seq_lens.fill_(1)  # capture reads one token per request (as vLLM's own backends do)
        return md


class FlyDSLAttentionImpl(AttentionImpl):
    """Decode/spec-decode → ``pa_decode``; prefill/mixed → ``pa_prefill``; K/V → ``write_kv``.

    ``pa_impl`` picks the op implementation (``torch`` | ``triton`` | ``flydsl`` | ``auto``,
    default ``auto``, which honours ``FLYDSL_BACKENDS_PA``); settable on the instance for tests.
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **kwargs):
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = int(num_kv_heads if num_kv_heads is not None else num_heads)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        if alibi_slopes is not None:
            raise ValueError("alibi_slopes: ALiBi is not supported by --attention-backend FLYDSL")
        if logits_soft_cap:
            raise ValueError(f"logits_soft_cap={logits_soft_cap}: soft-capping is not supported by "
                             "--attention-backend FLYDSL")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"attn_type={attn_type}: --attention-backend FLYDSL serves causal decoder "
                             "self-attention only")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: --attention-backend FLYDSL reads an FP8 KV "
                             f"cache; use --kv-cache-dtype fp8 ({_WORKING})")
        if self.head_size not in HEAD_DIMS:
            raise ValueError(f"head_size={self.head_size}: supported {HEAD_DIMS} ({_WORKING})")
        g = self.num_heads // self.num_kv_heads if self.num_kv_heads else 0
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads or not 1 <= g <= _contract.MAX_GQA:
            raise ValueError(f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}: "
                             f"--attention-backend FLYDSL supports GQA ratios 1..{_contract.MAX_GQA}")
        # vLLM's window w covers w tokens including the current one, as the op's sliding_window does
        self.sliding_window = int(sliding_window) if sliding_window else 0
        if sinks is not None and (sinks.dim() != 1 or int(sinks.shape[0]) != self.num_heads):
            raise ValueError(f"sinks: expected [{self.num_heads}] (one per query head on this rank), got "
                             f"{list(sinks.shape)}")
        self.sinks = sinks
        self._sinks_f32 = None
        self.fp8_dtype = _fp8_dtype()
        self.pa_impl = "auto"
        self._views = {}

    def process_weights_after_loading(self, act_dtype):
        self._sinks()  # the fp32 buffer, made before any graph capture (a reload refills the same one)

    def _sinks(self):
        """The sinks in fp32, read from the live parameter at every call: vLLM keeps them in the model
        dtype and may update the parameter in place (weight sync) or reload it; the fp32 buffer keeps one
        address (a captured graph re-runs the copy, so a replay reads the current values)."""
        if self.sinks is None:
            return None
        if self.sinks.dtype == torch.float32:
            return self.sinks
        buf = self._sinks_f32
        if buf is None or buf.device != self.sinks.device or buf.shape != self.sinks.shape:
            with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
                buf = self._sinks_f32 = torch.empty(self.sinks.shape, dtype=torch.float32,
                                                    device=self.sinks.device)
        return buf.copy_(self.sinks.detach())

    def _caches(self, kv_cache):
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), tuple(kv_cache.stride()))
        views = self._views.get(key)
        if views is None:
            views = kv_cache_views(kv_cache, self.num_kv_heads, self.head_size, self.fp8_dtype)
            if len(self._views) > 8:
                self._views.clear()
            self._views[key] = views
        return views

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        kc, vc = self._caches(kv_cache)
        n = int(slot_mapping.shape[0])
        write_kv(key[:n], value[:n], kc, vc, slot_mapping, layer._k_scale, layer._v_scale, backend=self.pa_impl)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("--attention-backend FLYDSL: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        md = attn_metadata
        kc, vc = self._caches(kv_cache)
        T = md.num_actual_tokens
        q, out = query[:T], output[:T]
        md.plan.run(q, kc, vc, layer._k_scale, layer._v_scale, softmax_scale=self.scale,
                    sliding_window=self.sliding_window, sinks=self._sinks(), out=out, backend=self.pa_impl)
        return output
