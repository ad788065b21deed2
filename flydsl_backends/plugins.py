"""Framework plugins: the targets of the package's entry points.

* ``register_sglang()`` — entry point group ``sglang.srt.plugins`` (SGLang 0.5.23 calls it with no
  arguments in every process, before argument parsing). It adds ``flydsl`` to the choices of
  ``--attention-backend`` (and ``--decode-/--prefill-attention-backend``) and of
  ``--linear-attn-decode-backend``, registers the attention backend factory, the KV-pool hook of
  the FP8 x-packed layout, the KDA decode-kernel hook and a resolution-time check that rejects
  unsupported combinations with a message naming a working one.

* ``register_vllm()`` — entry point group ``vllm.general_plugins`` (vLLM 0.33 calls it once in every
  process: CLI, engine core, workers). It registers ``FLYDSL`` (``--attention-backend FLYDSL``) and
  the spawn-safe ``CUSTOM`` slot for ``pa_backend.vllm.FlyDSLAttentionBackend``, and the KDA layer
  hooks (``PluggableLayer.register_oot``), which run our decode only when the user opts in with
  ``--additional-config '{"flydsl_kda": true}'``.

Each function is idempotent. Importing this module imports nothing but the standard library;
the framework modules are imported inside the functions (the framework is already loaded when it
calls them), and FlyDSL / Triton only when a kernel first runs.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["register_sglang", "register_vllm", "check_sglang_args"]

log = logging.getLogger("flydsl_backends.plugins")
_lock = threading.Lock()
_done = set()

FLYDSL = "flydsl"
PAGE_SIZES = (16, 64, 128)
FP8_KV_DTYPES = ("fp8_e4m3",)


def _once(name: str) -> bool:
    with _lock:
        if name in _done:
            return False
        _done.add(name)
        return True


def _check_linear_attn_flags(cfg) -> None:
    """flydsl is a decode-only KDA kernel backend: prefill and verify stay on SGLang's kernels."""
    for flag, value in (("--linear-attn-backend", getattr(cfg, "linear_attn_backend", None)),
                        ("--linear-attn-prefill-backend", getattr(cfg, "linear_attn_prefill_backend", None)),
                        ("--linear-attn-verify-backend", getattr(cfg, "linear_attn_verify_backend", None))):
        if value == FLYDSL:
            raise ValueError(
                f"{flag} flydsl: the flydsl KDA backend serves decode only (prefill and speculative verify stay on "
                "SGLang's kernels); use --linear-attn-decode-backend flydsl and leave the others unset")


def _uses_flydsl_attention(cfg) -> bool:
    return FLYDSL in (cfg.prefill_attention_backend or cfg.attention_backend,
                      cfg.decode_attention_backend or cfg.attention_backend)


def check_sglang_args(cfg, is_mla: bool) -> None:
    """Reject flag combinations the flydsl backends cannot serve (``cfg``: resolved server args).
    Raises ValueError naming the flag, what was given and a combination that works."""
    _check_linear_attn_flags(cfg)
    if not _uses_flydsl_attention(cfg):
        return
    if is_mla:
        raise ValueError(
            "--attention-backend flydsl serves MHA/GQA attention; this model's full-attention layers are MLA "
            "(Kimi-Linear, Kimi-K3, DeepSeek). Keep the platform's MLA backend and use flydsl for the KDA layers: "
            "--attention-backend aiter --linear-attn-decode-backend flydsl (AMD) or --attention-backend triton "
            "--linear-attn-decode-backend flydsl")
    kv = str(cfg.kv_cache_dtype or "auto")
    if kv not in FP8_KV_DTYPES:
        raise ValueError(
            f"--attention-backend flydsl reads an FP8 KV cache: use --kv-cache-dtype fp8_e4m3 (got {kv!r}; on "
            "MI300X/gfx942 the pool stores e4m3fnuz automatically)")
    page = cfg.page_size
    if page not in PAGE_SIZES:
        raise ValueError(f"--attention-backend flydsl supports --page-size 16, 64 or 128 (got {page}); "
                         "e.g. --page-size 16")
    _check_speculative(cfg)


SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")  # draft chains verified by the target
MAX_DRAFT_TOKENS = 4  # pa_decode's query_length limit
_SPEC_WORKING = ("--speculative-algorithm EAGLE3 --speculative-eagle-topk 1 --speculative-num-steps 2 "
                 "--speculative-num-draft-tokens 3 --speculative-draft-attention-backend triton")


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
    draft = getattr(cfg, "speculative_draft_attention_backend", None)
    if not draft or draft == FLYDSL:
        raise ValueError(f"--speculative-draft-attention-backend {draft}: the draft model's multi-step passes do not "
                         "run on flydsl (SGLang builds them from its own backend map); name the draft's backend, "
                         f"e.g. {_SPEC_WORKING}")


def _resolution_check(server_args, previous) -> None:
    previous(server_args)
    from sglang.srt.arg_groups.model_override_base import resolved_view, use_mla_backend

    cfg = resolved_view(server_args)
    # building the ModelConfig (use_mla_backend) only when flydsl attention needs the answer
    check_sglang_args(cfg, use_mla_backend(server_args) if _uses_flydsl_attention(cfg) else False)


def _create_attn_backend(runner):
    from pa_backend.sglang import FlyDSLAttnBackend  # lazy: keeps the launcher free of kernel imports

    return FlyDSLAttnBackend(runner)


def register_sglang() -> None:
    """Entry point of ``sglang.srt.plugins`` (idempotent)."""
    if not _once("sglang"):
        return
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        LINEAR_ATTN_KERNEL_BACKEND_CHOICES,
        add_attention_backend_choices,
        add_linear_attn_kernel_backend_choices,
    )
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if FLYDSL not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([FLYDSL])
    if FLYDSL not in LINEAR_ATTN_KERNEL_BACKEND_CHOICES:
        add_linear_attn_kernel_backend_choices([FLYDSL])
    register_attention_backend(FLYDSL)(_create_attn_backend)
    register_resolution_hook("handle_other_validations")(_resolution_check)

    import kda_backend.sglang as kda_sglang
    import pa_backend.sglang as pa_sglang

    kda_sglang.register_hooks(HookRegistry, HookType)  # KDA decode kernel (+ Kimi-K3 fused decode)
    pa_sglang.install_kv_pool_hook()  # the FP8 x-packed KV pool for --attention-backend flydsl
    log.info("flydsl-backends: SGLang plugin registered (--attention-backend flydsl, --linear-attn-decode-backend flydsl)")


VLLM_BACKEND_PATH = "pa_backend.vllm.FlyDSLAttentionBackend"


def register_vllm() -> None:
    """Entry point of ``vllm.general_plugins`` (idempotent)."""
    if not _once("vllm"):
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if "FLYDSL" not in AttentionBackendEnum.__members__:
        register_backend("FLYDSL", VLLM_BACKEND_PATH)
    # CUSTOM unpickles by value in spawned workers (a dynamic member does not); the class still reports
    # get_name() == "FLYDSL", which this function has registered in that process too
    register_backend(AttentionBackendEnum.CUSTOM, VLLM_BACKEND_PATH)
    import kda_backend.vllm as kda_vllm

    kda_vllm.register_layer_hooks()  # opt-in per server: --additional-config '{"flydsl_kda": true}'
    log.info("flydsl-backends: vLLM plugin registered (--attention-backend FLYDSL | CUSTOM)")
