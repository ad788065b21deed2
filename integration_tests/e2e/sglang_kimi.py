"""What a real SGLang 0.5.23 engine needs, beyond ``sglang_cpu``'s out-of-tree CPU platform, to serve
a Kimi-Linear model (KDA linear-attention layers + MLA layers) on a bare CPU machine. Test-side
only; nothing in the installed sglang package is modified.

The platform is ``sglang_cpu.TestCpuPlatform`` declared under a second entry point
(``prepare``), whose ``activate`` first installs the seams below in every SGLang process (they
matter in the scheduler, where the model runs):

* SGLang's KDA path is Triton on this platform (``is_cpu()`` is False without
  ``SGLANG_USE_CPU_ENGINE=1``): the prefill (``chunk_kda``), the decode
  (``fused_recurrent_kda_packed_decode``, the step ``--linear-attn-decode-backend flydsl`` replaces),
  the short causal conv (``causal_conv1d_fn`` / ``causal_conv1d_update``) and the output gated
  RMSNorm (``rms_norm_gated``, inside ``FusedRMSNormGated``). They run in Triton's interpreter
  (``TRITON_INTERPRET=1``, in the environment ``prepare`` returns), with the interpreter fixes
  ``vllm_kimi`` describes (the autotuner's benchmark answers 0 ms without a driver; builtins bound
  at module level, e.g. the FLA ops' ``exp = tl.exp``, are patched like ``tl``'s; a kernel's
  ``range`` yields tensors), plus one of its own: ``triton.language.extra.libdevice``'s functions
  are stubs the compiler resolves per backend and return None in the interpreter (the KDA gate
  kernel's ``libdevice.exp``: "unsupported operand type(s) for +: 'float' and 'NoneType'"); while
  a kernel whose module holds ``libdevice`` runs they take the semantics of their ``tl.math``
  namesakes.
* BF16 under the interpreter: it stores bf16 as uint16 and has no bf16 arithmetic (casts only), so
  the five entry points above are wrapped (``vllm_kimi.fp32_compute``): their bf16 tensor arguments go in as
  FP32 copies with the same strides, arguments the kernel updates in place (the conv state pool,
  a decode ``out`` buffer) are copied back, and the first output is rounded back to bf16. SGLang's
  kernels then compute in FP32 throughout (the decode kernel upcasts its bf16 loads itself; on a
  GPU the chunked prefill would feed bf16 operands to its dots); the recurrent state is FP32.
* The MLA layers run on SGLang's ``torch_native`` attention backend (``--attention-backend
  torch_native``, SDPA over the latent cache ``MLATokenToKVPool``). ``DeepseekV2AttentionMLA`` picks
  its forward method per batch through ``AttentionBackendRegistry``, which has no ``torch_native``
  entry and falls back to the ``triton`` handler: MHA (``forward_normal``) for prefills without a
  cached prefix, whose ragged K/V ``torch_native`` cannot take (it reads K/V from the pool only:
  "Expected size ... [2, 128] but got: [2, 576]"). A ``torch_native`` entry registered here returns
  SGLang's ``_dispatch_mla_subtype`` (the absorbed MLA method, what the ``triton`` handler picks for
  extends over a cached prefix and under deterministic inference) for every batch.
* Engine arguments the test passes (not seams): ``disable_overlap_schedule=True`` (with the
  overlap schedule SGLang picks the ``extra_buffer`` radix-cache strategy for hybrid models, which
  an out-of-tree platform must declare support for; without it, ``no_buffer``, which runs here),
  ``max_mamba_cache_size`` (SGLang otherwise sizes the KDA state pool to the host memory: 75k
  slots, 7 GB), and ``A_log`` stored as ``[1, 1, H, 1]`` in the checkpoint (SGLang's loader shards
  it on dim 2).
* ``COUNT_ENV=path``: every call of this project's KDA decode op made through the SGLang adapter
  (``kda_backend.sglang.kda_decode``, bound there at import time) appends its batch size (rows) to
  ``path``. ``BATCH_ENV=path``: one JSON line per forward batch the KDA layers' backend plans
  (``KDAAttnBackend.init_forward_metadata``): its mode (EXTEND or DECODE; SGLang's mixed batches
  come as EXTEND), rows, and per row the new tokens and the cached prefix.

On an NVIDIA GPU (``prepare(..., cuda=True)``): ``sglang_gpu``'s CUDA platform without sgl_kernel,
SGLang's KDA Triton kernels native (bf16), the MLA layer on SGLang's ``triton`` backend; only the
two traces above are installed (``activate_gpu``). Passed on the H200 at 392bd45 (2026-12-04).

Call ``prepare(tmpdir, monkeypatch)`` before ``sglang.Engine``; the engine's spawned processes
inherit the environment.
"""

from __future__ import annotations

import os

from integration_tests.e2e import (
    sglang_cpu,
    vllm_kimi,  # its interpreter helpers; importing it imports no vLLM
)

DIST = "flydsl_backends_test_cpu_kimi_platform"
PLATFORM_NAME = "flydsl_test_cpu_kimi"
GPU_DIST = "flydsl_backends_test_cuda_kimi_platform"
GPU_PLATFORM_NAME = "flydsl_test_cuda_kimi"
COUNT_ENV = "FLYDSL_SGLANG_KDA_CALLS"
BATCH_ENV = "FLYDSL_SGLANG_KDA_BATCHES"

KDA_TRITON = "sglang.srt.layers.attention.linear.kernels.kda_triton"
KDA_BACKEND = "sglang.srt.layers.attention.linear.kda_backend"
NORM_GATE = "sglang.kernels.ops.attention.fla.fused_norm_gate"
MLA_DISPATCH = "sglang.srt.models.deepseek_common.attention_backend_handler"


def _wrap_kda_triton(mod):
    mod.chunk_kda = vllm_kimi.fp32_compute(mod.chunk_kda, ("q", "k", "v", "g", "beta"))
    mod.fused_recurrent_kda_packed_decode = vllm_kimi.fp32_compute(
        mod.fused_recurrent_kda_packed_decode, ("mixed_qkv", "a", "b", "out"), inplace=("out",))


def _wrap_kda_backend(mod):
    mod.causal_conv1d_fn = vllm_kimi.fp32_compute(mod.causal_conv1d_fn, ("x", "weight", "bias", "conv_states"),
                                                  inplace=("conv_states",))
    mod.causal_conv1d_update = vllm_kimi.fp32_compute(mod.causal_conv1d_update,
                                                      ("x", "conv_state", "weight", "bias"), inplace=("conv_state",))


def _wrap_norm_gate(mod):
    mod.rms_norm_gated = vllm_kimi.fp32_compute(mod.rms_norm_gated, ("x", "g", "weight", "bias"))


def _mla_absorbed_on_torch_native(mod):
    def handle_attention_torch_native(attn, forward_batch):
        return mod._dispatch_mla_subtype(attn, forward_batch)

    mod.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


def _trace_batches(path):
    def patch(mod):
        cls = mod.KDAAttnBackend
        real = cls.init_forward_metadata
        if getattr(real, "_kimi_trace", False):
            return

        def init_forward_metadata(self, forward_batch):
            import json

            fb = forward_batch
            rec = {"mode": fb.forward_mode.name, "rows": int(fb.batch_size),
                   "extend": list(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu is not None else None,
                   "prefix": list(fb.extend_prefix_lens_cpu) if fb.extend_prefix_lens_cpu is not None else None}
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            return real(self, forward_batch)

        init_forward_metadata._kimi_trace = True
        cls.init_forward_metadata = init_forward_metadata

    return patch


def _count_calls(path):
    def patch(mod):
        real = mod.kda_decode
        if getattr(real, "_kimi_count", False):
            return

        def kda_decode(x, *args, **kwargs):
            with open(path, "a") as f:
                f.write(f"{int(x.shape[0])}\n")
            return real(x, *args, **kwargs)

        kda_decode._kimi_count = True
        mod.kda_decode = kda_decode

    return patch


def _patch_lang_libdevice(interpreter):
    """The interpreter's ``_patch_lang`` that also gives ``triton.language.extra.libdevice``'s
    functions (stubs the compiler resolves per backend; ``None`` in the interpreter) the semantics
    of their ``tl.math`` namesakes, for kernels whose module holds ``libdevice`` (``kda.py``'s gate
    kernel calls ``libdevice.exp``); restored with the rest after the launch."""
    import triton.language as tl
    from triton.language.extra import libdevice

    original = interpreter._patch_lang
    # taken now: while a kernel runs, tl.math's members are the interpreter's wrappers
    members = {name: getattr(tl.math, name) for name in dir(libdevice)
               if tl.core.is_builtin(getattr(tl.math, name, None))}

    def patch_lang(fn):
        scope = original(fn)
        if any(v is libdevice for v in fn.__globals__.values()):
            for name, member in members.items():
                interpreter._patch_attr(libdevice, name, member, interpreter.interpreter_builder, scope)
        return scope

    return patch_lang


def install_seams() -> None:
    from triton.runtime import autotuner, interpreter


    autotuner.Autotuner.do_bench = property(lambda self: vllm_kimi._no_bench)
    if not getattr(interpreter._patch_lang, "_kimi_cpu", False):
        # vllm_kimi's wrapper must stay outermost: it looks at its caller to tell a launch
        interpreter._patch_lang = _patch_lang_libdevice(interpreter)
        interpreter._patch_lang = vllm_kimi._patch_lang_aliases(interpreter)
    sglang_cpu._after_import(KDA_TRITON, _wrap_kda_triton)
    sglang_cpu._after_import(KDA_BACKEND, _wrap_kda_backend)
    sglang_cpu._after_import(NORM_GATE, _wrap_norm_gate)
    sglang_cpu._after_import(MLA_DISPATCH, _mla_absorbed_on_torch_native)
    install_traces()


def install_traces() -> None:
    """The op-call count and the KDA batch trace (``COUNT_ENV``, ``BATCH_ENV``), where set."""
    if os.environ.get(COUNT_ENV):
        sglang_cpu._after_import("kda_backend.sglang", _count_calls(os.environ[COUNT_ENV]))
    if os.environ.get(BATCH_ENV):
        sglang_cpu._after_import(KDA_BACKEND, _trace_batches(os.environ[BATCH_ENV]))


def activate():
    """Entry point of ``sglang.srt.platforms``: the seams, then ``sglang_cpu``'s platform."""
    install_seams()
    return sglang_cpu.activate()


def activate_gpu():
    """Entry point of ``sglang.srt.platforms`` on a GPU: the traces, then ``sglang_gpu``'s platform."""
    from integration_tests.e2e import sglang_gpu

    install_traces()
    return sglang_gpu.activate()


def prepare(tmpdir, monkeypatch=None, count_path=None, batch_path=None, cuda=False) -> dict:
    """Declare the platform (``sglang_cpu.declare_platform``): the CPU one with Triton's interpreter on,
    or (``cuda``) ``sglang_gpu``'s; ``COUNT_ENV`` / ``BATCH_ENV`` when ``count_path`` / ``batch_path``
    are given."""
    if cuda:
        from integration_tests.e2e import sglang_gpu

        extra, dist, name, entry = dict(sglang_gpu.ENV), GPU_DIST, GPU_PLATFORM_NAME, f"{__name__}:activate_gpu"
    else:
        extra, dist, name, entry = {"TRITON_INTERPRET": "1"}, DIST, PLATFORM_NAME, f"{__name__}:activate"
    if count_path is not None:
        extra[COUNT_ENV] = str(count_path)
    if batch_path is not None:
        extra[BATCH_ENV] = str(batch_path)
    return sglang_cpu.declare_platform(tmpdir, dist, name, entry, extra, monkeypatch)


def read_batches(path) -> list:
    return sglang_cpu.read_trace(path)


def read_counts(path) -> list:
    from pathlib import Path

    p = Path(path)
    return [int(line) for line in p.read_text().split()] if p.exists() else []
