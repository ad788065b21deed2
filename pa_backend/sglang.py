"""SGLang 0.5.23 adapter: ``--attention-backend flydsl`` for MHA/GQA models over an FP8 paged KV pool.

An adapter only: it turns SGLang's metadata (``req_to_token``, ``seq_lens``, ``out_cache_loc``,
``extend_seq_lens``) into the arguments of :func:`pa_backend.write_kv`, :func:`pa_backend.pa_decode`
and :func:`pa_backend.pa_prefill` (docs/design.md §4). No kernel code lives here.

Public names (all SGLang classes are built lazily, so ``import pa_backend.sglang`` imports no
SGLang module; they are created on first attribute access):

* ``FlyDSLMHATokenToKVPool`` — subclass of SGLang's ``MHATokenToKVPool`` whose per-layer buffers are
  the docs/design.md §4 layout (which is the pool's own ``vectorized_5d`` label): K
  ``[num_blocks, Hkv, D/16, P, 16]``, V ``[num_blocks, Hkv, P/16, D, 16]``, FP8 stored as uint8,
  ``num_blocks = (size + P) // P`` (block 0 = SGLang's reserved padding page). Writes go through
  ``write_kv`` (which divides by the per-tensor scale itself and does *not* mutate the caller's
  K/V, unlike the in-tree pool), slot moves and CPU copies are page/offset aware.
* ``FlyDSLAttnBackend(model_runner, pa_impl=None)`` — the ``AttentionBackend``.
* ``install_kv_pool_hook()`` (alias ``register_hooks``) — idempotent; wraps SGLang's
  ``KVCacheConfigurator._resolve_kv_pool_class`` so that ``kind="mha"`` resolves to
  ``FlyDSLMHATokenToKVPool`` for the target model when the process's configured prefill or decode
  attention backend is ``flydsl`` and the platform itself asks for no pool class (a speculative
  draft worker keeps SGLang's pool).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from backend_core.lazy import LazyClasses

from . import contract as _contract
from .api import write_kv
from .plan import PAPlan, plan_decode, plan_prefill
from .fp8 import FP8_DTYPES

__all__ = ["FlyDSLAttnBackend", "FlyDSLMHATokenToKVPool", "install_kv_pool_hook", "register_hooks",
           "PAGE_SIZES", "HEAD_DIMS", "flydsl_backend_selected"]

log = logging.getLogger("flydsl_backends.pa.sglang")

PAGE_SIZES = (16, 64, 128)  # the SGLang pages this adapter is tested with (the op takes any multiple of 16)
HEAD_DIMS = _contract.HEAD_DIMS  # (64, 128, 256)
ACT_DTYPES = (torch.bfloat16, torch.float16)
FLYDSL = "flydsl"
_lock = threading.Lock()  # the hook installation

_WORKING = ("a working combination: --attention-backend flydsl --kv-cache-dtype fp8_e4m3 --page-size 16 "
            "(or 64 / 128) --dtype bfloat16, an MHA/GQA model with head_dim 64, 128 or 256")



# ----------------------------------------------------------------------------------------------
# checks shared by the pool and the backend


def _check_page_size(page_size) -> None:
    if page_size not in PAGE_SIZES:
        raise ValueError(f"--page-size {page_size} is not supported by the flydsl attention backend / KV pool; "
                         f"use --page-size 16, 64 or 128 ({_WORKING})")


def _check_kv_dtype(dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"--kv-cache-dtype: the flydsl attention backend reads an FP8 KV cache (e4m3fn, or e4m3fnuz "
                         f"on gfx942), got torch dtype {dtype}; use --kv-cache-dtype fp8_e4m3 ({_WORKING})")


def _check_head_dims(head_dim, v_head_dim) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"model head_dim {head_dim} is not supported by --attention-backend flydsl "
                         f"(supported: {HEAD_DIMS}; {_WORKING})")
    if v_head_dim is not None and v_head_dim != head_dim:
        raise ValueError(f"--attention-backend flydsl needs v_head_dim == head_dim (got {v_head_dim} vs {head_dim}); "
                         f"MLA / asymmetric heads are not served ({_WORKING})")


def flydsl_backend_selected() -> bool:
    """Whether this process's configured prefill or decode attention backend is ``flydsl``."""
    try:
        from sglang.srt.runtime_context import attention_backends

        return FLYDSL in tuple(attention_backends())
    except Exception:  # no published server args (tests, tools): not selected
        return False


# ----------------------------------------------------------------------------------------------
# the KV pool


def _build_pool_class():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

    class FlyDSLMHATokenToKVPool(MHATokenToKVPool):
        """FP8 paged KV pool in the docs/design.md §4 layout (SGLang's ``vectorized_5d`` shapes, X = 16).

        Constructed by SGLang's configurator with the in-tree keyword arguments. Slot ``s`` is
        block ``s // P``, offset ``s % P``; block 0 is the padding page SGLang reserves.
        """

        LAYOUT = "vectorized_5d"

        def __init__(self, size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                     v_head_dim=None, swa_head_num=None, swa_head_dim=None, swa_v_head_dim=None, **kwargs):
            _check_page_size(page_size)
            _check_kv_dtype(dtype)
            hd = swa_head_dim if swa_head_dim is not None else head_dim
            vhd = swa_v_head_dim if swa_v_head_dim is not None else (v_head_dim if v_head_dim is not None else hd)
            _check_head_dims(hd, vhd)
            if kwargs.get("post_capture_active"):
                raise ValueError("the flydsl KV pool does not support post-capture KV backing "
                                 "(leave the post-capture / elastic KV option off)")
            if kwargs.get("quant_method") is not None:
                raise ValueError("the flydsl KV pool stores plain FP8 with per-tensor scales; block-scaled KV "
                                 "quantization recipes (FP4 / MXFP8) are not supported: use --kv-cache-dtype fp8_e4m3")
            kwargs["kv_cache_layout"] = self.LAYOUT
            # the in-tree tiled slot-row copy assumes [slots, ...] rows; moves are done page-aware below
            kwargs["enable_kv_cache_copy"] = False
            self._kv_vector_x = 16  # 16 FP8 bytes per chunk (the in-tree code sets this only under AITER)
            self._scale_cache = {}
            super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                             v_head_dim=v_head_dim, swa_head_num=swa_head_num, swa_head_dim=swa_head_dim,
                             swa_v_head_dim=swa_v_head_dim, **kwargs)
            self._one = torch.ones((), dtype=torch.float32, device=self.device)
            # write_kv implementation; "auto" honours FLYDSL_BACKENDS_PA. FlyDSLAttnBackend(pa_impl=...) sets it.
            self.pa_impl = "auto"

        # -- helpers -----------------------------------------------------------------------
        def num_blocks(self) -> int:
            return (self.size + self.page_size) // self.page_size

        def caches(self, layer_id: int):
            """(key_cache, value_cache) FP8 views of layer ``layer_id`` in the docs/design.md §4 layout."""
            i = layer_id - self.start_layer
            return self.k_buffer[i].view(self.dtype), self.v_buffer[i].view(self.dtype)

        def scale_tensor(self, s) -> torch.Tensor:
            """A 0-dim / [1] fp32 device tensor for a scale given as None, a float or a tensor."""
            if s is None:
                return self._one
            if isinstance(s, torch.Tensor):
                if s.dtype == torch.float32 and s.device == self._one.device and s.numel() == 1:
                    return s.detach()
                return s.detach().to(device=self._one.device, dtype=torch.float32).reshape(())
            key = float(s)
            t = self._scale_cache.get(key)
            if t is None:
                t = torch.full((), key, dtype=torch.float32, device=self.device)
                self._scale_cache[key] = t
            return t

        def _page_off(self, loc: torch.Tensor):
            loc = loc.long()
            return loc // self.page_size, loc % self.page_size

        # -- writes ------------------------------------------------------------------------
        def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                          layer_id_override=None, dcp_kv_mask=None):
            loc, _, _ = unwrap_write_loc(loc_info)
            self._check_physical_write_loc(loc_info, "set_kv_buffer (flydsl MHA)")
            if dcp_kv_mask is not None:
                raise NotImplementedError("flydsl KV pool: decode context parallelism (dcp_kv_mask) is not supported")
            layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
            kc, vc = self.caches(layer_id)
            H, D, Dv = self.head_num, self.head_dim, self.v_head_dim
            cache_k = cache_k.reshape(-1, H, D)
            cache_v = cache_v.reshape(-1, H, Dv)
            if cache_k.dtype == self.dtype or cache_k.dtype == self.store_dtype:
                # already quantized (e.g. a transfer): place the bytes directly
                self._scatter_raw(kc, vc, loc, cache_k.view(self.dtype), cache_v.view(self.dtype))
                return
            if cache_k.dtype not in ACT_DTYPES:
                cache_k = cache_k.to(torch.bfloat16)
                cache_v = cache_v.to(torch.bfloat16)
            if cache_k.stride(-1) != 1:
                cache_k = cache_k.contiguous()
            if cache_v.stride(-1) != 1:
                cache_v = cache_v.contiguous()
            write_kv(cache_k, cache_v, kc, vc, loc, self.scale_tensor(k_scale), self.scale_tensor(v_scale),
                     backend=self.pa_impl)

        def _scatter_raw(self, kc, vc, loc, k, v):
            keep = loc >= 0
            loc, k, v = loc[keep], k[keep], v[keep]
            pg, off = self._page_off(loc)
            n = loc.numel()
            kc.view(torch.uint8)[pg, :, :, off, :] = k.view(torch.uint8).reshape(n, self.head_num, -1, 16)
            vc.view(torch.uint8)[pg, :, off // 16, :, off % 16] = v.view(torch.uint8)

        # -- slot moves / CPU offload (slot-indexed in the in-tree pool) ---------------------
        def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
            if self.layer_num == 0 or tgt_loc.numel() == 0:
                return
            pt, ot = self._page_off(tgt_loc)
            ps, os_ = self._page_off(src_loc)
            for kb, vb in zip(self.k_buffer, self.v_buffer):
                kb[pt, :, :, ot, :] = kb[ps, :, :, os_, :]
                vb[pt, :, ot // 16, :, ot % 16] = vb[ps, :, os_ // 16, :, os_ % 16]

        def _gather_slots(self, i, loc):
            pg, off = self._page_off(loc)
            return (self.k_buffer[i][pg, :, :, off, :], self.v_buffer[i][pg, :, off // 16, :, off % 16])

        def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
            idx = torch.as_tensor(indices, device=self.k_buffer[0].device)
            out = []
            for i in range(self.layer_num):
                chunks = []
                for s in range(0, idx.numel(), self.cpu_offloading_chunk_size):
                    k, v = self._gather_slots(i, idx[s:s + self.cpu_offloading_chunk_size])
                    chunks.append([k.cpu(), v.cpu()])
                out.append(chunks)
            return out

        def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
            idx = torch.as_tensor(indices, device=self.k_buffer[0].device)
            cs = self.cpu_offloading_chunk_size
            for i in range(self.layer_num):
                for s in range(0, idx.numel(), cs):
                    k_cpu, v_cpu = kv_cache_cpu[i][s // cs]
                    pg, off = self._page_off(idx[s:s + cs])
                    self.k_buffer[i][pg, :, :, off, :] = k_cpu.to(self.k_buffer[i].device)
                    self.v_buffer[i][pg, :, off // 16, :, off % 16] = v_cpu.to(self.v_buffer[i].device)

    return FlyDSLMHATokenToKVPool


# ----------------------------------------------------------------------------------------------
# the pool hook


def install_kv_pool_hook() -> bool:
    """Make SGLang build :class:`FlyDSLMHATokenToKVPool` for the target model's MHA pools when flydsl
    is the configured attention backend (idempotent; returns True when it installed the wrapper,
    False when it was already in place).

    Wraps ``KVCacheConfigurator._resolve_kv_pool_class`` (sglang 0.5.23: the one place that asks
    the platform, ``SRTPlatform.get_kv_pool_cls``, for a pool class; every MHA pool build site, the
    hybrid-linear full-attention leaf and the SWA composite included, uses its answer). The
    configurator knows whether it builds a speculative draft worker's pool: a draft runs on its own
    ``--speculative-draft-attention-backend`` and keeps SGLang's pool. When the platform names its
    own class, that class is kept (and the backend's construction check then names the problem).
    """
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    with _lock:
        cls = KVCacheConfigurator
        current = cls.__dict__.get("_resolve_kv_pool_class")
        if getattr(current, "_flydsl_wrapped", False):
            return False
        original = current

        def _resolve_kv_pool_class(self, *, kind, default):
            pool_cls = original(self, kind=kind, default=default)
            if (kind == "mha" and pool_cls is default and not getattr(self, "is_draft_worker", False)
                    and flydsl_backend_selected()):
                return _get_class("FlyDSLMHATokenToKVPool")
            return pool_cls

        _resolve_kv_pool_class._flydsl_wrapped = True
        _resolve_kv_pool_class.__wrapped__ = original
        _resolve_kv_pool_class.__doc__ = original.__doc__
        cls._resolve_kv_pool_class = _resolve_kv_pool_class
        return True


register_hooks = install_kv_pool_hook


# ----------------------------------------------------------------------------------------------
# the attention backend


@dataclass
class FlyDSLForwardMetadata:
    block_tables: torch.Tensor  # [bs, max_blocks] int32 page ids
    context_lens: torch.Tensor  # [bs] int32, new tokens included
    query_start_loc: Optional[torch.Tensor]  # [bs + 1] int32 for extend / mixed; None for decode / verify
    query_length: int = 1  # rows per request on the pa_decode path (target verify: the draft tokens, 2..4)
    plan: Optional[PAPlan] = None  # the batch's paged-attention plan (built once, run by every layer)


def _kv_pool_leaf(pool):
    return getattr(pool, "full_kv_pool", None) or pool


def _build_backend_class():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool_cls = _get_class("FlyDSLMHATokenToKVPool")

    class FlyDSLAttnBackend(AttentionBackend):
        """``--attention-backend flydsl``: FP8 paged attention for MHA/GQA models.

        ``pa_impl`` picks the op implementation (``torch`` | ``triton`` | ``flydsl`` | ``auto``);
        default: ``auto``, which honours ``FLYDSL_BACKENDS_PA``.
        Decode (query length 1) → ``pa_decode``; extend / mixed → ``pa_prefill``; K/V written at
        ``out_cache_loc`` through the pool (``write_kv``). Decode CUDA graphs: static block table
        and context-length buffers, filled in place by ``init_forward_metadata_out_graph``.
        Speculative decoding (EAGLE / EAGLE3 / NEXTN / STANDALONE with ``--speculative-eagle-topk 1``):
        TARGET_VERIFY batches (``seq_lens`` without the draft tokens; their slots already in
        ``req_to_token``) run ``pa_decode`` with ``query_length`` = draft tokens (2..4) and context
        ``seq_lens + n``, eager and in CUDA graphs. Draft-model passes run on the draft worker's own
        backend (``--speculative-draft-attention-backend``) over SGLang's own pool.
        """

        def __init__(self, model_runner, pa_impl: Optional[str] = None):
            super().__init__()
            self.pa_impl = pa_impl or "auto"
            self.device = torch.device(model_runner.device)
            if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
                # the planner's workspace is keyed by the tensors' device (cuda:N), not "cuda"
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.req_to_token = self.req_to_token_pool.req_to_token
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
            self.page_size = int(model_runner.page_size)
            self.kv_cache_dtype = model_runner.kv_cache_dtype
            self.data_type = model_runner.dtype
            self.needs_cpu_seq_lens = False  # only device seq_lens are read
            self.forward_metadata = None
            self.max_context_len = int(self.req_to_token.shape[1])

            self._validate(model_runner)
            if pa_impl:
                _kv_pool_leaf(self.token_to_kv_pool).pa_impl = self.pa_impl  # the pool's write_kv follows
            P = self.page_size
            self.max_blocks = -(-self.max_context_len // P)
            self._page_starts = torch.arange(0, self.max_blocks * P, P, dtype=torch.long, device=self.device)
            self._one = torch.ones((), dtype=torch.float32, device=self.device)
            self.cuda_graph_block_tables = None
            self.cuda_graph_context_lens = None
            self.cuda_graph_max_bs = 0
            self.cuda_graph_query_length = 1

        # -- construction checks -----------------------------------------------------------
        def _validate(self, runner):
            if getattr(runner, "use_mla_backend", False):
                raise ValueError("--attention-backend flydsl serves MHA/GQA attention, this model uses MLA; use "
                                 "--attention-backend aiter (or triton) with --linear-attn-decode-backend flydsl "
                                 "for Kimi-Linear / Kimi-K3, or " + _WORKING)
            mc = getattr(runner, "model_config", None)
            arch = getattr(mc, "attention_arch", None)
            if arch is not None and getattr(arch, "name", str(arch)) == "MLA":
                raise ValueError("--attention-backend flydsl: the model's attention is MLA (not served); " + _WORKING)
            _check_page_size(self.page_size)
            _check_kv_dtype(self.kv_cache_dtype)
            self._check_model_layers(runner)
            if self.data_type not in ACT_DTYPES:
                raise ValueError(f"--dtype: the flydsl attention backend computes in bfloat16 or float16, got "
                                 f"{self.data_type}; use --dtype bfloat16 ({_WORKING})")
            # speculative decoding: the combination is checked at argument resolution (the plugin) and the
            # draft-chain shape per verify batch (_verify_tokens)
            from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

            if isinstance(self.token_to_kv_pool, BaseSWAKVPool):
                raise ValueError("--attention-backend flydsl does not serve the hybrid full/SWA KV pool (separate "
                                 "sliding-window sub-pool with translated locations); start the server with "
                                 "--disable-hybrid-swa-memory (sliding windows are then applied in the kernel)")
            leaf = _kv_pool_leaf(self.token_to_kv_pool)
            if not isinstance(leaf, pool_cls):
                raise ValueError(
                    f"--attention-backend flydsl needs its FP8 paged KV pool (FlyDSLMHATokenToKVPool), but the "
                    f"runner's pool is {type(leaf).__name__}: the flydsl plugin installs it through "
                    f"pa_backend.sglang.install_kv_pool_hook() (SRTPlatform.get_kv_pool_cls); a platform that "
                    f"returns its own MHA pool class cannot be combined with flydsl")
            if leaf.page_size != self.page_size:
                raise ValueError(f"--page-size mismatch: runner {self.page_size}, KV pool {leaf.page_size}")
            _check_head_dims(leaf.head_dim, leaf.v_head_dim)
            tr = self.kv_index_translator
            if tr is not None and (getattr(tr, "is_translating", False) or getattr(tr, "reads_are_translated", False)):
                raise ValueError("--attention-backend flydsl reads physical page ids straight from req_to_token; the "
                                 "unified (virtual->physical translated) KV pool and decode context parallelism are "
                                 "not supported: leave unified memory / DCP off")
            self.num_kv_heads = leaf.head_num
            self.head_dim = leaf.head_dim
            tp = 1
            try:
                from sglang.srt.runtime_context import get_parallel

                tp = int(get_parallel().attn_tp_size)
            except Exception:
                pass
            self.num_q_heads = None
            if mc is not None and hasattr(mc, "get_num_attention_heads"):
                self.num_q_heads = int(mc.get_num_attention_heads(tp))
                g = self.num_q_heads // self.num_kv_heads
                if self.num_q_heads % self.num_kv_heads or not 1 <= g <= _contract.MAX_GQA:
                    raise ValueError(f"--attention-backend flydsl supports GQA ratios 1..{_contract.MAX_GQA}; got "
                                     f"{self.num_q_heads} query heads over {self.num_kv_heads} KV heads per rank")

        @staticmethod
        def _check_model_layers(runner):
            """At start-up (SGLang builds attention backends after loading the model): reject what the
            forward would refuse at the first request — embedding / encoder-only models, cross-attention,
            non-causal layers, logit soft-capping (Gemma-2, Grok) — naming the working combination."""
            if getattr(runner, "is_generation", True) is False:
                raise ValueError("--attention-backend flydsl serves causal decoder (generation) models; this is an "
                                 "embedding / encoder-only model: use --attention-backend triton for it (" + _WORKING + ")")
            model = getattr(runner, "model", None)
            if model is None or not hasattr(model, "named_modules"):
                return
            from sglang.srt.layers.radix_attention import RadixAttention

            for name, m in model.named_modules():
                if not isinstance(m, RadixAttention):
                    continue
                if getattr(m, "is_cross_attention", False) or \
                        getattr(getattr(m, "attn_type", None), "name", "DECODER") != "DECODER":
                    raise ValueError(f"--attention-backend flydsl serves causal decoder self-attention only; layer "
                                     f"{name} is cross-attention or non-causal: use --attention-backend triton "
                                     f"(or flashinfer) for this model ({_WORKING})")
                if (getattr(m, "logit_cap", 0) or 0) > 0:
                    raise ValueError(f"--attention-backend flydsl does not apply logit soft-capping (layer {name}: "
                                     f"logit_cap={m.logit_cap}, e.g. Gemma-2 / Grok): use --attention-backend triton "
                                     f"for this model ({_WORKING})")

        # -- metadata ----------------------------------------------------------------------
        def _block_table(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
            """[bs, max_blocks] int32 page ids: req_to_token[row, j*P] // P (static shape, no host sync;
            padded rows use req-pool row 0, which is all zeros, i.e. page 0)."""
            rows = req_pool_indices.long()[:, None]
            return torch.div(self.req_to_token[rows, self._page_starts[None, :]], self.page_size,
                             rounding_mode="floor").to(torch.int32)

        @staticmethod
        def _reject_spec(mode):
            if mode.is_target_verify():
                return
            if mode.is_draft_extend_v2() or getattr(mode, "name", "").startswith("DRAFT"):
                raise NotImplementedError(f"flydsl attention backend: forward mode {mode.name} (a draft-model pass) is "
                                          "not served; the draft runs on --speculative-draft-attention-backend")

        @staticmethod
        def _verify_tokens(spec_info, default: int) -> int:
            """Draft tokens per request of a TARGET_VERIFY batch (spec_info's count, else ``default``);
            topk 1 only: a chain, so causal masking among the drafts is exact."""
            topk = getattr(spec_info, "topk", 1)
            if topk not in (None, 1):
                raise NotImplementedError(f"flydsl attention backend: target verify of a draft tree (topk={topk}) is "
                                          "not supported; use --speculative-eagle-topk 1")
            n = int(getattr(spec_info, "num_tokens_per_req", -1) or -1)
            if n <= 0:
                n = int(getattr(spec_info, "draft_token_num", -1) or -1)
            if n <= 0:
                n = default
            if not 1 <= n <= _contract.MAX_QUERY_LENGTH:
                raise NotImplementedError(f"flydsl attention backend: target verify with {n} draft tokens per request; "
                                          f"supported 1..{_contract.MAX_QUERY_LENGTH} (--speculative-num-draft-tokens)")
            return n

        def init_forward_metadata(self, forward_batch):
            mode = forward_batch.forward_mode
            if mode.is_idle():
                self.forward_metadata = None
                return
            self._reject_spec(mode)
            bs = int(forward_batch.batch_size)
            bt = self._block_table(forward_batch.req_pool_indices[:bs])
            cl = forward_batch.seq_lens[:bs].to(torch.int32)
            qsl = None
            max_context = self._max_context(forward_batch, bs)
            if mode.is_target_verify():
                n = self._verify_tokens(forward_batch.spec_info, int(forward_batch.out_cache_loc.shape[0]) // max(bs, 1))
                md = FlyDSLForwardMetadata(bt, cl + n, None, n)
                md.plan = plan_decode(md.block_tables, md.context_lens, query_length=n,
                                      max_context=None if max_context is None else max_context + n)
                self.forward_metadata = md
                return
            if not mode.is_decode():
                lens = getattr(forward_batch, "extend_seq_lens", None)
                lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
                if lens is None:  # a decode batch relabelled as a 1-token extend (DP padding)
                    qsl = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
                    qsl_host = list(range(bs + 1))
                else:
                    qsl = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
                    torch.cumsum(lens[:bs].to(torch.int32), 0, out=qsl[1:])
                    qsl_host = None
                    if lens_cpu is not None:  # SGLang's host copy of the extend lengths: no sync
                        qsl_host = [0]
                        for x in list(lens_cpu)[:bs]:
                            qsl_host.append(qsl_host[-1] + int(x))
                md = FlyDSLForwardMetadata(bt, cl, qsl)
                md.plan = plan_prefill(bt, qsl, cl, query_start_loc_host=qsl_host, max_context=max_context)
            else:
                md = FlyDSLForwardMetadata(bt, cl, None)
                md.plan = plan_decode(bt, cl, max_context=max_context)
            self.forward_metadata = md

        @staticmethod
        def _max_context(forward_batch, bs: int):
            """The batch's longest context from SGLang's host copy of seq_lens (None when absent)."""
            cpu = getattr(forward_batch, "seq_lens_cpu", None)
            if cpu is None or bs == 0:
                return None
            return int(cpu[:bs].max())

        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
            n = max_num_tokens // max_bs if max_bs > 0 else 1
            if max_bs <= 0 or max_num_tokens != n * max_bs or not 1 <= n <= _contract.MAX_QUERY_LENGTH:
                raise NotImplementedError(f"flydsl attention backend: CUDA graphs need 1..{_contract.MAX_QUERY_LENGTH} "
                                          f"query tokens per request (got max_num_tokens={max_num_tokens} for "
                                          f"max_bs={max_bs})")
            if self.cuda_graph_block_tables is None or self.cuda_graph_max_bs < max_bs:
                self.cuda_graph_block_tables = torch.zeros((max_bs, self.max_blocks), dtype=torch.int32,
                                                           device=self.device)
                self.cuda_graph_context_lens = torch.ones((max_bs,), dtype=torch.int32, device=self.device)
                self.cuda_graph_max_bs = max_bs
            self.cuda_graph_query_length = n  # 1: decode graphs; 2..4: target-verify graphs (speculative decoding)
            if self.device.type == "cuda" and self.num_q_heads is not None:
                from .planner import reserve

                reserve(max_bs, self.num_q_heads, self.num_kv_heads, self.head_dim, self.max_blocks * self.page_size,
                        self.page_size, query_length=n, device=self.device)

        def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
            """Capture (real ForwardBatch, in_capture=True) and replay (a SimpleNamespace view): fill the
            static buffers' first ``bs`` rows in place; the metadata always views those buffers.
            Decode and TARGET_VERIFY (context = seq_lens + draft tokens) batches."""
            mode = forward_batch.forward_mode
            verify = mode.is_target_verify()
            if not (mode.is_decode() or verify):
                self._reject_spec(mode)
                raise NotImplementedError(f"flydsl attention backend: CUDA graphs for {mode.name} are not supported")
            if self.cuda_graph_block_tables is None:
                raise RuntimeError("init_cuda_graph_state must run before init_forward_metadata_out_graph")
            bs = int(forward_batch.batch_size)
            n = self._verify_tokens(getattr(forward_batch, "spec_info", None), self.cuda_graph_query_length) \
                if verify else 1
            bt = self.cuda_graph_block_tables[:bs]
            cl = self.cuda_graph_context_lens[:bs]
            bt.copy_(self._block_table(forward_batch.req_pool_indices[:bs]))
            # decode seq_lens include the new token; verify seq_lens exclude the n drafts
            torch.add(forward_batch.seq_lens[:bs], n if verify else 0, out=cl)
            # shape-only plan over the static buffers: the captured kernels split the replayed contexts
            self.forward_metadata = FlyDSLForwardMetadata(bt, cl, None, n, plan_decode(bt, cl, query_length=n))

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
            pass

        # -- forward -----------------------------------------------------------------------
        def _layer_args(self, layer, kwargs):
            if layer.is_cross_attention or getattr(getattr(layer, "attn_type", None), "name", "DECODER") != "DECODER":
                raise NotImplementedError("flydsl attention backend: only causal decoder self-attention is supported")
            if layer.logit_cap and layer.logit_cap > 0:
                raise NotImplementedError("flydsl attention backend: logit capping (logit_cap > 0) is not supported")
            if layer.qk_head_dim != layer.v_head_dim:
                raise NotImplementedError("flydsl attention backend: qk_head_dim != v_head_dim is not supported")
            sw = layer.sliding_window_size
            # SGLang's window w admits keys q-w .. q (w + 1 tokens, as torch_native / flashinfer / the triton
            # extend kernel do); the op's sliding_window counts tokens including the current one.
            sliding_window = int(sw) + 1 if sw is not None and sw > -1 else 0
            sinks = kwargs.get("sinks")
            if sinks is not None and sinks.dtype != torch.float32:
                sinks = sinks.float()
            ks = layer.k_scale if layer.k_scale is not None else self._one
            vs = layer.v_scale if layer.v_scale is not None else self._one
            return sliding_window, sinks, ks.detach(), vs.detach()

        def _save_kv(self, layer, forward_batch, k, v, save_kv_cache):
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v,
                                                    layer.k_scale, layer.v_scale)

        def _caches(self, layer):
            return (self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                    self.token_to_kv_pool.get_value_buffer(layer.layer_id))

        def _prologue(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs):
            """Shared by decode and extend: layer arguments, the K/V write, caches, [T, Hq, D] query
            view and a fresh output."""
            sliding_window, sinks, ks, vs = self._layer_args(layer, kwargs)
            self._save_kv(layer, forward_batch, k, v, save_kv_cache)
            kc, vc = self._caches(layer)
            H, D = layer.tp_q_head_num, layer.qk_head_dim
            q3 = q.reshape(-1, H, D)
            o = torch.empty((q3.shape[0], H, layer.v_head_dim), dtype=q3.dtype, device=q3.device)
            return sliding_window, sinks, ks, vs, kc, vc, q3, o, self.forward_metadata

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
            sliding_window, sinks, ks, vs, kc, vc, q3, o, md = self._prologue(q, k, v, layer, forward_batch,
                                                                              save_kv_cache, kwargs)
            md.plan.run(q3, kc, vc, ks, vs, softmax_scale=layer.scaling, sliding_window=sliding_window, sinks=sinks,
                        out=o, backend=self.pa_impl)
            return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
            mode = forward_batch.forward_mode
            self._reject_spec(mode)
            if mode.is_target_verify():  # draft tokens: query_length rows per request, on the decode kernel
                return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            sliding_window, sinks, ks, vs, kc, vc, q3, o, md = self._prologue(q, k, v, layer, forward_batch,
                                                                              save_kv_cache, kwargs)
            if md.query_start_loc is None:  # a decode-shaped metadata relabelled as a 1-token extend
                raise RuntimeError("flydsl attention backend: extend forward without extend metadata")
            md.plan.run(q3, kc, vc, ks, vs, softmax_scale=layer.scaling, sliding_window=sliding_window, sinks=sinks,
                        out=o, backend=self.pa_impl)
            return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    return FlyDSLAttnBackend


_lazy = LazyClasses(__name__, {"FlyDSLMHATokenToKVPool": _build_pool_class, "FlyDSLAttnBackend": _build_backend_class})
_get_class = _lazy.get
__getattr__ = _lazy.module_getattr  # PEP 562: the framework subclasses are built on first use
