"""What a failed server start tells: the key lines of the whole log, and on a GPU where the API server's process
first initialised CUDA (a CUDA context there holds GPU memory the engine core needs); and that the
harness's vLLM API server inspects model classes in a subprocess, as vLLM does, so the inspection's imports cannot
initialise CUDA there (the last test needs vLLM)."""

import os
import subprocess
import sys
import textwrap

import pytest

from integration_tests.e2e.server_process import ROOT, ServerProcess
from integration_tests.e2e.vllm_serve import CUDA_INIT_MARK

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    from integration_tests.e2e.vllm_serve import trace_cuda_init

    def culprit():
        try:
            torch.cuda.current_device()  # initialises CUDA (or fails to, on a CPU build: after the trace)
        except Exception:
            pass

    trace_cuda_init()
    trace_cuda_init()  # twice: still one wrapper
    pid = os.fork()
    if pid == 0:  # a forked child (vLLM's engine core) initialising CUDA is not reported
        culprit()
        os._exit(0)
    os.waitpid(pid, 0)
    sys.stderr.write("after the child\\n")
    sys.stderr.flush()
    if not torch.cuda.is_initialized():
        culprit()
""")


def test_cuda_initialisation_in_the_server_process_names_its_caller():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    before, _, after = proc.stderr.partition("after the child")
    assert CUDA_INIT_MARK not in before, before  # nothing from the forked child
    lines = [line for line in after.splitlines() if CUDA_INIT_MARK in line]
    assert len(lines) == 1, after
    assert "in culprit" in lines[0] and "in current_device" in lines[0], lines[0]


def test_failure_text_shows_key_lines_from_anywhere_in_the_log(tmp_path):
    server = ServerProcess(tmp_path / "server.log")
    server.start([sys.executable, "-c",
                  "print('INFO start'); print('WARNING ... Reasons: CUDA is initialized'); print('x' * 20000); "
                  "print('ValueError: something failed')"], dict(os.environ))
    server.proc.wait(60)
    text = server.failure_text(tail=100)
    keys, _, tail = text.partition("log tail:")
    assert "Reasons: CUDA is initialized" in keys and "ValueError: something failed" in keys, keys
    assert "INFO start" not in text  # neither a key line nor in the tail
    assert tail.strip().endswith("ValueError: something failed")


INSPECT = textwrap.dedent("""
    import os, sys
    from integration_tests.e2e import vllm_gpu
    from vllm.model_executor.models import registry

    vllm_gpu.inspect_models_in_process()  # what prepare() does first
    vllm_gpu.inspect_models_in_subprocess()
    print("pid", os.getpid(), registry._run_in_subprocess(lambda: os.getpid()))
    llama = registry.ModelRegistry.models["LlamaForCausalLM"]
    info = registry._run_in_subprocess(lambda: registry._ModelInfo.from_model_cls(llama.load_model_cls()))
    print("cls", info.supports_pp, "vllm.model_executor.models.llama" in sys.modules)
    registry._SUBPROCESS_COMMAND = [sys.executable, "-c", "raise SystemExit(3)"]  # a failing subprocess
    print("fallback", os.getpid(), registry._run_in_subprocess(lambda: os.getpid()))
""")


def test_serve_inspects_models_in_a_subprocess_with_the_stand_ins():
    """vllm serve's API server on a GPU (vllm_gpu.inspect_models_in_subprocess): a model class is inspected in
    another process, vLLM's entry point with the stand-ins installed (run here on CPU, where they register too);
    when that process fails, in this one, with a line on stderr."""
    pytest.importorskip("vllm")
    from integration_tests.e2e.vllm_gpu import SUBPROCESS_MARK

    proc = subprocess.run([sys.executable, "-c", INSPECT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.split()}
    parent, child = out["pid"]
    assert parent != child  # ran in another process
    assert out["cls"] == ["True", "False"]  # a real inspection came back from it; the model not imported here
    parent, same = out["fallback"]
    assert parent == same and SUBPROCESS_MARK in proc.stderr
