"""SGLang 0.5.23 adapter of the KDA decode op: a ``LinearAttnKernelBase`` decode kernel behind
``--linear-attn-decode-backend flydsl``.

SGLang has no registry for KDA kernels: ``flydsl`` maps to ``LinearAttnKernelBackend.CUSTOM`` and its
``KDAKernelDispatcher`` raises for it. The plugin (``flydsl_backends.plugins.register_sglang``)
therefore installs ``dispatcher_init_around`` as an AROUND hook on ``KDAKernelDispatcher.__init__``:
when the user asked for ``flydsl`` it builds the dispatcher as for ``triton`` (prefill, verify and
the fallback kernel stay SGLang's) and swaps in :func:`make_decode_kernel`'s kernel for decode
(``kda_backend.sglang_kernel.FlyDSLKDAKernel``; this module imports no SGLang module at import time,
so the plugin and the CPU tests load it anywhere).

What SGLang hands the decode kernel (after its own causal conv + SiLU, see the notes): packed
post-conv ``mixed_qkv`` [B, 3*H*K], raw ``a`` [B, H*K], raw ``b`` [1, B, H], ``A_log`` [1, 1, H, 1],
``dt_bias`` [H*K], the layer's ``ssm_states`` [slots, H, V, K] (strided pages), int32
``cache_indices`` where -1 marks CUDA-graph padding rows, and ``lower_bound`` for Kimi-K3's safe
gate. It expects [1, B, H, V] back; the model applies its gated ``o_norm`` itself. The adapter maps
that onto ``kda_decode(conv_weight=None, output_gate=None, norm_weight=None)``: SGLang's slot 0
stays a live (scratch) slot, -1 rows are padding (zero output, caches untouched), and strides
come from the pool's tensors. The implementation is the registry's choice (``backend="auto"``:
FlyDSL on gfx950/gfx942, Triton on NVIDIA, the reference on CPU; ``FLYDSL_BACKENDS_KDA`` forces
one).

Kimi-K3 fused decode (``register_hooks`` also installs these). K3's decode can bypass the
dispatcher: SGLang's ``KDAAttnBackend.forward_decode`` first tries a model-specific fused step
(f_b GEMM + conv + KDA + gated o_norm in one kernel). With ``flydsl`` selected our op takes that
step, SGLang's kernel serves only what our op does not cover:

* **ROCm gfx95x** (``SGLANG_ROCM_K3_KDA_FUSED_BACKEND`` unset or ``gfx950``, SGLang's default):
  AROUND hooks on ``sglang.kernels.ops.attention.kda_fused_decode_gfx950.{available, warmup,
  covered, run}``. ``available`` says yes on gfx95x, so ``KimiK3DeltaAttention._prepare_fused_decode``
  stashes the static weights and the model defers ``f_b`` (hands ``f_a``); ``covered`` is our
  op's verdict (memoized per shapes/dtypes/strides); ``run`` calls
  :func:`kda_backend.kda_decode_with_f_b` (``backend="auto"``: FlyDSL, else Triton;
  ``FLYDSL_BACKENDS_KDA`` forces one). A call our op does not cover goes to SGLang's original
  ``covered``/``run`` (logged once); if SGLang's own ``warmup`` failed, such calls are reported
  not covered and take the unfused chain (SGLang's conv, our dispatcher kernel, the model's
  o_norm). SGLang's branch only runs where ``is_gfx95_supported()``, so on gfx942 ``available``
  is left to SGLang (False): K3 decode there is the unfused chain with our dispatcher kernel.
* ``SGLANG_ROCM_K3_KDA_FUSED_BACKEND=aiter`` (SGLang's AITER/FlyDSL kernel) is an explicit opt-in
  and is left alone (that module is not hooked); any other value (e.g. ``off``) disables SGLang's
  fused path, and K3 decode is the unfused chain with our dispatcher kernel.
* **NVIDIA**: an AROUND hook on ``sglang.kernels.ops.attention.kda_fused_decode.kda_fused_decode``
  (reached after SGLang's own ``covered``, which stays as is): with ``flydsl`` selected and shapes
  our op covers it runs :func:`kda_backend.kda_decode` with conv + gated norm fused (the gate
  ``a`` is already projected there; conv weights are re-assembled once from SGLang's transposed
  per-segment copies and cached by address). Otherwise SGLang's CUDA kernel runs (logged once).
* Without ``flydsl`` selected every hook calls the original unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from backend_core import names
from backend_core.validation import signature_of

from . import contract as _contract
from .api import kda_decode, kda_decode_with_f_b

__all__ = ["make_decode_kernel", "dispatcher_init_around", "user_selected_flydsl", "register_hooks", "FLAG_VALUE",
           "k3_available_around", "k3_warmup_around", "k3_covered_around", "k3_run_around",
           "k3_cuda_fused_decode_around", "check_server_args", "uses_flydsl_kda"]

log = logging.getLogger("flydsl_backends.sglang")
FLAG_VALUE = names.FLYDSL


def uses_flydsl_kda(cfg) -> bool:
    """Whether SGLang's resolved server args ``cfg`` send linear-attention decode to flydsl."""
    return FLAG_VALUE in (getattr(cfg, "linear_attn_decode_backend", None), getattr(cfg, "linear_attn_backend", None))


def check_server_args(cfg, model_config=None) -> None:
    """The server-argument policy of the flydsl KDA kernel backend (``cfg``: SGLang's resolved server
    args; ``model_config``: SGLang's ModelConfig, needed only when ``uses_flydsl_kda(cfg)``): a
    decode-only kernel, so prefill and speculative verify stay on SGLang's kernels; the model must have
    KDA layers (the flag also names GDN's decode backend, which has no flydsl kernel), bfloat16
    activations and a float32 or bfloat16 recurrent state. Raises ValueError naming the flag and the
    one that works."""
    for flag, value in (("--linear-attn-backend", getattr(cfg, "linear_attn_backend", None)),
                        ("--linear-attn-prefill-backend", getattr(cfg, "linear_attn_prefill_backend", None)),
                        ("--linear-attn-verify-backend", getattr(cfg, "linear_attn_verify_backend", None))):
        if value == FLAG_VALUE:
            raise ValueError(
                f"{flag} flydsl: the flydsl KDA backend serves decode only (prefill and speculative verify stay on "
                "SGLang's kernels); use --linear-attn-decode-backend flydsl and leave the others unset")
    if model_config is None or not uses_flydsl_kda(cfg):
        return
    from sglang.srt.configs.model_config import uses_kda_attention

    hf = model_config.hf_config
    if not uses_kda_attention(hf):
        arch = (getattr(hf, "architectures", None) or ["this model"])[0]
        raise ValueError(f"--linear-attn-decode-backend flydsl serves KDA layers (Kimi-Linear, Kimi-K3); {arch} has "
                         "none (GDN and other linear attention have no flydsl kernel): leave "
                         "--linear-attn-decode-backend unset for it")
    dtype = getattr(model_config, "dtype", None)
    if dtype is not None and dtype not in _contract.ACT_DTYPES:
        raise ValueError(f"--linear-attn-decode-backend flydsl: the KDA decode takes bfloat16 activations, this "
                         f"server runs {dtype}: use --dtype bfloat16")
    ssm = getattr(cfg, "mamba_ssm_dtype", None)
    if ssm is None:  # SGLang's own order: its environment variable, then the model's config, then float32
        from sglang.srt.configs.mamba_utils import mamba2_state_dtype

        ssm_dtype = mamba2_state_dtype(hf).temporal
    else:
        ssm_dtype = getattr(torch, str(ssm), None)
    if ssm_dtype not in _contract.STATE_DTYPES:
        raise ValueError(f"--linear-attn-decode-backend flydsl: the KDA decode keeps the recurrent state in float32 "
                         f"or bfloat16, this server's is {ssm if ssm is not None else ssm_dtype}: use "
                         "--mamba-ssm-dtype float32 (or bfloat16)")


def _gate_params_fp32(A_log: torch.Tensor, dt_bias: torch.Tensor):
    """``A_log`` and ``dt_bias`` as the op takes them (fp32, flat): models that keep them in bf16
    (the layer's dtype) are converted — the same on every SGLang path into the op (logged once)."""
    if A_log.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        _log_once("gate_fp32", logging.INFO, "KDA decode: A_log %s / dt_bias %s converted to float32 per call (the "
                  "op reads fp32 gate parameters)", A_log.dtype, dt_bias.dtype)
        A_log, dt_bias = A_log.float(), dt_bias.float()
    return A_log.reshape(-1), dt_bias.reshape(-1)


def _packed_decode(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, scale: float, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                   num_v_heads: int, head_v_dim: int, lower_bound: Optional[float] = None,
                   backend: str = "auto") -> torch.Tensor:
    """SGLang's packed decode arguments (its ``cache_indices`` are ``state_indices``) -> ``kda_decode``;
    returns [1, B, H, V]."""
    B = int(mixed_qkv.shape[0])
    H, V = int(num_v_heads), int(head_v_dim)
    if mixed_qkv.dim() != 2 or int(mixed_qkv.shape[1]) != 3 * H * V:
        raise ValueError(f"mixed_qkv: expected [B, 3*{H}*{V}] (q, k, v heads of equal size), got "
                         f"{list(mixed_qkv.shape)}")
    out = torch.empty(1, B, H, V, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    A_log, dt_bias = _gate_params_fp32(A_log, dt_bias)
    kda_decode(mixed_qkv, None, None, a, b, A_log, dt_bias, ssm_states, state_indices, None, None,
               lower_bound=lower_bound, scale=scale, out=out[0], backend=backend)
    return out


def make_decode_kernel(backend: str = "auto"):
    """A ``LinearAttnKernelBase`` instance for SGLang's ``KDAKernelDispatcher.decode_kernel``."""
    from .sglang_kernel import FlyDSLKDAKernel

    return FlyDSLKDAKernel(backend)


def user_selected_flydsl() -> bool:
    """Whether this server was launched with ``--linear-attn-decode-backend flydsl`` (or
    ``--linear-attn-backend flydsl``): SGLang maps every unknown name to CUSTOM, so the published
    server arguments are read instead."""
    try:
        from sglang.srt.runtime_context import get_exec

        mamba = get_exec().mamba
    except Exception:  # no published server arguments (unit tests building the dispatcher directly)
        return False
    return (getattr(mamba, "linear_attn_decode_backend", None) or getattr(mamba, "linear_attn_backend",
                                                                          None)) == FLAG_VALUE


def dispatcher_init_around(original, self, decode_backend, prefill_backend, verify_backend, *args, **kwargs):
    """AROUND hook on ``KDAKernelDispatcher.__init__``: ``flydsl`` decode with SGLang's own prefill,
    verify and fallback kernels."""
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    if decode_backend != LinearAttnKernelBackend.CUSTOM or not user_selected_flydsl():
        return original(self, decode_backend, prefill_backend, verify_backend, *args, **kwargs)
    if prefill_backend == LinearAttnKernelBackend.CUSTOM:
        raise ValueError("--linear-attn-backend flydsl would also make KDA prefill 'flydsl', which serves decode only: "
                         "use --linear-attn-decode-backend flydsl (prefill stays triton)")
    triton = LinearAttnKernelBackend.TRITON
    original(self, triton, prefill_backend, verify_backend, *args, **kwargs)
    self.decode_kernel = make_decode_kernel()
    self.supports_packed_decode = True
    self.supports_packed_decode_safe_gate = True
    log.info("KDA decode: flydsl-backends kernel (implementation chosen per call: FLYDSL_BACKENDS_KDA or auto)")
    return None


# --- Kimi-K3 fused decode -----------------------------------------------------------------------------

_tls = threading.local()  # .fallback: inside SGLang's original (its own available() must answer for itself)
_k3_logged = set()
_k3_cover_cache: "OrderedDict[tuple, tuple]" = OrderedDict()  # bounded LRU (call signatures)
_K3_COVER_CACHE_SIZE = 256
_k3_state = {"fallback_broken": False}
_cuda_conv_weight_cache = WeakIdKeyDictionary()  # keyed by tensor identity, entries die with the tensor


def _log_once(key: str, level: int, msg: str, *args) -> None:
    if key not in _k3_logged:
        _k3_logged.add(key)
        log.log(level, msg, *args)


def _k3_platform_ok(device=None) -> bool:
    """Whether SGLang's HIP fused branch can reach our op here: it runs only where SGLang's
    ``is_gfx95_supported()`` holds (``KDAAttnBackend.forward_decode`` checks it per call)."""
    from sglang.srt.utils.common import is_gfx95_supported

    return bool(torch.cuda.is_available() and is_gfx95_supported())


def _k3_serves(device=None) -> bool:
    return not getattr(_tls, "fallback", False) and user_selected_flydsl() and _k3_platform_ok(device)


def _ours_covers(key, build):
    """Memoized: ``(name, "")`` of the implementation ``kda_backend`` (``backend="auto"``) picks for
    this call (a non-empty name: truthy), else ``(None, why not)``. ``build()`` returns the
    ``prepare`` keyword arguments (placeholders where the caller lacks the static weights)."""
    hit = _k3_cover_cache.get(key)
    if hit is not None:
        _k3_cover_cache.move_to_end(key)
    else:
        from .api import REGISTRY
        from .contract import prepare

        try:
            p = prepare(**build())
            hit = (REGISTRY.select(p, "auto", device_type=p.device.type).name, "")
        except (ValueError, TypeError) as exc:
            hit = (None, str(exc))
        _k3_cover_cache[key] = hit
        if len(_k3_cover_cache) > _K3_COVER_CACHE_SIZE:
            _k3_cover_cache.popitem(last=False)
    return hit[0], hit[1]


def _k3_covers(f_a, f_b_weight, mixed_qkv, raw_beta, conv_state, state, state_indices, output_gate, norm_weight):
    def build():
        dev = mixed_qkv.device
        H, K = int(state.shape[1]), int(state.shape[3])
        W = int(conv_state.shape[-1]) + 1 if conv_state.dim() == 3 else 2
        return dict(x=mixed_qkv, conv_weight=torch.zeros(int(mixed_qkv.shape[-1]), W, dtype=torch.float32, device=dev),
                    conv_state=conv_state, a=None, b=raw_beta, A_log=torch.zeros(H, dtype=torch.float32, device=dev),
                    dt_bias=torch.zeros(H * K, dtype=torch.float32, device=dev), state=state,
                    state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight, lower_bound=-5.0,
                    f_a=f_a, f_b_weight=f_b_weight, with_f_b=True)

    return _ours_covers(("k3_hip",) + signature_of(f_a, f_b_weight, mixed_qkv, raw_beta, conv_state, state,
                                                   state_indices, output_gate, norm_weight), build)


def _in_fallback(fn, *args, **kwargs):
    prev = getattr(_tls, "fallback", False)
    _tls.fallback = True
    try:
        return fn(*args, **kwargs)
    finally:
        _tls.fallback = prev


def k3_available_around(original, device=None):
    """AROUND ``kda_fused_decode_gfx950.available``: yes on gfx95x when flydsl is selected."""
    if _k3_serves(device):
        return True
    return original(device)


def k3_warmup_around(original, **kwargs):
    """AROUND ``kda_fused_decode_gfx950.warmup``: SGLang's warmup still runs (its kernel serves the
    shapes ours does not); with flydsl selected a failure there is logged, not raised, and turns
    that fallback off (uncovered calls then take the unfused chain)."""
    if not _k3_serves(kwargs.get("f_b_weight").device if kwargs.get("f_b_weight") is not None else None):
        return original(**kwargs)
    try:
        _in_fallback(original, **kwargs)
    except Exception as exc:  # e.g. the HIP extension does not build: ours serves, the rest is unfused
        _k3_state["fallback_broken"] = True
        _log_once("k3_warmup", logging.WARNING, "Kimi-K3 fused decode: SGLang's gfx950 kernel is unavailable (%s: %s); "
                  "shapes flydsl-backends does not cover take the unfused decode chain", type(exc).__name__, exc)
    log.info("Kimi-K3 fused KDA decode: flydsl-backends kda_decode_with_f_b (SGLang's kernel for uncovered shapes)")
    return None


def k3_covered_around(original, f_a, f_b_weight, mixed_qkv, raw_beta, conv_state, state, state_indices, output_gate,
                      norm_weight):
    """AROUND ``kda_fused_decode_gfx950.covered``: our op's verdict first, SGLang's for the rest."""
    args = (f_a, f_b_weight, mixed_qkv, raw_beta, conv_state, state, state_indices, output_gate, norm_weight)
    if _k3_serves(f_a.device):
        ok, why = _k3_covers(*args)
        if ok:
            return True
        _log_once("k3_fallback", logging.INFO, "Kimi-K3 fused decode: flydsl-backends does not cover this call (%s); "
                  "falling back to SGLang's kernel", why)
        if _k3_state["fallback_broken"]:
            return False
    return _in_fallback(original, *args)


def k3_run_around(original, *, f_a, f_b_weight, mixed_qkv, conv_weight, conv_state, raw_beta, A_log, dt_bias,
                  lower_bound, state, state_indices, output_gate, norm_weight, norm_eps, out=None):
    """AROUND ``kda_fused_decode_gfx950.run``: ``kda_decode_with_f_b`` for covered calls; returns
    [1, B, H, V] after the gated norm, like SGLang's."""
    kw = dict(f_a=f_a, f_b_weight=f_b_weight, mixed_qkv=mixed_qkv, conv_weight=conv_weight, conv_state=conv_state,
              raw_beta=raw_beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, state=state,
              state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight, norm_eps=norm_eps, out=out)
    if not (_k3_serves(f_a.device) and _k3_covers(f_a, f_b_weight, mixed_qkv, raw_beta, conv_state, state,
                                                  state_indices, output_gate, norm_weight)[0]):
        return _in_fallback(original, **kw)
    B, H, V = int(mixed_qkv.shape[0]), int(state.shape[1]), int(state.shape[2])
    if out is None:
        out = mixed_qkv.new_empty((1, B, H, V))
    A_log, dt_bias = _gate_params_fp32(A_log, dt_bias)
    kda_decode_with_f_b(f_a, f_b_weight, mixed_qkv, conv_weight, conv_state, raw_beta, A_log, dt_bias,
                        state, state_indices, output_gate, norm_weight, lower_bound=float(lower_bound),
                        norm_eps=float(norm_eps), out=out.view(B, H, V))
    return out


def _cuda_conv_weight(w_q_t, w_k_t, w_v_t):
    """[C, W] fp32 from SGLang's per-segment transposed copies ([W, seg] each), built once per
    weight set. The entry lives as long as ``w_q_t`` (a weak key: a freed layer frees it, and a new
    tensor at a reused address is a new key) and is rebuilt when any of the three tensors is another
    object or was written in place since (weight reload)."""
    stamp = tuple((id(t), t._version) for t in (w_q_t, w_k_t, w_v_t))
    hit = _cuda_conv_weight_cache.get(w_q_t)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    w = torch.cat([w_q_t, w_k_t, w_v_t], dim=1).t().contiguous().float()
    _cuda_conv_weight_cache[w_q_t] = (stamp, w)
    return w


def k3_cuda_fused_decode_around(original, mixed_qkv, a, b, conv_states, w_q_t, w_k_t, w_v_t, conv_bias, A_log,
                                dt_bias, onorm_g, onorm_weight, ssm_states, cache_indices, scale, onorm_eps,
                                lower_bound=None):
    """AROUND ``kda_fused_decode.kda_fused_decode`` (NVIDIA K3 fused step, after SGLang's
    ``covered``): ``kda_decode`` with conv + gated norm when flydsl is selected and covers it."""
    args = (mixed_qkv, a, b, conv_states, w_q_t, w_k_t, w_v_t, conv_bias, A_log, dt_bias, onorm_g, onorm_weight,
            ssm_states, cache_indices)
    if user_selected_flydsl():
        B, H, V = int(mixed_qkv.shape[0]), int(ssm_states.shape[-3]), int(ssm_states.shape[-2])
        conv_weight = _cuda_conv_weight(w_q_t, w_k_t, w_v_t)
        gate = onorm_g.view(B, H, V)
        A32, dt32 = _gate_params_fp32(A_log, dt_bias)
        kw = dict(x=mixed_qkv, conv_weight=conv_weight, conv_state=conv_states.transpose(-1, -2), a=a, b=b,
                  A_log=A32, dt_bias=dt32, state=ssm_states, state_indices=cache_indices,
                  output_gate=gate, norm_weight=onorm_weight, conv_bias=conv_bias, lower_bound=lower_bound,
                  norm_eps=float(onorm_eps), scale=float(scale))
        name, why = _ours_covers(("k3_cuda", lower_bound is None) + signature_of(*args), lambda: kw)
        if name is not None:
            _log_once("k3_cuda", logging.INFO, "Kimi-K3 fused KDA decode (CUDA path): flydsl-backends kda_decode "
                      "(SGLang's 'K3 fused KDA decode engaged' notice refers to the step, not its kernel)")
            out = kda_decode(**kw, backend=name)  # the keys are kda_decode's parameter names
            return out.view(1, B, H, V)
        _log_once("k3_cuda_fallback", logging.INFO, "Kimi-K3 fused decode (CUDA path): flydsl-backends does not cover "
                  "this call (%s); SGLang's kernel runs", why)
    return original(*args, scale=scale, onorm_eps=onorm_eps, lower_bound=lower_bound)


KDA_DISPATCHER_INIT = "sglang.srt.layers.attention.linear.kda_backend.KDAKernelDispatcher.__init__"
K3_GFX950_OPS = "sglang.kernels.ops.attention.kda_fused_decode_gfx950"
K3_CUDA_OPS = "sglang.kernels.ops.attention.kda_fused_decode"


def register_hooks(hook_registry, hook_type) -> None:
    """Register this adapter's SGLang hooks (called once by ``flydsl_backends.plugins.register_sglang``;
    SGLang applies them after the plugin returns)."""
    hook_registry.register(KDA_DISPATCHER_INIT, dispatcher_init_around, hook_type.AROUND)
    for name, hook in (("available", k3_available_around), ("warmup", k3_warmup_around),
                       ("covered", k3_covered_around), ("run", k3_run_around)):
        hook_registry.register(f"{K3_GFX950_OPS}.{name}", hook, hook_type.AROUND)
    hook_registry.register(f"{K3_CUDA_OPS}.kda_fused_decode", k3_cuda_fused_decode_around, hook_type.AROUND)
