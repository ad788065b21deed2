"""What a failed server start tells (no framework needed): the key lines of the whole log, and on a GPU
where the API server's process first initialised CUDA (the cause of a spawned vLLM engine core, which
cannot unpickle FLYDSL)."""

import os
import subprocess
import sys
import textwrap

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
