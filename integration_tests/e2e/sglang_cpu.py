"""What a real SGLang 0.5.23 engine needs to serve on a bare CPU machine without sgl_kernel (this
project's CI installs SGLang's Python tree only), for ``--attention-backend flydsl``.

SGLang's own CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports ``sgl_kernel`` CPU ops at module
import time (``kernels/ops/kvcache/cache_move.py`` -> ``copy_all_layer_kv_cache_cpu``, ...), so it
cannot start here. With no platform at all (``device="cpu"`` on the base ``SRTPlatform``) the model
build stops at ``RotaryEmbedding``, which then imports ``vllm._custom_ops.rotary_embedding``
(``srt/layers/rotary_embedding/base.py:138``). Instead this module provides an **out-of-tree
platform** through SGLang's own platform plugin group ``sglang.srt.platforms``
(``srt/platforms/__init__.py``): ``TestCpuPlatform`` is SGLang's ``CpuDeviceMixin`` (host memory,
``gloo``, ``torch.device("cpu")``) marked out-of-tree, so that SGLang's layers take their
platform-neutral torch paths (``BaseFusedOp`` dispatches ``forward_native`` on an OOT platform with
no ``forward_<key>``), Triton and graph capture are off (``PlatformCapabilities()`` defaults), and
the attention is whatever ``--attention-backend`` names (here this project's ``flydsl`` backend,
whose kernels are the torch reference on CPU). No compiled-op stand-ins were needed on this
platform: the layers of the tiny Llama (RMSNorm, RoPE, SiLU-and-mul, linear, embedding) and the
sampler ran their torch paths, the KV writes and attention are this project's, and the radix cache's
tree core is a native extension shipped inside the sglang wheel itself
(``srt/mem_cache/rust_tree_core``), which loads on CPU.

Speculative decoding (``prepare(speculative=True)``; STANDALONE and EAGLE) needs more: see
``install_spec_seams`` (SGLang's spec-path Triton kernels under Triton's interpreter, its XPU-branch
tree kernels, a torch_native draft).

The platform is found through an entry point, in every SGLang process (the engine's scheduler and
detokenizer are spawned processes): ``prepare(tmpdir)`` writes a small ``.dist-info`` declaring it
into ``tmpdir`` and puts ``tmpdir`` and the repository root on ``PYTHONPATH`` (the spawned processes
inherit the environment). ``SGLANG_PLATFORM`` names it, so no other platform is probed. Nothing
in the installed sglang package is modified.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIST = "flydsl_backends_test_cpu_platform"
PLATFORM_NAME = "flydsl_test_cpu"
SPEC_ALGORITHMS = ("STANDALONE", "EAGLE")
DRAFT_BACKEND = "torch_native"


class SpecDeclarations:
    """What a test platform declares for speculative decoding (``install_spec_seams``: STANDALONE and EAGLE,
    the draft on ``torch_native``); mixed in before SGLang's ``SRTPlatform`` by the CPU and GPU platforms."""

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm in SPEC_ALGORITHMS

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm in SPEC_ALGORITHMS and backend == DRAFT_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return DRAFT_BACKEND


@functools.lru_cache(maxsize=None)
def _platform_class():
    from sglang.srt.platforms.cpu import CpuDeviceMixin
    from sglang.srt.platforms.interface import PlatformCapabilities, PlatformEnum, SRTPlatform

    class TestCpuPlatform(SpecDeclarations, CpuDeviceMixin, SRTPlatform):
        """SGLang's CPU device operations as an out-of-tree platform: no Triton, no graphs, no
        sgl_kernel; layers run their torch-native forwards."""

        _enum = PlatformEnum.OOT
        device_name = "cpu"
        device_type = "cpu"
        capabilities = PlatformCapabilities()

        def get_default_attention_backend(self) -> str:
            return "flydsl"

        def get_dispatch_key_name(self) -> str:
            return "native"

        def is_pin_memory_available(self, device=None) -> bool:
            return False

    TestCpuPlatform.__qualname__ = "TestCpuPlatform"
    return TestCpuPlatform


def __getattr__(name: str):
    # the class is built on first access: importing this module, the platform's entry point, must not import
    # sglang (SGLang's platform discovery is already running)
    if name == "TestCpuPlatform":
        return _platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TRACE_ENV = "FLYDSL_SGLANG_TRACE"
ENGINE_MODULES = ("uvloop", "setproctitle", "xgrammar")  # sglang.Engine imports them (not in older CPU venvs)


def skip_without_engine() -> None:
    """Skip the calling test module unless SGLang and what its engine imports are installed (this module
    itself imports no sglang: it is also the platform entry point)."""
    import pytest

    pytest.importorskip("sglang")
    for mod in ENGINE_MODULES:
        pytest.importorskip(mod, reason=f"{mod} missing: build the venv with integration_tests/setup-cpu-env.sh "
                                        "sglang DIR")


def activate():
    """Entry point of ``sglang.srt.platforms``: the platform's qualified name. SGLang resolves its
    platform in every process (engine, scheduler, detokenizer), so this is also where the attention
    trace is installed in the scheduler."""
    if os.environ.get(TRACE_ENV):
        install_trace(os.environ[TRACE_ENV])
    if os.environ.get(SPEC_ENV):
        install_spec_seams()
    return f"{__name__}:TestCpuPlatform"


SPEC_ENV = "FLYDSL_SGLANG_SPEC"


class _AfterImport:
    """A ``sys.meta_path`` finder that runs ``fn(module)`` right after ``name`` executes (before
    any importer binds names from it)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        import importlib.machinery
        import sys

        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        real, fn = spec.loader.exec_module, self.fn

        def exec_module(module):
            real(module)
            fn(module)

        spec.loader.exec_module = exec_module
        return spec


def _after_import(name, fn):
    import sys

    if name in sys.modules:
        fn(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, fn))


def install_spec_seams() -> None:
    """What SGLang's speculative decoding (STANDALONE: a separate draft model, or EAGLE: a
    ``LlamaForCausalLMEagle`` draft fed the target's hidden states; topk 1) needs on this platform;
    test-only, installed in the scheduler process when ``SPEC_ENV`` is set. EAGLE needed nothing
    beyond what STANDALONE needs. The platform itself declares both with a ``torch_native`` draft
    (``supports_speculative_algorithm``, ``..._draft_attention_backend``), which SGLang checks for
    an out-of-tree platform (``srt/arg_groups/speculative_hook.py:1061-1068``). Three stand-ins, all
    routing to SGLang's own code:

    * EAGLE tree build and greedy tree verification (``kernels/ops/speculative/spec_tree.py``:
      ``build_tree_kernel_efficient_func``, ``verify_tree_greedy_func``) have CUDA/HIP, NPU,
      sgl_kernel-CPU and XPU branches and reject an out-of-tree platform (``:428``, ``:549``: "no
      platform seam yet"). Both are pointed at the branch SGLang takes on XPU, its own Triton
      kernels (``sgl_build_tree_kernel_triton`` ``:318``, ``verify_tree_greedy_triton`` ``:447``).
    * The draft model's attention: ``DraftBackendFactory.create_draft_extend_backend`` and
      ``create_decode_backend`` (``srt/speculative/draft_utils.py:84-168``) know only GPU/NPU/AMX
      backends (``:64`` raises for others). With ``torch_native`` named they return SGLang's
      ``TorchNativeAttnBackend`` for the draft runner's extend passes and, for
      ``speculative_num_steps`` > 1, one per draft step (``_torch_native_multi_step``). The draft
      keeps SGLang's own KV pool.
    * The spec path's Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
      set by ``prepare(speculative=True)``): the two above plus ``assign_draft_cache_locs_contiguous``
      (``kernels/ops/speculative/cache_locs.py:43``), ``fill_bonus_tokens``
      (``kernels/ops/speculative/eagle.py:14``), ``assign_req_to_token_pool``
      (``srt/mem_cache/allocation.py:692``), ``get_last_loc_kernel``
      (``kernels/ops/memory/common.py:121``) and the draft pool's KV-copy warm-up
      ``copy_all_layer_kv_cache_tiled`` (``kernels/ops/kvcache/cache_move.py:146``, launched from
      ``srt/mem_cache/memory_pool.py:2420``). On CPU SGLang would otherwise call sgl_kernel's CPU
      ops, which need ``SGLANG_USE_CPU_ENGINE=1`` and the compiled package. This project's own
      attention stays on its torch reference (the ``auto`` order on CPU).
    ``FLYDSL_SGLANG_TRITON_LOG=path``: log each interpreted kernel launch (``module:kernel seconds``)."""

    def patch(spec_tree):
        def build_tree_kernel_efficient_func(*args, **kwargs):
            return spec_tree.sgl_build_tree_kernel_triton(*args, **kwargs)

        def verify_tree_greedy_func(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1):
            spec_tree.verify_tree_greedy_triton(
                predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
                candidates=candidates, retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
                retrieve_next_sibling=retrieve_next_sibling, target_predict=target_predict)
            return predicts, accept_index, accept_token_num

        spec_tree.build_tree_kernel_efficient_func = build_tree_kernel_efficient_func
        spec_tree.verify_tree_greedy_func = verify_tree_greedy_func

    _after_import("sglang.kernels.ops.speculative.spec_tree", patch)

    def patch_draft(draft_utils):
        factory = draft_utils.DraftBackendFactory
        real = factory.create_draft_extend_backend

        def create_draft_extend_backend(self):
            if self.draft_attn_backend != DRAFT_BACKEND:
                return real(self)
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            backend = TorchNativeAttnBackend(self.draft_model_runner)
            backend.prefill_attention_backend_str = backend.decode_attention_backend_str = DRAFT_BACKEND
            return backend

        real_decode = factory.create_decode_backend

        def create_decode_backend(self):
            if self.draft_attn_backend != DRAFT_BACKEND or self.speculative_num_steps <= 1:
                return real_decode(self)
            backend = _torch_native_multi_step(self.draft_model_runner, self.speculative_num_steps)
            for b in backend.attn_backends:
                b.prefill_attention_backend_str = b.decode_attention_backend_str = DRAFT_BACKEND
            return backend

        factory.create_draft_extend_backend = create_draft_extend_backend
        factory.create_decode_backend = create_decode_backend

    _after_import("sglang.srt.speculative.draft_utils", patch_draft)
    if os.environ.get(TRITON_LOG_ENV):
        _log_interpreted_kernels(os.environ[TRITON_LOG_ENV])


def _torch_native_multi_step(runner, num_steps):
    """The draft's multi-step decode on SGLang's ``TorchNativeAttnBackend`` (topk 1): what SGLang's
    per-step draft backends do (``TritonMultiStepDraftBackend``: step ``i`` attends to the committed
    prefix plus the chain's first ``i + 1`` draft slots, ``seq_lens + i + 1`` tokens,
    ``srt/layers/attention/triton_backend.py`` ``common_template``), with the draft slots read
    through ``req_to_token``, where topk 1 allocates them right after the prefix
    (``assign_draft_cache_locs_contiguous``). The steps' writes go to the ``out_cache_loc`` the
    worker sets per step."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class DraftStep(TorchNativeAttnBackend):
        def __init__(self, runner, step):
            super().__init__(runner)
            self.step = step

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            seq_lens = forward_batch.seq_lens
            forward_batch.seq_lens = seq_lens + (self.step + 1)
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens = seq_lens

    steps = [DraftStep(runner, i) for i in range(num_steps - 1)]
    return SimpleNamespace(attn_backends=steps, token_to_kv_pool=steps[0].token_to_kv_pool,
                           init_forward_metadata=lambda fb: [b.init_forward_metadata(fb) for b in steps])


TRITON_LOG_ENV = "FLYDSL_SGLANG_TRITON_LOG"


def _log_interpreted_kernels(path) -> None:
    """Append ``module:kernel seconds`` to ``path`` for each Triton kernel launch run by the
    interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run
    if getattr(real, "_flydsl_log", False):
        return

    def run(self, *args, **kwargs):
        import time

        t = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            with open(path, "a") as f:
                f.write(f"{self.fn.__module__}:{self.fn.__name__} {time.perf_counter() - t:.4f}\n")

    run._flydsl_log = True
    InterpretedFunction.run = run


def install_trace(path) -> None:
    """Append one JSON line to ``path`` per layer call of this project's paged attention
    (``pa_backend.contract.PAPlan.run``: what ``FlyDSLAttnBackend.forward_decode`` / ``forward_extend``
    run), with the batch it served: decode or ragged (prefill / extend / mixed), the query rows of
    each sequence, their context lengths and the KV cache's dtype and shapes. The test reads it to prove the
    engine's batches ran through the flydsl backend and which shapes they had. Test-only."""
    import json

    from pa_backend import contract as pa_plan

    if getattr(pa_plan.PAPlan.run, "_flydsl_trace", False):
        return
    real = pa_plan.PAPlan.run
    count = iter(range(1 << 62))

    def run(self, query, key_cache, value_cache, *a, **k):
        b = self.batch
        if "_trace_id" not in self.__dict__:  # id() may be reused once a plan is freed
            self._trace_id = next(count)
        qsl = b.query_start_loc_host
        rows = [b.query_length] * b.num_seqs if qsl is None else [qsl[i + 1] - qsl[i] for i in range(b.num_seqs)]
        rec = {"pid": os.getpid(), "plan": self._trace_id, "decode": b.is_decode, "rows": rows,
               "ctx": b.context_lengths.tolist(), "tokens": int(query.shape[0]), "kv_dtype": str(key_cache.dtype),
               "sliding_window": int(k.get("sliding_window") or 0),
               "k_shape": list(key_cache.shape), "v_shape": list(value_cache.shape)}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return real(self, query, key_cache, value_cache, *a, **k)

    run._flydsl_trace = True
    pa_plan.PAPlan.run = run


def read_trace(path) -> list:
    import json

    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def prepare(tmpdir, monkeypatch=None, speculative=False) -> dict:
    """Declare the platform entry point in ``tmpdir`` and return the environment SGLang's processes
    need: give it to a server subprocess, or pass pytest's ``monkeypatch`` to apply it to this
    process (``os.environ``, inherited by the engine's spawned processes, and ``sys.path``, where
    this process's own platform lookup reads entry points), undone with the monkeypatch.
    ``speculative``: also what speculative decoding needs here (``install_spec_seams``; Triton's
    interpreter for SGLang's spec-path kernels)."""
    extra = {SPEC_ENV: "1", "TRITON_INTERPRET": "1"} if speculative else {}
    return declare_platform(tmpdir, DIST, PLATFORM_NAME, f"{__name__}:activate", extra, monkeypatch)


def declare_platform(tmpdir, dist, name, entry, extra_env=None, monkeypatch=None,
                     paths=(ROOT, ROOT / "integration_tests" / "stubs")) -> dict:
    """Declare an out-of-tree SGLang platform: a ``.dist-info`` for distribution ``dist`` in
    ``tmpdir`` whose ``sglang.srt.platforms`` entry point ``name`` is ``entry`` (``module:function``),
    and the environment that makes every SGLang process find it and select it (``PYTHONPATH``:
    ``tmpdir`` and ``paths`` first; ``SGLANG_PLATFORM``; HF offline; plus ``extra_env``). With
    pytest's ``monkeypatch`` it is also applied to this process (``os.environ`` and ``sys.path``),
    otherwise the caller applies the returned environment."""
    tmpdir = Path(tmpdir)
    info = tmpdir / f"{dist}-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.platforms]\n{name} = {entry}\n")
    paths = [str(tmpdir)] + [str(p) for p in paths]
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        "PYTHONPATH": os.pathsep.join(paths + [p for p in old if p not in paths]),
        "SGLANG_PLATFORM": name,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(extra_env or {}),
    }
    if monkeypatch is not None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for p in reversed(paths):
            monkeypatch.syspath_prepend(p)
    return env


class ChildProcessFailed(RuntimeError):
    """A process of an ``sglang.Engine`` (scheduler, detokenizer) failed: it sent SIGQUIT to the
    engine's process."""


def raise_on_sigquit(signum, frame):
    """``sglang.Engine(custom_sigquit_handler=...)``: while the engine starts, a failed child makes
    SGLang kill the whole process tree, the caller included (``engine.py``
    ``launch_phase_sigquit_handler``); this raises in the caller instead, so a benchmark records the
    failure and goes on (its log has the child's traceback). Module-level: the handler is part of
    the engine's arguments."""
    raise ChildProcessFailed("a child process of the SGLang engine failed while it started (SIGQUIT)")


def survive_child_failure(engine, on_failure=None) -> bool:
    """After start-up, SGLang's tokenizer manager answers a child's SIGQUIT by killing the whole
    process tree (``SignalHandler.running_phase_sigquit_handler``, installed at the first request).
    Replace it for ``engine``: stop the request loop instead (the pending ``generate`` then raises),
    after calling ``on_failure()``. Returns False when the engine does not have the expected
    attributes (SGLang's own handler then stays)."""
    tmgr = getattr(engine, "tokenizer_manager", None)
    base = getattr(tmgr, "signal_handler_class", None)
    if base is None:
        return False

    class Handler(base):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            if on_failure is not None:
                on_failure()
            watchdog = getattr(self.tokenizer_manager, "_subprocess_watchdog", None)
            if watchdog is not None:
                watchdog.stop()
            loop = getattr(self.tokenizer_manager, "event_loop", None)
            if loop is not None:
                loop.stop()

    tmgr.signal_handler_class = Handler
    return True
