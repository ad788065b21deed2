"""Framework plugins: the targets of the package's entry points.

* ``register_sglang()`` — entry point group ``sglang.srt.plugins`` (SGLang 0.5.23 calls it with no
  arguments in every process, before argument parsing). It adds ``flydsl`` to the choices of
  ``--attention-backend`` (and ``--decode-/--prefill-attention-backend``) and of
  ``--linear-attn-decode-backend``, registers the attention backend factory, the KV-pool hook of
  the FP8 x-packed layout, the KDA decode-kernel hook and a resolution-time hook that runs the
  adapters' argument policies (``pa_backend.sglang.check_server_args``,
  ``kda_backend.sglang.check_server_args``): unsupported combinations are rejected with a message
  naming a working one.

* ``register_vllm()`` — entry point group ``vllm.general_plugins`` (vLLM 0.33 calls it once in every
  process: CLI, engine core, workers). It registers ``FLYDSL`` (``--attention-backend FLYDSL``; the
  member unpickles in spawned processes before their plugins load, see ``vllm_flydsl_member``) and
  the ``CUSTOM`` slot for ``pa_backend.vllm.FlyDSLAttentionBackend``, and the KDA layer
  hooks (``PluggableLayer.register_oot``), which run our decode only when the user opts in with
  ``--additional-config '{"flydsl_kda": true}'``.

Each function is idempotent. Importing this module imports nothing but the standard library;
the framework modules are imported inside the functions (the framework is already loaded when it
calls them), and FlyDSL / Triton only when a kernel first runs.
"""

from __future__ import annotations

import logging
import threading

from backend_core import names

__all__ = ["register_sglang", "register_vllm"]

log = logging.getLogger("flydsl_backends.plugins")
_lock = threading.Lock()
_done = set()

FLYDSL = names.FLYDSL


def _once(name: str) -> bool:
    with _lock:
        if name in _done:
            return False
        _done.add(name)
        return True


def _resolution_check(server_args, previous) -> None:
    """SGLang's argument-resolution hook: the adapters' own policies (``kda_backend.sglang``,
    ``pa_backend.sglang``) on the resolved arguments."""
    previous(server_args)
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view, use_mla_backend

    import kda_backend.sglang as kda_sglang
    import pa_backend.sglang as pa_sglang

    cfg = resolved_view(server_args)
    # the model's config (built and memoized by SGLang) only when flydsl KDA decode needs its answers
    kda_sglang.check_server_args(cfg, model_config_of(server_args) if kda_sglang.uses_flydsl_kda(cfg) else None)
    # building the ModelConfig (use_mla_backend) only when flydsl attention needs the answer
    pa_sglang.check_server_args(cfg, use_mla_backend(server_args) if pa_sglang.uses_flydsl_attention(cfg) else False)


def _prefill_graph_step(server_args, previous) -> None:
    previous(server_args)
    import pa_backend.sglang as pa_sglang

    pa_sglang.resolve_prefill_cuda_graph(server_args)


def _create_attn_backend(runner):
    from pa_backend.sglang_backend import FlyDSLAttnBackend  # SGLang is loaded by now

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
    # where SGLang decides a backend's prefill-graph default (it turns it off for trtllm_mla there too)
    register_resolution_hook("disable_prefill_cuda_graph_for_deepseek_trtllm_mla")(_prefill_graph_step)

    import kda_backend.sglang as kda_sglang
    import pa_backend.sglang as pa_sglang

    kda_sglang.register_hooks(HookRegistry, HookType)  # KDA decode kernel (+ Kimi-K3 fused decode)
    pa_sglang.install_kv_pool_hook()  # the FP8 x-packed KV pool for --attention-backend flydsl
    log.info("flydsl-backends: SGLang plugin registered (--attention-backend flydsl, --linear-attn-decode-backend "
             "flydsl)")


VLLM_BACKEND_PATH = "pa_backend.vllm.FlyDSLAttentionBackend"
VLLM_BACKEND_NAME = "FLYDSL"  # the member vLLM's AttentionBackendEnum gets (pa_backend.vllm.BACKEND_NAME)


def vllm_flydsl_member():
    """vLLM's ``AttentionBackendEnum.FLYDSL``, added to the enum (``register_backend("FLYDSL", ...)``) if
    this process does not have it yet. Idempotent.

    A member added at run time pickles as ``AttentionBackendEnum(<class path>)``, and vLLM 0.33 unpickles
    the engine config in every spawned process (``vllm serve``'s CLI spawns the engine core unless
    ``VLLM_WORKER_MULTIPROC_METHOD`` says otherwise;
    multiproc workers under Ray, ``--numa-bind``, ...) before it loads the general plugins, so that
    lookup would fail there ("... is not a valid AttentionBackendEnum"). The member therefore pickles as
    a call of this function, which adds it in the unpickling process first."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    with _lock:  # two threads unpickling at once would otherwise both add it (the second add raises)
        member = AttentionBackendEnum.__members__.get(VLLM_BACKEND_NAME)
        if member is None:
            register_backend(VLLM_BACKEND_NAME, VLLM_BACKEND_PATH)
            member = AttentionBackendEnum[VLLM_BACKEND_NAME]
        # an instance attribute: pickle (and cloudpickle) look __reduce_ex__ up on the object
        member.__reduce_ex__ = _reduce_vllm_flydsl_member
    return member


def _reduce_vllm_flydsl_member(protocol):
    return vllm_flydsl_member, ()


def register_vllm() -> None:
    """Entry point of ``vllm.general_plugins`` (idempotent)."""
    if not _once("vllm"):
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    vllm_flydsl_member()
    # the same class in vLLM's placeholder slot; the class reports get_name() == "FLYDSL" either way
    register_backend(AttentionBackendEnum.CUSTOM, VLLM_BACKEND_PATH)
    import kda_backend.vllm as kda_vllm

    # opt-in per server (--additional-config '{"flydsl_kda": true}'); registered when vLLM imports the
    # layers, so loading the plugin imports no layer module (FLA's would initialise CUDA in the parent)
    kda_vllm.install_layer_hooks()
    log.info("flydsl-backends: vLLM plugin registered (--attention-backend FLYDSL | CUSTOM)")
