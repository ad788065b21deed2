"""What a real SGLang 0.5.23 engine needs to serve on an NVIDIA GPU without sgl_kernel (its CUDA
wheel is built for torch 2.14 and cannot travel to the device, which has torch 2.11 + Triton 3.6):
the GPU counterpart of ``sglang_cpu`` (read with SGLang 0.5.23's source; run on the H200 by
``benchmarks/device_run.sh`` e2e-sglang, serve-sglang, spec-sglang and kimi-sglang).

How SGLang decides "CUDA" (two independent answers):

* ``sglang.srt.utils.is_cuda()`` is torch's answer (``torch.cuda.is_available() and
  torch.version.cuda``), evaluated at import time by many modules (``_is_cuda = is_cuda()``). On the
  H200 it is True whatever the platform is, so those modules import their sgl_kernel names at
  module level (layernorm, activation, sampler, triton_backend, memory_pool_host, moe, ...). The
  device stand-in ``integration_tests/sglang/device_stubs/sgl_kernel`` makes every such import
  load; a name called without a stand-in raises ``NotImplementedError`` naming itself.
* ``current_platform`` (``srt/platforms``) is the platform object. ``TestCudaPlatform`` below is
  SGLang's ``CudaDeviceMixin`` (torch.cuda memory, streams, nccl, ``device "cuda"``) marked
  **out-of-tree**: SGLang's fused ops (``BaseFusedOp``: RMSNorm, SiluAndMul, RotaryEmbedding,
  ClampPosition, ...) then dispatch ``forward_<dispatch key>`` = ``forward_native`` (torch) instead
  of ``forward_cuda`` (sgl_kernel / JIT CUDA) (``kernels/fused_op.py`` ``_resolve_forward_method``
  step 3); RotaryEmbedding does not pick its JIT fallback kernel (``rotary_embedding/base.py:122``);
  ``capabilities`` turn Triton (allocator kernels) and decode graph capture on; the decode graph
  runner is SGLang's own ``DecodeCudaGraphRunner`` (an OOT platform must name it:
  ``cuda_graph_setup.py`` ``require_out_of_tree_impl``); PyNccl stays off (TP 1).

What still reaches CUDA-only code on this path, and what this module does about it (all test-side,
installed by ``activate()`` in every SGLang process; nothing in the installed sglang is modified):

1. ``direct_register_custom_op`` (``srt/utils/common.py``) registers SGLang's ``sglang::`` custom
   ops for the ``PrivateUse1`` dispatch key on an out-of-tree platform, where in-tree CUDA gets
   ``CUDA``. Eager calls on plain CUDA tensors skip the dispatcher (``custom_op.py``
   ``_call_directly_in_eager``), but calls under a dispatch/function mode, the profiler or
   torch.compile go through it and would find no CUDA kernel. ``_custom_ops_on_cuda`` registers
   them for ``CUDA`` instead (a wrapper of ``torch.library.Library.impl``, PrivateUse1 -> CUDA for
   the ``sglang`` library only, installed before the first registration asks the platform; torch's
   own libraries register both keys, H200 run of 2026-12-04).
2. ``MHATokenToKVPool.set_kv_buffer`` (SGLang's own pool, used by its ``triton`` backend; flydsl
   writes through its own pool) calls the JIT CUDA ``store_cache`` kernel when
   ``can_use_store_cache`` compiles it (tvm-ffi + nvcc + ninja at run time). ``_no_jit_store_cache``
   answers False so the pool takes its torch index-put path on every machine (the image's
   toolchain does not decide the result); ``FLYDSL_SGL_JIT=1`` keeps SGLang's choice.
3. sgl_kernel names that are called on this path: ``sgl_kernel.utils.is_arch_support_pdl``
   (``TritonAttnBackend.__init__``: answers False, no programmatic dependent launch) and
   ``weak_ref_tensor`` (breakable/piecewise graphs only, which stay off): stand-ins in the device
   stub package, documented there.
4. ``sglang.Engine`` asserts the ``sglang-kernel`` distribution's version on CUDA:
   ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1`` (SGLang's own switch).
5. ``DualGemm`` (``srt/layers/dual_gemm.py``, the Llama MLP) asks torch's ``is_cuda()`` and then
   imports its CuTe-DSL kernel (``cutlass``, not in the image): ``_no_cutedsl_dual_gemm`` makes it
   select no fused mode there.

CUDA graphs: decode graphs only (``disable_prefill_cuda_graph``: the default prefill backend on CUDA
is the breakable graph, which wants ``weak_ref_tensor`` and piecewise machinery), captured by
SGLang's ``DecodeCudaGraphRunner`` + ``FullCudaGraphBackend`` with ``torch.cuda.graph``; the layers'
torch-native forwards and the Triton kernels (flydsl's, SGLang's triton backend) are capturable.

``prepare(tmpdir)`` declares the platform (``sglang_cpu.declare_platform``) and returns the
environment SGLang's processes need. ``FLYDSL_SGLANG_TRACE`` works as on CPU.
"""

from __future__ import annotations

import functools
import os

from integration_tests.e2e import sglang_cpu

DIST = "flydsl_backends_test_cuda_platform"
PLATFORM_NAME = "flydsl_test_cuda"
JIT_ENV = "FLYDSL_SGL_JIT"
ENV = {
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # no sglang-kernel distribution on the device
    "PYTHONFAULTHANDLER": "1",  # a crashing scheduler process prints its Python stack
}


@functools.lru_cache(maxsize=None)
def _platform_class():
    import torch
    from sglang.srt.platforms.cuda import CudaDeviceMixin
    from sglang.srt.platforms.interface import PlatformCapabilities, PlatformEnum, SRTPlatform

    class TestCudaPlatform(sglang_cpu.SpecDeclarations, CudaDeviceMixin, SRTPlatform):
        """SGLang's CUDA device operations as an out-of-tree platform: torch-native layers, Triton
        allowed, decode CUDA graphs with SGLang's own runner; no sgl_kernel. Speculative decoding as
        declared on the CPU platform (SGLang's spec-path Triton kernels native here)."""

        _enum = PlatformEnum.OOT
        device_name = "cuda"
        device_type = "cuda"
        capabilities = PlatformCapabilities(supports_triton=True, graph_capture=True)

        def get_default_attention_backend(self) -> str:
            return "triton"

        def get_dispatch_key_name(self) -> str:
            return "native"

        def get_graph_runner_cls(self):
            from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

            return DecodeCudaGraphRunner

        def get_group_coordinator_device(self, local_rank: int):
            return torch.device(f"cuda:{local_rank}")

    TestCudaPlatform.__qualname__ = "TestCudaPlatform"
    return TestCudaPlatform


def __getattr__(name: str):
    # the class is built on first access: importing this module, the platform's entry point, must not import
    # sglang (SGLang's platform discovery is already running)
    if name == "TestCudaPlatform":
        return _platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _custom_ops_on_cuda() -> None:
    """Register what SGLang registers for ``PrivateUse1`` (its out-of-tree dispatch key) for
    ``CUDA`` instead (point 1 of the module docstring). Idempotent."""
    import torch.library

    real = torch.library.Library.impl
    if getattr(real, "_flydsl_cuda", False):
        return

    def impl(self, op_name, fn, dispatch_key="", *args, **kwargs):
        # SGLang's own library only: torch itself registers CUDA and PrivateUse1 kernels side by side
        # (torch.distributed.fsdp), and a second CUDA kernel for one op fails its import
        if dispatch_key == "PrivateUse1" and getattr(self, "ns", None) == "sglang":
            dispatch_key = "CUDA"
        return real(self, op_name, fn, dispatch_key, *args, **kwargs)

    impl._flydsl_cuda = True
    impl.__wrapped__ = real
    torch.library.Library.impl = impl


def _no_jit_store_cache() -> None:
    """SGLang's MHA pool writes K/V with torch index-put, not the JIT CUDA ``store_cache``
    (point 2 of the module docstring)."""
    if os.environ.get(JIT_ENV) == "1":
        return

    def patch(memory_pool):
        def can_use_store_cache(*args, **kwargs):
            return False

        memory_pool.can_use_store_cache = can_use_store_cache

    sglang_cpu._after_import("sglang.srt.mem_cache.memory_pool", patch)


def _no_cutedsl_dual_gemm() -> None:
    """SGLang's ``DualGemm`` (the fused gate/up projection of its Llama MLP) picks a CuTe-DSL kernel
    whenever torch reports CUDA, importing ``cutlass`` while the model is built (H200 run of 2026-12-04:
    ``ModuleNotFoundError: cutlass``); on this platform it selects no mode, i.e. the plain
    gate_up / down projections (point 5 of the module docstring)."""

    def patch(dual_gemm):
        dual_gemm.is_cuda = lambda: False

    sglang_cpu._after_import("sglang.srt.layers.dual_gemm", patch)


PROFILE_ENV = "FLYDSL_SGL_PROFILE"
KPROFILE_ENV = "FLYDSL_SGL_KPROFILE"


def _on_steps(first: int, count: int, begin, end) -> None:
    """Call ``begin()`` before the scheduler's model step ``first`` and ``end()`` after step ``first +
    count`` (``TpModelWorker.forward_batch_generation``, counted from 1), in the process that runs them."""

    def patch(tp_worker):
        cls = tp_worker.TpModelWorker
        real = cls.forward_batch_generation
        state = {"n": 0}

        def forward_batch_generation(self, *args, **kwargs):
            n = state["n"] = state["n"] + 1
            if n == first:
                begin()
            try:
                return real(self, *args, **kwargs)
            finally:
                if n == first + count:
                    end()

        cls.forward_batch_generation = forward_batch_generation

    sglang_cpu._after_import("sglang.srt.managers.tp_worker", patch)


def _write(path: str, name: str, text: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"{name}_{os.getpid()}.txt"), "w") as f:
        f.write(text)


def _profile_steps(path: str, first: int = 200, count: int = 400) -> None:
    """Diagnosis only (``FLYDSL_SGL_PROFILE=DIR``): cProfile of the scheduler's model steps
    ``first .. first + count``, written to ``DIR/steps_<pid>.txt`` (sorted by own time, then by
    cumulative time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()

    def end():
        prof.disable()
        out = io.StringIO()
        for key in ("tottime", "cumtime"):
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
        _write(path, "steps", f"steps {first}..{first + count}\n" + out.getvalue())

    _on_steps(first, count, prof.enable, end)


def _kernel_profile_steps(spec: str) -> None:
    """Diagnosis only (``FLYDSL_SGL_KPROFILE=DIR[:FIRST[:COUNT]]``, default steps 600..700: the batch-64
    runs of ``sglang_engine_bench``): torch.profiler with CUDA activity over those model steps, written to
    ``DIR/kernels_<pid>.txt``: the window's wall time and the kernels by total GPU time (CUDA-graph
    replays included; the footer sums them) — whether the steps are GPU- or host-bound, and which
    kernels differ between backends."""
    import time

    path, *rest = spec.split(":")
    first = int(rest[0]) if rest else 600
    count = int(rest[1]) if len(rest) > 1 else 100
    state = {}

    def begin():
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        state["prof"].__enter__()
        state["t0"] = time.perf_counter()

    def end():
        import torch

        torch.cuda.synchronize()
        wall = time.perf_counter() - state["t0"]
        prof = state.pop("prof")
        prof.__exit__(None, None, None)
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)
        # the table's footer "Self CUDA time total" is the kernels' GPU time (its step annotation rows are
        # spans, not kernels)
        _write(path, "kernels", f"steps {first}..{first + count}: wall {wall * 1e3:.1f} ms\n{table}\n")

    _on_steps(first, count, begin, end)


def activate():
    """Entry point of ``sglang.srt.platforms``: the platform's qualified name (SGLang resolves its
    platform in every process, so the seams are installed here)."""
    _custom_ops_on_cuda()
    _no_jit_store_cache()
    _no_cutedsl_dual_gemm()
    if os.environ.get(PROFILE_ENV):
        _profile_steps(os.environ[PROFILE_ENV])
    if os.environ.get(KPROFILE_ENV):
        _kernel_profile_steps(os.environ[KPROFILE_ENV])
    if os.environ.get(sglang_cpu.TRACE_ENV):
        sglang_cpu.install_trace(os.environ[sglang_cpu.TRACE_ENV])
    if os.environ.get(sglang_cpu.SPEC_ENV):
        sglang_cpu.install_spec_seams()
    return f"{__name__}:TestCudaPlatform"


def prepare(tmpdir, monkeypatch=None, speculative=False) -> dict:
    """Declare the platform in ``tmpdir`` and return the environment of SGLang's processes (applied
    to this process too with pytest's ``monkeypatch``; see ``sglang_cpu.declare_platform``).
    ``speculative``: the seams of ``sglang_cpu.install_spec_seams`` in the scheduler (no interpreter)."""
    env = dict(ENV, **({sglang_cpu.SPEC_ENV: "1"} if speculative else {}))
    return sglang_cpu.declare_platform(tmpdir, DIST, PLATFORM_NAME, f"{__name__}:activate", env, monkeypatch)
