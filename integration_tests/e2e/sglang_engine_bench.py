"""A real SGLang 0.5.23 engine (``sglang.Engine``, scheduler in its own process) serving the run-time
model (``tiny_model``) with this project's backend (``attention_backend="flydsl"``) and with SGLang's
own ``triton`` backend, both on an FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``, page 16): accuracy
and throughput. A benchmark script, not a test; the SGLang counterpart of ``engine_bench`` (same
outputs, same rules, its ``Bench`` with SGLang's engine):

    python -m integration_tests.e2e.sglang_engine_bench --out DIR        (GPU: sglang_gpu.prepare())
    python -m integration_tests.e2e.sglang_engine_bench --out DIR --cpu  (CPU smoke: sglang_cpu.prepare())

On the GPU, SGLang runs without sgl_kernel on the test-side out-of-tree CUDA platform of
``sglang_gpu`` (torch-native layers, Triton, SGLang's decode CUDA graph runner). Engines (one per
backend, mode and context length, built once, used for every batch, then shut down):
* eager (``disable_cuda_graph``), context_length 1024: accuracy (16 prompts x 64 greedy tokens, top-5
  logprobs) and eager throughput;
* decode CUDA graphs (prefill graphs off; batch sizes 1-64 captured), context_length 1024 and
  131072 (server-width tables): throughput;
* eager, context_length 131072: throughput.
``SGLANG_BENCH_ENGINES="BACKEND:MODE:CONTEXT,..."`` (MODE eager or graphs) runs a subset; accuracy
runs on the eager engines at 1024. Each pair runs again in the other order, throughput only
(``ENGINE_BENCH_ORDER``, as in ``engine_bench``; default ``both``).
Accuracy and throughput as in ``engine_bench`` (vLLM's check_logprobs_close rule, identical
sequences, the copy rule, HF teacher-forced argmax agreement; tokens/s at batch 16 and 64, 128 output
tokens, ignore_eos, timed after a warm-up of the same batch; the greedy tokens of the two backends
compared in each throughput configuration). The radix cache is off (the timed batch repeats the
warm-up's prompts), the KV pool holds ``MAX_TOTAL_TOKENS`` tokens.

Writes into --out what ``engine_bench`` writes (``engine_bench.csv``: its ``max_model_len`` column is
the context length; ``accuracy.json``, ``summary.md``, rewritten as the run goes) and ``logs/``: one
log per engine with everything the engine's processes (scheduler, detokenizer) wrote to stdout/stderr
(their tracebacks included; the log's tail is also copied into the error record). Each engine runs
under a watchdog (``SGLANG_BENCH_ENGINE_TIMEOUT`` s, default 240) and its own try/except; ``--budget``
stops starting new engines. Exit status 0 only when nothing failed and every accuracy pair passed.

``--cpu``: the CPU platform of ``sglang_cpu`` (flydsl on the torch reference; SGLang's triton backend
does not run on CPU, its ``torch_native`` backend does): eager, batch 2, 8 tokens; flydsl and
torch_native at context_length 1024, flydsl at 131072; the accuracy pairs are flydsl at 1024 against
the other two.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from integration_tests.e2e import engine_bench as eb

PAGE = 16
MAX_TOTAL_TOKENS = 262144  # >= one 131072-token request; 64 x (40 + 128) tokens need ~11k
CAPTURE_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64]


def settings(cpu: bool) -> eb.Settings:
    if cpu:
        return eb.Settings(cpu=True, acc_prompts=4, acc_tokens=16, batches=(2,), out_tokens=8, kv_bytes=0,
                           engines=[("flydsl", "eager", 1024, True), ("torch_native", "eager", 1024, True),
                                    ("flydsl", "eager", 131072, True)],
                           extra={"max_total_tokens": 16384})
    engines = [(b, "eager", 1024, True) for b in ("flydsl", "triton")]
    engines += [(b, "graphs", n, False) for n in (1024, 131072) for b in ("flydsl", "triton")]
    engines += [(b, "eager", 131072, False) for b in ("flydsl", "triton")]
    # a subset, e.g. "flydsl:graphs:1024,triton:graphs:1024"
    engines = eb.engines_from_env("SGLANG_BENCH_ENGINES", engines, lambda mode, ctx: mode == "eager" and ctx == 1024)
    # each pair again in the other order (ENGINE_BENCH_ORDER=both, the default; "once" halves the run): at
    # 83fa219 two runs in one order put flydsl at 0.93-0.97x in eager at 1024, where a7ddf6f's host read
    # 1.19-1.29x; an engine took ~30 s on that H100 host, 16 engines ~8 min
    engines = eb.in_both_orders(engines, eb.bench_order("both"))
    return eb.Settings(cpu=False, acc_prompts=16, acc_tokens=64, batches=(16, 64), out_tokens=128, kv_bytes=0,
                       engines=engines, capture_sizes=tuple(CAPTURE_BS), repeats=3,
                       extra={"max_total_tokens": MAX_TOTAL_TOKENS})


class EngineTimeout(Exception):
    benchmark_watchdog = True


class SGLangBench(eb.Bench):
    framework = "SGLang"
    engine_in_process = False  # the scheduler is another process: its GCs are not counted
    title = "tiny Llama, flydsl vs triton"
    ours = "flydsl"
    length_name = "context_length"
    accuracy_setup = "FP8 KV cache (fp8_e4m3), page 16, eager (disable_cuda_graph), radix cache off"

    def engine_kwargs(self, backend, mode, ctx) -> dict:
        kw = dict(model_path=str(self.model_dir), attention_backend=backend, kv_cache_dtype="fp8_e4m3",
                  page_size=PAGE, skip_tokenizer_init=True, dtype="bfloat16", random_seed=0, context_length=ctx,
                  max_running_requests=max(self.s.batches + (self.s.acc_prompts,)), disable_radix_cache=True,
                  max_total_tokens=self.s.extra["max_total_tokens"])
        if self.s.cpu:
            # an idle scheduler otherwise polls at 100% of a core, taken from the HF reference
            kw.update(device="cpu", disable_cuda_graph=True, log_level="warning", sleep_on_idle=True)
        else:
            kw.update(device="cuda", log_level="info")
            if mode == "eager":
                kw.update(disable_cuda_graph=True)
            elif mode == "graphs":
                kw.update(disable_prefill_cuda_graph=True, cuda_graph_bs_decode=list(self.s.capture_sizes))
            else:
                raise ValueError(f"unknown mode {mode!r} (eager, graphs)")
        return kw

    def build(self, backend, mode, ctx):
        import sglang

        from integration_tests.e2e import sglang_cpu

        kw = self.engine_kwargs(backend, mode, ctx)
        eb.log(f"sglang.Engine({', '.join(f'{k}={v!r}' for k, v in kw.items() if k != 'model_path')})")
        # a failing scheduler / detokenizer must not take this process down (SGLang's SIGQUIT handlers
        # kill the whole process tree): raise while starting, stop the request loop afterwards
        llm = sglang.Engine(**kw, custom_sigquit_handler=sglang_cpu.raise_on_sigquit)
        if not sglang_cpu.survive_child_failure(
                llm, lambda: eb.log("SIGQUIT: a process of the engine failed (see its log); stopping requests")):
            eb.log("warning: the engine's SIGQUIT handler could not be replaced (a child failure ends this run)")
        return llm

    def generate(self, llm, prompts, n, logprobs=None):
        sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
        kw = {"return_logprob": True, "top_logprobs_num": logprobs} if logprobs else {}
        outs = llm.generate(input_ids=[list(p) for p in prompts], sampling_params=sp, **kw)
        toks = [list(o["output_ids"]) for o in outs]
        for o, t in zip(outs, toks):
            if len(t) != n:
                raise RuntimeError(f"{len(t)} tokens instead of {n}: {o['meta_info'].get('finish_reason')}")
        lps = []
        if logprobs:
            for o in outs:
                # per position a list of (logprob, token id, text), best first
                top = o["meta_info"]["output_top_logprobs"]
                lps.append([{int(e[1]): (rank, float(e[0])) for rank, e in enumerate(pos or [], 1)} for pos in top])
                if len(lps[-1]) != n or not all(lps[-1]):  # the accuracy rule needs every position's top-N
                    raise RuntimeError(f"top logprobs for {len(lps[-1])} of {n} positions, "
                                       f"{sum(not d for d in lps[-1])} empty")
        return toks, lps

    def close(self, llm):
        clean = False
        try:
            if llm is not None:
                llm.shutdown()
                clean = True
        finally:
            del llm
            _kill_children()  # what a failed start or shutdown left behind
            if not clean:
                _drop_zmq_contexts()
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def engine_scope(self, label):
        """The engine's processes write into ``logs/<label>.log``: this process's file descriptors 1
        and 2 point there while the engine lives (the spawned scheduler and detokenizer inherit them);
        this script's own progress lines still go to the console. A watchdog ends an engine that
        takes longer than ``SGLANG_BENCH_ENGINE_TIMEOUT`` seconds."""
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)
        path = logs / (label.replace(" ", "_") + ".log")
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        console = os.fdopen(os.dup(saved[0]), "w", buffering=1)
        old_stdout = sys.stdout
        timeout = int(os.environ.get("SGLANG_BENCH_ENGINE_TIMEOUT", "240"))
        errors_before = len(self.errors)

        def watchdog(signum, frame):
            raise EngineTimeout(f"{label}: engine watchdog ({timeout} s) fired")

        old_handler = signal.signal(signal.SIGALRM, watchdog)
        with open(path, "ab", buffering=0) as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            sys.stdout = console
            signal.alarm(timeout)
            try:
                yield
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old_handler)
                sys.stdout = old_stdout
                try:
                    sys.stderr.flush()
                except Exception:
                    pass
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
                console.close()
        if len(self.errors) > errors_before:  # the engine's own account of the failure, next to ours
            tail = _tail(path, 80)
            self.errors.append(f"{label}: last lines of {path.relative_to(self.out)}:\n{tail}")
            eb.log(f"{label}: see {path} (tail copied into accuracy.json errors)")


def _kill_children() -> None:
    """End the processes this one started that are still alive (an engine's scheduler and
    detokenizer after a failed start or shutdown; not multiprocessing's resource tracker)."""
    try:
        import psutil
    except ImportError:
        return
    tracker = None
    try:
        from multiprocessing import resource_tracker

        tracker = resource_tracker._resource_tracker._pid
    except Exception:
        pass
    children = [c for c in psutil.Process().children(recursive=True) if c.pid != tracker]
    for c in children:
        try:
            c.kill()
        except psutil.Error:
            pass
    if children:
        psutil.wait_procs(children, timeout=10)
        eb.log(f"ended {len(children)} leftover engine process(es)")


def _drop_zmq_contexts() -> None:
    """Close the ZeroMQ contexts a failed engine left in this process, without lingering: garbage
    collected later, a context whose sockets still hold messages for the dead scheduler blocks in
    ``Context.term`` (seen on CPU: the run stalled there until the watchdog)."""
    try:
        import zmq
    except ImportError:
        return
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Context) and not obj.closed:
            try:
                obj.destroy(linger=0)
            except Exception:
                pass


def _tail(path, n) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(unreadable: {e})"
    return "\n".join(lines[-n:])


def _apply(env: dict) -> None:
    """Apply a platform's environment to this process too (the engine's processes inherit it;
    this process's own platform lookup reads entry points from ``sys.path``)."""
    os.environ.update(env)
    for p in reversed(env["PYTHONPATH"].split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)


def prepare(cpu: bool) -> None:
    d = tempfile.mkdtemp(prefix="sgl_platform_")
    atexit.register(shutil.rmtree, d, ignore_errors=True)  # the test platform's package, for this process's run
    if cpu:
        from integration_tests.e2e import sglang_cpu

        _apply(sglang_cpu.prepare(d))
    else:
        from integration_tests.e2e import sglang_gpu

        _apply(sglang_gpu.prepare(d))
    eb.log(f"SGLang platform {os.environ['SGLANG_PLATFORM']} declared in {d}")


def main(argv=None) -> int:
    t0 = time.perf_counter()
    try:
        return eb.run_main(SGLangBench, settings, prepare, argv, description=__doc__.split("\n\n")[0])
    finally:
        eb.log(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
