"""SGLang 0.5.23 adapter, what runs before any model is built: the server-argument policy of
``--attention-backend flydsl``, the checks shared by the backend and its pool, and the hook that makes
SGLang build the pool. It imports no SGLang module at import time (the plugin and the CPU tests use it
on any machine); the framework classes live in ``pa_backend.sglang_backend`` (``FlyDSLAttnBackend``)
and ``pa_backend.sglang_pool`` (``FlyDSLMHATokenToKVPool``).

* ``check_server_args(cfg, is_mla)`` — the server-argument policy of ``--attention-backend flydsl``
  (FP8 KV, page sizes, MHA/GQA only, speculative decoding as draft chains of 2..4 tokens), run by the
  plugin's resolution hook before any model is built.
* ``install_kv_pool_hook()`` — idempotent; wraps SGLang's ``KVCacheConfigurator._resolve_kv_pool_class``
  so that ``kind="mha"`` resolves to ``FlyDSLMHATokenToKVPool`` for the target model when the
  process's configured prefill or decode attention backend is ``flydsl`` and the platform itself asks
  for no pool class (a speculative draft worker keeps SGLang's pool).
"""

from __future__ import annotations

import logging
import threading

import torch

from backend_core import names

from . import contract as _contract
from .fp8 import FP8_DTYPES

__all__ = ["check_server_args", "uses_flydsl_attention", "resolve_prefill_cuda_graph", "install_kv_pool_hook",
           "flydsl_backend_selected", "PAGE_SIZES", "HEAD_DIMS"]

log = logging.getLogger("flydsl_backends.sglang")

PAGE_SIZES = (16, 64, 128)  # the SGLang pages this adapter is tested with (the op takes any multiple of 16)
HEAD_DIMS = _contract.HEAD_DIMS  # (64, 128, 256)
ACT_DTYPES = (torch.bfloat16, torch.float16)
FLYDSL = names.FLYDSL
_lock = threading.Lock()  # the hook installation

WORKING = ("a working combination: --attention-backend flydsl --kv-cache-dtype fp8_e4m3 --page-size 16 "
           "(or 64 / 128) --dtype bfloat16, an MHA/GQA model with head_dim 64, 128 or 256")


# ----------------------------------------------------------------------------------------------
# server-argument policy (checked when SGLang resolves its arguments, before any model is built)

FP8_KV_DTYPES = ("fp8_e4m3",)
SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")  # draft chains verified by the target
MAX_DRAFT_TOKENS = _contract.MAX_QUERY_LENGTH  # pa_decode's query_length limit (4)
_SPEC_WORKING = ("--speculative-algorithm EAGLE3 --speculative-eagle-topk 1 --speculative-num-steps 2 "
                 "--speculative-num-draft-tokens 3 --speculative-draft-attention-backend triton")


def uses_flydsl_attention(cfg) -> bool:
    """Whether the resolved server args ``cfg`` put flydsl on the prefill or the decode attention path."""
    return FLYDSL in (cfg.prefill_attention_backend or cfg.attention_backend,
                      cfg.decode_attention_backend or cfg.attention_backend)


def resolve_prefill_cuda_graph(server_args) -> None:
    """Argument-resolution step (at SGLang's own prefill-graph decision for a backend): with flydsl on the
    prefill path, SGLang's prefill CUDA graph (breakable by default on CUDA) is turned off. Its eager
    attention segments run this backend with the graph's padded batches, which have never run on a GPU
    with it; the decode graphs are unaffected. Asked for explicitly (``--cuda-graph-backend-prefill``),
    it is refused with the flag to drop."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolved_view, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    cfg = resolving_view(server_args)
    view = resolved_view(server_args)
    if (view.prefill_attention_backend or view.attention_backend) != FLYDSL:
        return
    graphs = cfg.cuda_graph_config
    if graphs.prefill.backend == Backend.DISABLED:
        return
    if (Phase.PREFILL, "backend") in getattr(server_args, "_cuda_graph_config_locked", ()):
        raise ValueError(f"--attention-backend flydsl does not run under SGLang's prefill CUDA graph "
                         f"({graphs.prefill.backend}): drop --cuda-graph-backend-prefill (or add "
                         "--disable-prefill-cuda-graph); decode CUDA graphs are supported")
    log.warning(
        "--attention-backend flydsl: SGLang's prefill CUDA graph (%s) turned off (prefill runs eagerly; decode "
        "CUDA graphs stay on)", graphs.prefill.backend)
    declare_resolution(server_args, "flydsl_backends_disable_prefill_cuda_graph",
                       cuda_graph_config=with_phase(graphs, Phase.PREFILL, backend=Backend.DISABLED))


def check_server_args(cfg, is_mla: bool) -> None:
    """Reject flag combinations ``--attention-backend flydsl`` cannot serve (``cfg``: resolved server
    args; ``is_mla``: the model's full-attention layers are MLA). Raises ValueError naming the flag,
    what was given and a combination that works. No-op when flydsl attention is not selected."""
    if not uses_flydsl_attention(cfg):
        return
    if is_mla:
        raise ValueError(
            "--attention-backend flydsl serves MHA/GQA attention; this model's full-attention layers are MLA "
            "(Kimi-Linear, Kimi-K3, DeepSeek). Keep the platform's MLA backend and use flydsl for the KDA layers: "
            "--attention-backend aiter --linear-attn-decode-backend flydsl (AMD) or --attention-backend triton "
            "--linear-attn-decode-backend flydsl")
    prefill = cfg.prefill_attention_backend or cfg.attention_backend
    decode = cfg.decode_attention_backend or cfg.attention_backend
    if prefill != decode:  # one side only: the other backend would read the flydsl pool's layout as its own
        flag, other = (("--prefill-attention-backend", prefill) if decode == FLYDSL
                       else ("--decode-attention-backend", decode))
        raise ValueError(
            f"{flag} {other} with flydsl on the other path: the KV pool flydsl selects stores the FP8 cache in the "
            f"layout only flydsl reads (x-packed K, per-page V), which {other} would misread; use flydsl for both "
            "(--attention-backend flydsl)")
    _check_kv_transfers(cfg)
    if getattr(cfg, "enable_pdmux", False):
        raise ValueError(
            "--enable-pdmux with --attention-backend flydsl: PD multiplexing runs a prefill and a decode batch at the "
            "same time on two streams, and flydsl's split-K workspace and task queue are one per GPU (two batches in "
            "flight would overwrite each other's partial results); drop --enable-pdmux")
    kv = str(cfg.kv_cache_dtype or "auto")
    if kv not in FP8_KV_DTYPES:
        raise ValueError(
            f"--attention-backend flydsl reads an FP8 KV cache: use --kv-cache-dtype fp8_e4m3 (got {kv!r}; on "
            "gfx942 the pool stores e4m3fnuz automatically)")
    page = cfg.page_size
    if page not in PAGE_SIZES:
        raise ValueError(f"--attention-backend flydsl supports --page-size 16, 64 or 128 (got {page}); "
                         "e.g. --page-size 16")
    _check_speculative(cfg)


def _check_kv_transfers(cfg) -> None:
    """KV moved between servers: the flydsl pool's pages hold the x-packed layout, while SGLang's transfers
    between servers address tokens and heads as in its own [slots, H, D] pool (PD disaggregation across
    different TP sizes, the staging buffer) or hand the pages to a server that reads them as its own layout
    (a peer or a shared HiCache storage on another backend). One server cannot see its peers: refused."""
    mode = str(getattr(cfg, "disaggregation_mode", None) or "null")
    if mode != "null":
        raise ValueError(f"--disaggregation-mode {mode} with --attention-backend flydsl: the KV transfer between "
                         "servers reads SGLang's token-major pool layout (and a peer on another backend would read "
                         "flydsl's pages as its own); serve disaggregated deployments with --attention-backend triton")
    storage = getattr(cfg, "hicache_storage_backend", None)
    if storage:
        raise ValueError(f"--hicache-storage-backend {storage} with --attention-backend flydsl: the storage would "
                         "hold flydsl's page layout for any server sharing it to read as its own; use host-memory "
                         "HiCache only (--enable-hierarchical-cache without a storage backend)")
    if getattr(cfg, "disaggregation_decode_enable_offload_kvcache", False):
        raise ValueError("--disaggregation-decode-enable-offload-kvcache with --attention-backend flydsl: the "
                         "offloaded pages keep flydsl's layout for other servers to read as theirs")
    canary = str(getattr(cfg, "kv_canary", None) or "none")
    if canary != "none":  # a debugging tool, but one that writes into the pool
        raise ValueError(f"--kv-canary {canary} with --attention-backend flydsl: the canary reads and writes the "
                         "pool as SGLang's [slots, H, D] token rows, while flydsl's pages hold another layout; "
                         "use --kv-canary none")


def _check_speculative(cfg) -> None:
    """Speculative decoding on flydsl attention: the target's verify batches are draft *chains* of
    2..4 tokens (pa_decode with query_length n); the draft model runs on another backend."""
    spec = getattr(cfg, "speculative_algorithm", None)
    if spec in (None, "", "NONE", "none"):
        return
    if str(spec).upper() not in SPEC_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {spec} with --attention-backend flydsl: only "
                         f"{'/'.join(SPEC_ALGORITHMS)} (draft chains) are verified on flydsl; e.g. {_SPEC_WORKING}")
    topk = getattr(cfg, "speculative_eagle_topk", None)
    if topk != 1:
        raise ValueError(f"--speculative-eagle-topk {topk} with --attention-backend flydsl: the target verifies draft "
                         f"chains only (a tree needs a custom mask); use --speculative-eagle-topk 1, e.g. "
                         f"{_SPEC_WORKING}")
    n = getattr(cfg, "speculative_num_draft_tokens", None)
    if not isinstance(n, int) or not 2 <= n <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-draft-tokens {n} with --attention-backend flydsl: verify runs 2.."
                         f"{MAX_DRAFT_TOKENS} tokens per request (--speculative-num-steps 1..3); e.g. {_SPEC_WORKING}")
    if getattr(cfg, "speculative_adaptive", False):
        # the adaptive controller switches between tiers of candidate_steps + 1 draft tokens at run time
        from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config

        steps = resolve_candidate_steps_from_config(cfg_path=getattr(cfg, "speculative_adaptive_config", None))
        widest = max(steps) + 1
        if widest > MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-adaptive with --attention-backend flydsl: the adaptive tiers verify up to "
                             f"{widest} draft tokens per request (candidate_steps + 1) and flydsl verifies at most "
                             f"{MAX_DRAFT_TOKENS}; drop --speculative-adaptive or pass --speculative-adaptive-config "
                             f"whose candidate_steps are all <= {MAX_DRAFT_TOKENS - 1}")
    draft = getattr(cfg, "speculative_draft_attention_backend", None)
    if not draft or draft == FLYDSL:
        raise ValueError(f"--speculative-draft-attention-backend {draft}: the draft model's multi-step passes do not "
                         "run on flydsl (SGLang builds them from its own backend map); name the draft's backend, "
                         f"e.g. {_SPEC_WORKING}")


# ----------------------------------------------------------------------------------------------
# checks shared by the pool and the backend


def check_page_size(page_size) -> None:
    if page_size not in PAGE_SIZES:
        raise ValueError(f"--page-size {page_size} is not supported by the flydsl attention backend / KV pool; "
                         f"use --page-size 16, 64 or 128 ({WORKING})")


def check_kv_dtype(dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"--kv-cache-dtype: the flydsl attention backend reads an FP8 KV cache (e4m3fn, or e4m3fnuz "
                         f"on gfx942), got torch dtype {dtype}; use --kv-cache-dtype fp8_e4m3 ({WORKING})")


def check_head_dims(head_dim, v_head_dim) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"model head_dim {head_dim} is not supported by --attention-backend flydsl "
                         f"(supported: {HEAD_DIMS}; {WORKING})")
    if v_head_dim is not None and v_head_dim != head_dim:
        raise ValueError(f"--attention-backend flydsl needs v_head_dim == head_dim (got {v_head_dim} vs {head_dim}); "
                         f"MLA / asymmetric heads are not served ({WORKING})")


def flydsl_backend_selected() -> bool:
    """Whether this process's configured prefill or decode attention backend is ``flydsl``."""
    try:
        from sglang.srt.runtime_context import attention_backends

        return FLYDSL in tuple(attention_backends())
    except Exception:  # no published server args (tests, tools): not selected
        return False


# ----------------------------------------------------------------------------------------------
# the pool hook


def install_kv_pool_hook() -> bool:
    """Make SGLang build :class:`pa_backend.sglang_pool.FlyDSLMHATokenToKVPool` for the target model's
    MHA pools when flydsl is the configured attention backend (idempotent; returns True when it
    installed the wrapper, False when it was already in place).

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
                from .sglang_pool import FlyDSLMHATokenToKVPool

                return FlyDSLMHATokenToKVPool
            return pool_cls

        _resolve_kv_pool_class._flydsl_wrapped = True
        _resolve_kv_pool_class.__wrapped__ = original
        _resolve_kv_pool_class.__doc__ = original.__doc__
        cls._resolve_kv_pool_class = _resolve_kv_pool_class
        return True
