"""What a vLLM 0.33 engine needs to serve a Kimi-Linear model (KDA linear-attention layers + MLA
layers) without vLLM's compiled extensions: on a CPU machine (``prepare_cpu``, beyond
``vllm_cpu.prepare()``) and on an NVIDIA GPU (``prepare_gpu``, beyond ``vllm_gpu.prepare()``).
Test-side only; nothing here changes an installed file.

Both:

* ``torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert`` (MLA prefill) and
  ``fused_kimi_k3_mla_decode_q_concat_kv_cache_insert`` (MLA decode), the CUDA epilogues of the Kimi
  MLA layer (``models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py``), in torch for the
  unquantized cache: the full key ``[k_nope | k_pe]`` (prefill) or the latent query
  ``[ql_nope | q_pe]`` (decode) and the latent ``[kv_c_normed | k_pe]`` written at each slot >= 0
  (block = slot // block_size, row = slot % block_size); rows with slot < 0 (CUDA-graph padding) leave
  the cache as it was (no host sync: the write is graph-safe). NoPE only (Kimi-Linear's MLA): a RoPE
  request (``positions``) raises.
* Environment: ``VLLM_KIMI_K3_GEMM_AR=0`` (the Kimi model otherwise imports cute-DSL/cutlass to set
  up a fused GEMM+all-reduce).

GPU (``prepare_gpu``; ``engine_kwargs_gpu`` gives the engine arguments):

* MLA layers on ``TRITON_MLA`` (vLLM's Triton decode kernel; FlashMLA / FlashAttention-MLA /
  FlashInfer-MLA are compiled or absent) and MLA prefill on vLLM's ``CPU`` prefill backend, which is
  plain torch attention per request and runs on CUDA tensors too (vLLM's CUDA prefill backends need
  FlashAttention, FlashInfer or TRT-LLM). No prefix caching: continuing an MLA prefill from cached
  context gathers the cache with compiled ops (``cp_gather_cache``).
* vLLM's KDA layer runs its own Triton kernels (chunked prefill, conv, recurrent decode): nothing to
  stand in for.

CPU (``prepare_cpu``):

* ``torch.ops._C.mla_decode_kvcache(out, q, kv_cache, scale, block_tables, seq_lens)``: the CPU MLA
  decode kernel (``CPU_MLA``'s ``forward_mqa``) in plain torch: for each request, softmax(q . k * scale)
  over its first ``seq_len`` latent cache rows, times the rows' first ``kv_lora_rank`` columns
  (the latent "V"), accumulated in FP32.
* ``torch.ops._C.causal_conv1d_update_cpu_vec`` (vLLM's CPU conv-state update, used by the KDA decode
  on the CPU platform): per row whose state index is not ``pad_slot_id``, the depthwise causal conv
  over [cached inputs | new input] (+ bias, SiLU), then the cache keeps the newest ``state_len``
  inputs; skipped rows give zeros.
* ``CPUMLABackend.supports_block_size``: vLLM accepts only 16, but for a hybrid MLA/Mamba model the
  platform rounds the *manager* block up to a multiple of 128 so that one attention page holds a KDA
  state page (``platforms/interface.py`` ``_align_hybrid_block_size``) and then rejects it
  (``_check_aligned_block_size``). The backend's kernel block stays 16
  (``get_supported_kernel_block_sizes``), and the runner splits each manager block into kernel
  blocks of 16, which is what ``forward_mqa`` sees: a multiple of 16 is accepted.
* ``gather_initial_states`` (the KDA prefill's gather of the recurrent states it continues from,
  ``model_executor/layers/mamba/ops/gather_initial_states.py``) asserts ``state.is_cuda or
  state.is_xpu`` before launching its Triton kernel: the Kimi layer module's reference to it is
  replaced by the same gather in torch (rows without an initial state are zeros).
* Triton on CPU: vLLM disables Triton when no GPU driver is active (``triton_utils/importing.py``)
  unless ``CUDA_VISIBLE_DEVICES`` is set and empty (its "distributed start-up" leniency): set that,
  with ``TRITON_INTERPRET=1``, and the real ``triton`` runs the kernels in its interpreter.
  ``triton.runtime.autotuner.Autotuner`` benchmarks every config through the active driver (there
  is none): its ``do_bench`` answers 0 ms without running anything, so the first config is used.
  The interpreter gives ``triton.language`` builtins its semantics by patching the ``tl`` module a
  kernel's globals hold, not module-level aliases of them (the FLA ops' ``log = tl.log``,
  ``exp2 = tl.exp2``, ...: "Did you forget to add @triton.jit?"): its ``_patch_lang`` also patches
  builtins bound directly in the kernel's module (restored with the rest after the launch).
  Compiled Triton makes a ``for i in range(n)`` loop variable a tensor (the FLA kernels call
  ``i_t.to(tl.int64)``), the interpreter leaves it a Python int: while a kernel runs, its module's
  ``range`` yields the interpreter's int32 scalar tensors instead.
* BF16 under the Triton interpreter: it stores bf16 as raw uint16 and has no bf16 arithmetic
  (``InterpreterBuilder`` lacks ``get_bf16``; ``tl.dot`` / ``+`` on bf16 tiles would compute on the
  bit patterns). The project's KDA decode op takes bf16 activations only, so the engine runs a bf16
  model, and vLLM's two Triton KDA entry points the Kimi layer calls,
  ``chunk_kda_with_fused_gate`` (prefill) and ``fused_recurrent_kda_packed_decode`` (decode, the
  path the hook replaces), are wrapped: bf16/fp16 activations go in as FP32 (vLLM's own kernel then
  computes in FP32, the recurrent state is FP32 anyway) and the output is rounded back to the
  activation dtype. In an FP32 model the wrappers pass straight through.
* Environment: ``TRITON_INTERPRET=1`` (vLLM's KDA prefill and its conv / decode
  kernels are Triton: the interpreter runs them on CPU, slowly).

Call ``prepare_cpu()`` / ``prepare_gpu()`` before ``vllm.LLM`` in the engine's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), (CPU) before anything has imported ``vllm.triton_utils`` (it
raises ``TritonUnavailable`` otherwise: run the module in its own pytest process).
"""

from __future__ import annotations

import os

from integration_tests.e2e import vllm_cpu

_LIB = None


class TritonUnavailable(RuntimeError):
    """The process can no longer run vLLM's Triton kernels (see ``prepare``)."""


def _mla_decode(out, query, kv_cache, scale, block_tables, seq_lens):
    import torch

    rank = int(out.shape[-1])
    width = int(kv_cache.shape[-1])
    block = int(kv_cache.shape[1])
    flat = kv_cache.reshape(-1, width)
    for i in range(int(query.shape[0])):
        n = int(seq_lens[i])
        if n <= 0:
            out[i].zero_()
            continue
        blocks = block_tables[i, : (n + block - 1) // block].long()
        rows = (blocks[:, None] * block + torch.arange(block)[None, :]).reshape(-1)[:n]
        kv = flat[rows].float()  # [n, rank + rope]
        p = torch.softmax((query[i].float() @ kv.T) * scale, dim=-1)  # [H, n]
        out[i].copy_((p @ kv[:, :rank]).to(out.dtype))


def _insert_latent(kv_c, k_pe, kv_cache, slot_mapping, block_size):
    import torch

    n = int(kv_c.shape[0])
    slots = slot_mapping[:n].long()
    valid = slots >= 0
    s = torch.where(valid, slots, torch.zeros_like(slots))
    blk, row = s // block_size, s % block_size
    latent = torch.cat([kv_c, k_pe.reshape(n, -1)], dim=-1).to(kv_cache.dtype)
    # padding rows (slot < 0) write back what slot 0 holds (the null block's first row): no host sync,
    # so a captured graph can replay it
    kv_cache[blk, row] = torch.where(valid[:, None], latent, kv_cache[blk, row])


def _no_rope(positions, cos_sin_cache):
    if positions is not None or cos_sin_cache is not None:
        raise NotImplementedError("test stand-in: the Kimi MLA epilogue with RoPE is not provided (NoPE only)")


def _mla_key_concat_insert(q, k_nope, k_pe, kv_c, k_out, kv_cache, slot_mapping, block_size, positions,
                           cos_sin_cache):
    _no_rope(positions, cos_sin_cache)
    pe = k_pe.reshape(k_pe.shape[0], 1, -1)
    k_out[..., : k_nope.shape[-1]] = k_nope
    k_out[..., k_nope.shape[-1]:] = pe.to(k_out.dtype)
    _insert_latent(kv_c, k_pe, kv_cache, slot_mapping, block_size)


def _mla_decode_q_concat_insert(ql_nope, q_pe, kv_c, k_pe, mqa_q, kv_cache, slot_mapping, block_size, positions,
                                cos_sin_cache):
    _no_rope(positions, cos_sin_cache)
    mqa_q[..., : ql_nope.shape[-1]] = ql_nope
    mqa_q[..., ql_nope.shape[-1]:] = q_pe.to(mqa_q.dtype)
    _insert_latent(kv_c, k_pe, kv_cache, slot_mapping, block_size)


def _conv_update(x, conv_state, weight, bias, activation, conv_state_indices, query_start_loc, pad_slot_id):
    import torch
    import torch.nn.functional as F

    if query_start_loc is not None:
        raise NotImplementedError("test stand-in: varlen causal_conv1d_update is not provided")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x  # [B, dim, L]
    out = torch.zeros_like(xs)
    state_len = int(conv_state.shape[-1])
    width = int(weight.shape[-1])
    for b in range(int(xs.shape[0])):
        idx = int(conv_state_indices[b]) if conv_state_indices is not None else b
        if idx == pad_slot_id:
            continue
        window = torch.cat([conv_state[idx].float(), xs[b].float()], dim=-1)  # [dim, state_len + L]
        for t in range(int(xs.shape[-1])):
            y = (window[:, t + state_len + 1 - width: t + state_len + 1] * weight.float()).sum(-1)
            if bias is not None:
                y = y + bias.float()
            out[b, :, t] = (F.silu(y) if activation in ("silu", "swish") else y).to(out.dtype)
        conv_state[idx].copy_(window[:, -state_len:].to(conv_state.dtype))
    return out.squeeze(-1) if squeeze else out


def fp32_compute(fn, names, inplace=()):
    """``fn`` with its named bf16/fp16 tensor arguments replaced by FP32 copies of the same shape and
    strides (``inplace`` ones copied back after the call) and its output (the first one of a tuple)
    rounded back to the first such argument's dtype. Other calls pass straight through."""
    import functools
    import inspect

    import torch

    if getattr(fn, "_kimi_fp32", False):
        return fn
    sig = inspect.signature(fn)
    low = (torch.bfloat16, torch.float16)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        arg = bound.arguments
        lows = [n for n in names if isinstance(arg.get(n), torch.Tensor) and arg[n].dtype in low]
        if not lows:
            return fn(*args, **kwargs)
        dtype = arg[lows[0]].dtype
        originals = {}
        for n in lows:
            t = arg[n]
            f = torch.empty_strided(t.size(), t.stride(), dtype=torch.float32, device=t.device)
            f.copy_(t)
            originals[n], arg[n] = t, f
        res = fn(*bound.args, **bound.kwargs)
        for n in inplace:
            if n in originals:
                originals[n].copy_(arg[n])
        if isinstance(res, torch.Tensor):
            return res.to(dtype)
        if isinstance(res, tuple) and res and isinstance(res[0], torch.Tensor):
            return (res[0].to(dtype), *res[1:])
        return res

    wrapper._kimi_fp32 = True
    return wrapper


def _gather_initial_states(state, indices, has_initial_state):
    import torch

    idx = torch.where(has_initial_state, indices.long(), torch.zeros_like(indices, dtype=torch.long))
    out = state[idx].clone()
    out[~has_initial_state] = 0
    return out


def _no_bench(kernel_call, quantiles=None, **kw):
    return [0.0, 0.0, 0.0] if quantiles else 0.0


def _tensor_range(interpreter):
    def tensor_range(*args):
        for i in range(*(int(a) for a in args)):
            yield interpreter._implicit_cvt(i)

    return tensor_range


def _patch_lang_aliases(interpreter):
    import sys

    import triton.language as tl

    original = interpreter._patch_lang

    def patch_lang(fn):
        scope = original(fn)
        module = sys.modules.get(fn.__module__)
        if module is not None and getattr(module, "__dict__", None) is fn.__globals__:
            for name, member in list(fn.__globals__.items()):
                if tl.core.is_builtin(member):
                    interpreter._patch_attr(module, name, member, interpreter.interpreter_builder, scope)
            caller = sys._getframe(1).f_locals.get("self")
            if type(caller).__name__ == "GridExecutor":  # a launch (restored after it), not a device call
                scope.set_attr(module, "range", _tensor_range(interpreter))
        return scope

    patch_lang._kimi_cpu = True
    return patch_lang


_EPILOGUES = {
    "fused_kimi_k3_mla_key_concat_kv_cache_insert": (
        "Tensor q, Tensor k_nope, Tensor k_pe, Tensor kv_c_normed, Tensor(a!) k_out, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int block_size, Tensor? positions, Tensor? cos_sin_cache", "_mla_key_concat_insert"),
    "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert": (
        "Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) mqa_q, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int block_size, Tensor? positions, Tensor? cos_sin_cache", "_mla_decode_q_concat_insert"),
}
_CPU_OPS = {
    "mla_decode_kvcache": (
        "Tensor(a!) out, Tensor query, Tensor kv_cache, float scale, Tensor block_tables, Tensor seq_lens",
        "_mla_decode"),
    "causal_conv1d_update_cpu_vec": (
        "Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, str? activation, Tensor? conv_state_indices, "
        "Tensor? query_start_loc, int pad_slot_id", "_conv_update"),
}
_RETURNS = {"causal_conv1d_update_cpu_vec": "Tensor"}


def register_ops(ops: dict, dispatch_key: str) -> None:
    """Define the stand-in ``torch.ops._C`` ops of ``ops`` for ``dispatch_key`` (a name that already
    exists, e.g. from a real extension, is left alone)."""
    global _LIB
    import torch

    if _LIB is None:
        _LIB = torch.library.Library("_C", "FRAGMENT")
    for name, (args, fn) in ops.items():
        if hasattr(torch.ops._C, name):
            continue
        _LIB.define(f"{name}({args}) -> {_RETURNS.get(name, '()')}")
        _LIB.impl(name, globals()[fn], dispatch_key)


def prepare_gpu() -> None:
    """``vllm_gpu.prepare()`` plus the Kimi MLA epilogues on CUDA (engine arguments: ``engine_kwargs_gpu``)."""
    from integration_tests.e2e import vllm_gpu

    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    vllm_gpu.prepare()
    register_ops(_EPILOGUES, "CUDA")


def engine_kwargs_gpu(mode: str, capture_sizes=None) -> dict:
    """``vllm_gpu.engine_kwargs(mode)`` with the MLA layers on TRITON_MLA and MLA prefill on vLLM's torch
    (``CPU``) prefill backend, no prefix caching (see the module docstring)."""
    from integration_tests.e2e import vllm_gpu

    kw = vllm_gpu.engine_kwargs(mode, capture_sizes)
    kw["attention_config"] = {"backend": "TRITON_MLA", "mla_prefill_backend": "CPU"}
    kw["enable_prefix_caching"] = False
    return kw


def prepare_cpu() -> None:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    vllm_cpu.prepare()
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise TritonUnavailable(
            "vLLM decided at import time that Triton is unusable (vllm.triton_utils.HAS_TRITON is False): "
            "this process imported vllm.triton_utils before vllm_kimi.prepare_cpu() set CUDA_VISIBLE_DEVICES='' "
            "(e.g. another vLLM engine test ran first). Run this test module in its own pytest process.")
    register_ops({**_CPU_OPS, **_EPILOGUES}, "CPU")

    from triton.runtime import autotuner, interpreter

    autotuner.Autotuner.do_bench = property(lambda self: _no_bench)
    if not getattr(interpreter._patch_lang, "_kimi_cpu", False):
        interpreter._patch_lang = _patch_lang_aliases(interpreter)

    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    if not getattr(CPUMLABackend, "_kimi_cpu_block", False):
        CPUMLABackend.supports_block_size = classmethod(
            lambda cls, block_size: block_size is None or block_size % 16 == 0)
        CPUMLABackend._kimi_cpu_block = True

    from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as kimi_layer

    kimi_layer.gather_initial_states = _gather_initial_states

    from vllm.models.kimi_k3.nvidia.ops.third_party import kda as kda_ops

    if not getattr(kda_ops.chunk_kda_with_fused_gate, "_kimi_fp32", False):
        kda_ops.chunk_kda_with_fused_gate = fp32_compute(kda_ops.chunk_kda_with_fused_gate,
                                                         ("q", "k", "v", "raw_g", "raw_beta"))
        kda_ops.fused_recurrent_kda_packed_decode = fp32_compute(kda_ops.fused_recurrent_kda_packed_decode,
                                                                 ("mixed_qkv", "raw_g", "raw_beta", "out"),
                                                                 inplace=("out",))
