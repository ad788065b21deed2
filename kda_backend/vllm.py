"""vLLM 0.33.0 adapter of the KDA decode op: a layer hook for Kimi-Linear (and Kimi-K3 on ROCm).

vLLM has no registry for KDA decode kernels: the Mamba "attention backend" (``GDN_ATTN``) only builds
``GDNAttentionMetadata``, and the kernels run inside the layer's ``_forward``. The plugin therefore
calls :func:`install_layer_hooks`, which registers (when vLLM imports each layer's module), through
``vllm.model_executor.custom_op.PluggableLayer.register_oot``, a subclass of

* ``vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn.KimiGatedDeltaNetAttention``
  (Kimi-Linear, every platform) under the name ``"KimiGatedDeltaNetAttention"``, and
* ``vllm.models.kimi_k3.amd.kda.KimiK3DeltaAttention`` (Kimi-K3 on ROCm) under
  ``"KimiK3DeltaAttention"``, only on ROCm and only when that module imports; otherwise it is
  skipped with a debug log. (NVIDIA's K3 layer, ``vllm.models.kimi_k3.nvidia.kda``,
  has the same class name: registering the AMD subclass under that name on NVIDIA would replace
  NVIDIA's layer with the AMD one, hence the ROCm check.)

``PluggableLayer.__new__`` then builds our subclass wherever vLLM constructs the original. The
subclasses (``kda_backend.vllm_layers``, ``kda_backend.vllm_layers_k3``: they import vLLM; this module
imports on any machine) only override ``_forward(mixed_qkv, g1, g2, beta, core_attn_out)`` (same
signature and ``@eager_break_during_capture`` decoration as vLLM's) and run :func:`forward_on_flydsl`
there, so weights, loading, metadata (vLLM's own ``GDNAttentionMetadataBuilder`` / K3's
``KimiK3ROCmKDAMetadataBuilder``) and the cache spec are vLLM's.

Opt-in: ``--additional-config '{"flydsl_kda": true}'``. The switch is read from
``vllm.config.get_current_vllm_config()`` when the layer is constructed
(:func:`flydsl_kda_enabled`); with it off, or for a batch we do not take, ``_forward`` is
``super()._forward`` unchanged. Which path runs is logged once ("KDA decode: flydsl-backends
kda_decode" / "KDA decode: vLLM's path (reason)").

What runs on our op: **pure non-spec decode batches** (``spec_sequence_masks is None``,
``num_prefills == 0``, ``num_decodes > 0``). Prefill, mixed prefill+decode and speculative decode stay
on vLLM's kernels. The mapping of vLLM's decode onto
:func:`kda_backend.kda_decode` (one launch, implementation chosen by the registry: FlyDSL on
gfx950/gfx942, Triton on NVIDIA, the reference on CPU; ``FLYDSL_BACKENDS_KDA`` forces one):

* ``x`` = ``mixed_qkv[:T]`` (pre-conv q|k|v, row-strided view of the input projection),
  T = ``num_actual_tokens``;
* conv fused: ``conv_weight`` = ``conv1d.weight`` [3P, 1, W] viewed [3P, W] (fp32),
  ``conv_bias`` = ``conv1d.bias`` (None for Kimi), ``conv_state`` = the layer's
  ``(slots, dim, state_len)`` view (the transpose of vLLM's default "SD" width-major page-strided
  buffer, or the "DS" buffer as is), updated in place;
* ``a`` = ``g1[0, :T]`` (raw forget gate, f_b_proj already applied by ``forward``), ``b`` =
  ``beta[:, :T]`` (raw beta), ``A_log``, ``dt_bias`` (per channel), ``lower_bound`` =
  ``gate_lower_bound`` (None: the softplus gate);
* ``state`` = the recurrent state [slots, H, V, K] (page-strided, fp32 or bf16), updated in place;
* ``state_indices`` = ``non_spec_state_indices_tensor[:T]`` with vLLM's **null block 0** (and any
  index <= 0) **mapped to -1** (our padding row: zero output, neither cache touched), written into a
  persistent int32 buffer with ``torch.le(out=)`` / ``copy_`` / ``masked_fill_`` (no host sync, no
  per-step allocation; rows past the index tensor's length are padding too). Our op treats slot 0
  as live, vLLM's kernels skip ``idx <= 0``: the mapping makes the two agree;
* **gated norm fused**: vLLM's ``_forward`` ends with
  ``core_attn_out.copy_(self.o_norm(core_attn_out, g2))``, i.e. it must leave
  ``rmsnorm(o) * o_norm.weight * sigmoid(g2)`` in ``core_attn_out`` (the caller then applies only
  ``o_proj``), so ``output_gate`` = ``g2[:T]``, ``norm_weight`` = ``o_norm.weight``, ``norm_eps`` =
  ``o_norm.eps``, and ``out`` = ``core_attn_out[0, :T]`` is written in place (rows past T, if any,
  are zeroed). The one numerical difference from vLLM: vLLM rounds ``o`` to the activation dtype
  before its norm, our op normalizes the FP32 ``o``.

Decode batches our op does not cover (checked once per shapes/dtypes/strides with the op's own
validation, e.g. a head dim the Triton kernel lacks, or a conv state of width W-1+num_spec when
speculative decoding is configured) take vLLM's path, logged once with the reason. Padding rows of a
CUDA-graph batch (null block 0) never change a cache.

Kimi-K3 (ROCm): ``KimiK3DeltaAttention.forward`` applies ``f_b_proj`` before ``_forward`` (the
``_forward`` signature is the same as Kimi-Linear's and ``g1`` is the projected gate), so the hook
uses :func:`kda_backend.kda_decode` with the same mapping rather than ``kda_decode_with_f_b`` (which
needs ``f_a``; fusing f_b would mean overriding ``forward`` too). Our path is tried before vLLM's
AITER/HIP fused decode; everything else (prefill, spec decode, uncovered shapes) is K3's own
``_forward``. Tested on CPU only: the real ``KimiK3DeltaAttention`` constructed (its module imports
without aiter once ``vllm.platforms.rocm`` has been imported with a gfx942 device-properties
stand-in), its ``KimiK3ROCmKDAMetadataBuilder`` for the decode batch, ``is_rocm`` faked for the
registration; no ROCm machine has run it.

The plugin calls :func:`install_layer_hooks` in every process: each registration is made when vLLM
itself first imports the layer's module (before it builds the model), never by importing it at plugin
load. :func:`register_layer_hooks` makes them at once (importing the modules).
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Dict, Optional, Tuple

import torch

from backend_core.buffers import DeviceBuffers
from backend_core.import_hooks import after_import
from backend_core.validation import signature_of

__all__ = ["register_layer_hooks", "install_layer_hooks", "flydsl_kda_enabled", "CONFIG_KEY", "KIMI_LINEAR_LAYER",
           "KIMI_K3_LAYER", "kimi_linear_layer_class", "kimi_k3_layer_class", "configure_layer", "forward_on_flydsl",
           "decode_on_flydsl", "map_state_indices"]

log = logging.getLogger("flydsl_backends.vllm.kda")

CONFIG_KEY = "flydsl_kda"
KIMI_LINEAR_LAYER = "KimiGatedDeltaNetAttention"
KIMI_K3_LAYER = "KimiK3DeltaAttention"
KIMI_LINEAR_MODULE = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
KIMI_K3_MODULE = "vllm.models.kimi_k3.amd.kda"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

_lock = threading.RLock()  # re-entered by the after-import callbacks of a module imported under it
_registered: Dict[str, type] = {}
_logged: set = set()
_cover_cache: Dict[tuple, Tuple[bool, str]] = {}


def _log_once(key, level: int, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def flydsl_kda_enabled(vllm_config) -> bool:
    """Whether ``vllm_config.additional_config["flydsl_kda"]`` asks for our KDA decode.

    Booleans and integers are taken as truthy/falsy; strings ``1/true/yes/on`` and
    ``0/false/no/off/""`` (any case) too. Anything else raises ValueError naming the key.
    A config without ``additional_config`` (or a non-dict one) means off.
    """
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return False
    value = extra.get(CONFIG_KEY, False)
    if value is None or isinstance(value, (bool, int)):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    raise ValueError(f"additional_config[{CONFIG_KEY!r}]: expected true or false, got {value!r}")


# --- state-index mapping ---------------------------------------------------------------------------

# persistent int32 index / bool masks per device (grow-only; graphs captured with a buffer keep it)
_index_buffers = DeviceBuffers("vLLM KDA state indices", [(torch.int32, False), (torch.bool, False),
                                                          (torch.bool, False)])
INT32_MAX = (1 << 31) - 1


def map_state_indices(indices: torch.Tensor, num_rows: int, hint: int = 0) -> torch.Tensor:
    """vLLM's ``non_spec_state_indices_tensor`` -> our op's ``state_indices`` [num_rows] int32:
    indices <= 0 (vLLM's null block 0) become -1 (padding), and so do int64 indices past int32 (no
    cache has that many slots; copied into int32 they would wrap onto a live slot); rows past
    ``len(indices)`` are -1.
    Written into a persistent buffer (a view of it is returned): no host sync, no allocation once
    the buffer is large enough."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"non_spec_state_indices_tensor: expected a tensor, got {type(indices).__name__}")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"non_spec_state_indices_tensor: expected a 1-D int32/int64 tensor, got "
                         f"{list(indices.shape)} {indices.dtype}")
    n = min(int(indices.shape[0]), int(num_rows))
    buf, mask, big = _index_buffers.get(indices.device, (int(num_rows),) * 3, minimum=(hint,) * 3)
    out = buf[:num_rows]
    src = indices[:n]
    torch.le(src, 0, out=mask[:n])
    if src.dtype == torch.int64:
        torch.gt(src, INT32_MAX, out=big[:n])
        mask[:n].logical_or_(big[:n])
    out[:n].copy_(src)
    out[:n].masked_fill_(mask[:n], -1)
    if n < num_rows:
        out[n:].fill_(-1)
    return out


# --- the decode step -------------------------------------------------------------------------------

def _covers(kw: dict, backend: str) -> Tuple[Optional[str], str]:
    """Memoized per call signature: ``(name, "")`` of the implementation our op (``backend``) picks
    for this call — later calls name it, so ``auto`` walks the preference list once per signature —
    or ``(None, why not)``. Uses the op's own validation."""
    key = (backend, kw["lower_bound"] is None, float(kw["norm_eps"])) + signature_of(
        *(kw[k] for k in ("x", "conv_weight", "conv_bias", "conv_state", "a", "b", "A_log", "dt_bias", "state",
                          "state_indices", "output_gate", "norm_weight", "out")))
    hit = _cover_cache.get(key)
    if hit is None:
        from .api import REGISTRY
        from .contract import prepare

        try:
            p = prepare(**kw)
            hit = (REGISTRY.select(p, backend, device_type=p.device.type).name, "")
        except (ValueError, TypeError) as exc:
            hit = (None, str(exc))
        if len(_cover_cache) > 4096:
            _cover_cache.clear()
        _cover_cache[key] = hit
    return hit


def _static_reason(layer) -> Optional[str]:
    """Why this layer can never take our path (None: it can), from its modules."""
    norm = getattr(layer, "o_norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        return "o_norm has no weight (our op fuses rmsnorm * weight * sigmoid(gate))"
    if getattr(norm, "activation", None) != "sigmoid":
        return f"o_norm activation is {getattr(norm, 'activation', None)!r}, our op's gated norm is sigmoid"
    w = layer.conv1d.weight
    if w.dim() != 3 or int(w.shape[1]) != 1:
        return f"conv1d.weight has shape {list(w.shape)}, expected [3P, 1, W]"
    return None


def decode_on_flydsl(layer, mixed_qkv, g1, g2, beta, core_attn_out, backend: str = "auto") -> Optional[str]:
    """Run ``layer``'s KDA decode on our op if this batch is a pure non-spec decode batch we cover.

    Returns None when it ran (``core_attn_out`` written in place, caches updated), else the
    reason it did not (nothing written). ``layer`` is a vLLM KDA layer with ``kv_cache`` bound.
    """
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return "no attention metadata (profile or dummy run)"
    m = attn_metadata.get(layer.prefix)
    if m is None:
        return "no metadata for this layer (profile or dummy run)"
    if getattr(m, "spec_sequence_masks", None) is not None:
        return "speculative decode batch"
    if m.num_prefills > 0:
        return "prefill or mixed prefill/decode batch"
    if m.num_decodes <= 0:
        return "no decode rows"
    if m.non_spec_state_indices_tensor is None:
        return "no non_spec_state_indices_tensor"
    reason = layer._flydsl_static_reason
    if reason is not None:
        return reason

    T = int(m.num_actual_tokens)
    if T < 1 or T > int(mixed_qkv.shape[0]) or T > int(core_attn_out.shape[1]):
        return f"num_actual_tokens={T} outside the layer's {int(mixed_qkv.shape[0])} token rows"
    conv_state, state = layer.kv_cache[0], layer.kv_cache[1]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)
    w = layer.conv1d.weight
    H, D = int(core_attn_out.shape[2]), int(core_attn_out.shape[3])
    state_indices = map_state_indices(m.non_spec_state_indices_tensor, T, getattr(layer, "_flydsl_rows_hint", 0))
    kw = dict(
        x=mixed_qkv[:T], conv_weight=w.view(int(w.shape[0]), int(w.shape[2])), conv_bias=layer.conv1d.bias,
        conv_state=conv_state, a=g1[0, :T].reshape(T, H * D), b=beta[:, :T], A_log=layer.A_log,
        dt_bias=layer.dt_bias, state=state, state_indices=state_indices, output_gate=g2[:T],
        norm_weight=layer.o_norm.weight, lower_bound=layer.gate_lower_bound, norm_eps=float(layer.o_norm.eps),
        scale=None, out=core_attn_out[0, :T],
    )
    name, why = _covers(kw, backend)
    if name is None:
        return f"flydsl-backends does not cover this call ({why})"
    from .api import kda_decode

    kda_decode(**kw, backend=name)  # the implementation the memo chose for this call signature
    if T < int(core_attn_out.shape[1]):
        core_attn_out[:, T:].zero_()
    return None


# --- what the layer classes run (kda_backend.vllm_layers) --------------------------------------------

def _rows_hint(vllm_config) -> int:
    try:
        hint = int(vllm_config.scheduler_config.max_num_seqs)
        cap = vllm_config.compilation_config.max_cudagraph_capture_size
        return max(hint, int(cap or 0))
    except Exception:  # a partial config (unit tests): size the buffer on first use
        return 0


def _vllm_class(layer) -> type:
    """The vLLM layer class ``layer``'s class extends (for the log lines)."""
    return next(c for c in type(layer).__mro__ if c.__module__.startswith("vllm."))


def configure_layer(layer, vllm_config) -> None:
    """At construction: whether ``layer`` takes our path (``vllm_config``'s switch, then the layer's own
    modules), stored on the layer, and the answer logged once per layer class."""
    name, base = layer._flydsl_label = type(layer).__name__, _vllm_class(layer).__name__
    layer._flydsl_kda = flydsl_kda_enabled(vllm_config)
    layer._flydsl_rows_hint = _rows_hint(vllm_config)
    layer._flydsl_static_reason = _static_reason(layer)
    if not layer._flydsl_kda:
        _log_once((name, "off"), logging.INFO, "KDA decode (%s): vLLM's path (additional_config %r not set)", base,
                  CONFIG_KEY)
    elif layer._flydsl_static_reason is not None:
        _log_once((name, "static"), logging.WARNING, "KDA decode (%s): vLLM's path (%s)", base,
                  layer._flydsl_static_reason)
    else:
        _log_once((name, "on"), logging.INFO, "KDA decode (%s): flydsl-backends kda_decode for pure decode "
                  "batches (implementation chosen per call: FLYDSL_BACKENDS_KDA or auto); prefill, mixed and "
                  "speculative batches: vLLM's path", base)


def forward_on_flydsl(layer, mixed_qkv, g1, g2, beta, core_attn_out) -> bool:
    """The layer's ``_forward`` on our op when it is switched on and covers the batch (True: done,
    ``core_attn_out`` written); False: vLLM's ``_forward`` runs it (the reason logged once)."""
    if not layer._flydsl_kda:
        return False
    name, base = layer._flydsl_label
    reason = decode_on_flydsl(layer, mixed_qkv, g1, g2, beta, core_attn_out)
    if reason is None:
        _log_once((name, "ran"), logging.INFO, "KDA decode (%s): flydsl-backends kda_decode ran", base)
        return True
    _log_once((name, reason), logging.INFO, "KDA decode (%s) batch: vLLM's path (%s)", base, reason)
    return False


def kimi_linear_layer_class() -> type:
    """Our subclass of vLLM's ``KimiGatedDeltaNetAttention`` (imports the layer's module)."""
    from .vllm_layers import FlyDSLKimiGatedDeltaNetAttention

    return FlyDSLKimiGatedDeltaNetAttention


def kimi_k3_layer_class() -> type:
    """Our subclass of ROCm's ``KimiK3DeltaAttention`` (raises ImportError without ROCm + aiter)."""
    from .vllm_layers_k3 import FlyDSLKimiK3DeltaAttention

    return FlyDSLKimiK3DeltaAttention


def _register(name: str, build) -> bool:
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    cls = build()
    have = op_registry_oot.get(name)
    if have is cls:
        return True
    if have is not None:
        log.warning("KDA layer hook: %s is already replaced by %s; flydsl-backends leaves it", name,
                    f"{have.__module__}.{have.__qualname__}")
        return False
    PluggableLayer.register_oot(name=name)(cls)
    _registered[name] = cls
    return True


def register_layer_hooks() -> bool:
    """Register the KDA layer subclasses with vLLM now (idempotent; imports vLLM's layer modules).

    Returns whether the Kimi-Linear hook is in place. The Kimi-K3 hook is added only on ROCm when
    ``vllm.models.kimi_k3.amd.kda`` imports; otherwise it is skipped with a debug log. The vLLM plugin
    calls ``install_layer_hooks`` instead, which makes the same registrations without the imports.
    """
    with _lock:
        # the module first: with install_layer_hooks in place its import registers the layer itself (the
        # class is then built once, not again inside its own builder)
        importlib.import_module(KIMI_LINEAR_MODULE)
        ok = _register(KIMI_LINEAR_LAYER, kimi_linear_layer_class)
        _register_k3()
        return ok


def _register_k3() -> None:
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_rocm():
            raise ImportError("not a ROCm platform (NVIDIA's KimiK3DeltaAttention shares the name)")
        importlib.import_module(KIMI_K3_MODULE)  # as above: its import may register it
        _register(KIMI_K3_LAYER, kimi_k3_layer_class)
    except Exception as exc:  # ImportError without aiter, or anything its import chain raises
        log.debug("KDA layer hook: Kimi-K3 (%s) not registered: %s: %s", KIMI_K3_MODULE, type(exc).__name__, exc)


def _on_kimi_linear_import(_module) -> None:
    with _lock:
        _register(KIMI_LINEAR_LAYER, kimi_linear_layer_class)


def _on_kimi_k3_import(_module) -> None:
    with _lock:
        _register_k3()


def install_layer_hooks() -> None:
    """What the vLLM plugin calls in every process: each layer's registration is made when vLLM itself
    first imports that layer's module (at once if it already has), never by importing it here. The
    Kimi-Linear layer module imports FLA's utilities, which query the GPU at import: imported by the
    plugin, they would initialise CUDA in every process that loads it, ``vllm serve``'s API server
    included (a context there holds GPU memory; under ``vllm.LLM`` it forces vLLM to spawn its engine
    core)."""
    after_import(KIMI_LINEAR_MODULE, _on_kimi_linear_import)
    after_import(KIMI_K3_MODULE, _on_kimi_k3_import)
