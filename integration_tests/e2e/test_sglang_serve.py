"""``python -m sglang.launch_server --attention-backend flydsl`` (SGLang 0.5.23's HTTP server) with an
FP8 KV cache (issue 16), on CPU (CI) or on an NVIDIA GPU (``benchmarks/device_run.sh serve-sglang``).

The server runs as a subprocess on the run-time model of ``tiny_model`` with its word-level
tokenizer, on a test-side platform declared through SGLang's platform entry-point group (the
server's scheduler and detokenizer processes find it too): ``sglang_cpu``'s CPU platform, or on a
GPU ``sglang_gpu``'s CUDA platform without sgl_kernel; eager (no CUDA graphs, so every decode is
traced). One ``/generate`` request (two text prompts, greedy) goes through the HTTP front end, the
tokenizer, the scheduler and the detokenizer; the answer must follow the model's copy rule and equal
HF transformers' greedy tokens, and the scheduler's attention trace and log must show the flydsl
backend's paged attention running (the torch reference on CPU, the Triton kernels on a GPU).
SIGTERM to the server process then has to stop it and its children.

About 40 s on 2 cores. ``FLYDSL_E2E_SKIP_SERVE=1`` skips it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

from integration_tests.e2e import sglang_cpu  # noqa: E402

sglang_cpu.skip_without_engine()
for _mod in ("jsonschema", "soundfile", "multipart", "uvicorn", "fastapi"):  # what launch_server adds
    pytest.importorskip(_mod,
                        reason=f"{_mod} missing: build the venv with integration_tests/setup-cpu-env.sh sglang DIR")
from integration_tests.e2e import tiny_model as tm  # noqa: E402
from integration_tests.e2e.server_process import STOP_TIMEOUT_S, ServerProcess, expected_impl, get, on_cuda, post  # noqa: E402

NEW_TOKENS = 12
pytestmark = pytest.mark.skipif(os.environ.get("FLYDSL_E2E_SKIP_SERVE") == "1",
                                reason="FLYDSL_E2E_SKIP_SERVE=1")


class Server(ServerProcess):
    def __init__(self, model_dir: Path, workdir: Path):
        super().__init__(workdir / "server.log")
        self.trace = workdir / "attention.jsonl"
        if on_cuda():
            from integration_tests.e2e import sglang_gpu

            platform_env, device = sglang_gpu.prepare(workdir / "platform"), "cuda"
        else:
            platform_env, device = sglang_cpu.prepare(workdir / "platform"), "cpu"
        env = dict(os.environ, **platform_env, **{sglang_cpu.TRACE_ENV: str(self.trace)})
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
               "--host", "127.0.0.1", "--port", str(self.port),
               "--attention-backend", "flydsl", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "16",
               "--device", device, "--dtype", "bfloat16", "--disable-cuda-graph", "--max-total-tokens", "4096",
               "--max-running-requests", "8", "--random-seed", "0",
               "--sleep-on-idle"]  # an idle scheduler otherwise polls at 100% of a core
        self.start(cmd, env)

    def stop(self):
        """SIGTERM to the server process only (it shuts its children down itself), then SIGKILL to
        whatever is left in the group after STOP_TIMEOUT_S. Returns (exit status, whether the group
        was gone before the SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 15
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        clean = not self.group_alive()
        if not clean:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()
        return self.proc.returncode, clean


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.build_with_tokenizer(tmp_path_factory.mktemp("tiny_llama_sgl_serve"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("sgl_serve"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None or srv.group_alive():
            srv.stop()


def test_generate_follows_the_kv_and_matches_hf(server, model_dir):
    info = json.loads(get(server.base + "/server_info")[1])
    assert info.get("attention_backend") == "flydsl", {k: info.get(k) for k in ("attention_backend", "device")}
    assert info.get("kv_cache_dtype") == "fp8_e4m3"

    server.trace.write_text("")  # the server's own warm-up request is not counted
    prompts = tm.prompts(2, seed=11, length=(12, 30))
    out = post(server.base + "/generate", {
        "text": [tm.as_text(p) for p in prompts],
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    assert len(out) == 2
    gen = []
    for p, o in zip(prompts, out):
        assert o["meta_info"]["finish_reason"]["type"] == "length", o["meta_info"]
        assert o["meta_info"]["prompt_tokens"] == len(p)  # the tokenizer: no BOS, word i -> id i
        ids = o["output_ids"]
        assert tm.from_text(o["text"]) == ids  # the detokenized text says the same as the ids
        assert tm.copy_rule_agreement(p, ids) == 1.0, (p, ids)
        gen.append(ids)
    assert gen == tm.hf_greedy(model_dir, prompts, NEW_TOKENS)

    calls = sglang_cpu.read_trace(server.trace)
    assert any(c["decode"] for c in calls) and any(not c["decode"] for c in calls), calls[:4]
    assert {c["kv_dtype"] for c in calls} == {"torch.float8_e4m3fn"}
    assert server.proc.pid not in {c["pid"] for c in calls}  # the scheduler process ran them
    log = server.log_text()
    # the scheduler's paged-attention calls went through this project's registry (torch on CPU, the Triton
    # kernels on a GPU)
    impl = expected_impl()
    for op in ("write_kv", "pa_prefill", "pa_decode"):
        assert f"{op}: backend='auto' chose '{impl}'" in log, log[-4000:]


def test_sigterm_stops_the_server(server):
    status, clean = server.stop()
    log = server.log_text()
    assert clean, f"processes of the server's group outlived SIGTERM by {STOP_TIMEOUT_S} s:\n{log[-4000:]}"
    assert status == 0, f"exit status {status}:\n{log[-4000:]}"
    assert "Application shutdown complete" in log
    with pytest.raises((urllib.error.URLError, OSError)):
        get(server.base + "/health", timeout=2.0)
