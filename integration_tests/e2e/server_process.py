"""A framework's OpenAI/HTTP server as a subprocess for the serve tests (``test_vllm_serve.py``,
``test_sglang_serve.py``): a free port, JSON over ``urllib``, start in its own session (so teardown
reaches the server's whole process group), wait for ``/health``, and the log for failure messages.
How a server is stopped differs per framework and stays in each test."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 60


def on_cuda() -> bool:
    """Whether the server runs on the GPU (the test's CUDA form) rather than the CPU platform."""
    import torch

    return torch.cuda.is_available()


def expected_impl() -> str:
    """The paged-attention implementation the server's registry picks: the Triton kernels on a GPU, the
    torch reference on CPU (the log line the serve tests look for)."""
    return "triton" if on_cuda() else "torch"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def post(url, body, timeout=120.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class ServerProcess:
    """``cmd`` (with ``{port}`` filled in by the caller from ``self.port``) run from the repository root
    with ``env``, stdout and stderr to ``log_path``."""

    def __init__(self, log_path: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log = None
        self.proc = None

    def start(self, cmd, env) -> None:
        self.log = open(self.log_path, "wb")
        # its own session: teardown can reach the whole group (server and the processes it starts)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    # log lines that explain a failed start wherever they are in the log (the tail alone may miss them):
    # why vLLM spawned a process, where CUDA was first initialised (vllm_serve.trace_cuda_init), the
    # exceptions' last lines
    KEY_LINES = re.compile(r"Reasons:|flydsl-e2e:|^\S*(Error|Exception)\b.*:")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def failure_text(self, tail: int = 6000) -> str:
        """The log's key lines (``KEY_LINES``, at most 30), then its last ``tail`` characters."""
        text = self.log_text()
        keys = [line[:3000] for line in text.splitlines() if self.KEY_LINES.search(line)][:30]
        return ("key lines:\n" + "\n".join(keys) + "\n\nlog tail:\n" if keys else "") + text[-tail:]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before it was ready:\n"
                            f"{self.failure_text()}")
            try:
                if get(self.base + "/health")[0] == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        pytest.fail(f"server not ready after {timeout} s:\n{self.failure_text()}")

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
