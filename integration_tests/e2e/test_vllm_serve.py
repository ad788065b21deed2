"""``vllm serve`` (vLLM 0.33's OpenAI API server) with the flydsl backend and an FP8 KV cache (issue 16
item 1), on CPU (CI) or on an NVIDIA GPU (``benchmarks/device_run.sh serve-vllm``), with the backend named
as a user names it: ``--attention-backend FLYDSL``. vLLM's CLI spawns the engine core (by default), which
unpickles the config before its plugins load (the plugin's member survives that:
``flydsl_backends.plugins.vllm_flydsl_member``). On a GPU the log is also checked for CUDA initialised in
the API server's process (the plugin once did that at import).

The server runs as a subprocess (``python -m integration_tests.e2e.vllm_serve``: ``vllm serve``'s
own command line, plus the extension stand-ins in the API-server and engine-core processes: the
CPU ones of ``vllm_cpu``, or on a GPU those of ``vllm_gpu`` with its native-op engine arguments) for
the run-time model of ``tiny_model`` with its word-level tokenizer, eager. One ``/v1/completions``
request (two prompts, greedy) goes through the HTTP front end, the tokenizer, the engine core and
back; the answer must follow the model's copy rule and equal HF transformers' greedy tokens, and the
server log must show the FLYDSL backend's paged-attention path running in the engine core (the torch
reference on CPU, the Triton kernels on a GPU). SIGTERM then has to shut the server down with exit
status 0.

About 55 s on 2 cores (the server starts in ~30 s). ``FLYDSL_E2E_SKIP_SERVE=1`` skips it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest

pytest.importorskip("vllm")
for _mod in ("uvicorn", "fastapi", "model_hosting_container_standards", "prometheus_fastapi_instrumentator"):
    pytest.importorskip(_mod, reason=f"{_mod} missing: build the venv with integration_tests/setup-cpu-env.sh vllm DIR")

from integration_tests.e2e import tiny_model as tm  # noqa: E402
from integration_tests.e2e.server_process import ROOT, STOP_TIMEOUT_S, ServerProcess, expected_impl, get, on_cuda, post  # noqa: E402

NEW_TOKENS = 12
pytestmark = pytest.mark.skipif(os.environ.get("FLYDSL_E2E_SKIP_SERVE") == "1",
                                reason="FLYDSL_E2E_SKIP_SERVE=1")


class Server(ServerProcess):
    def __init__(self, model_dir: Path, log_path: Path):
        super().__init__(log_path)
        self.model = str(model_dir)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        if on_cuda():
            from integration_tests.e2e import vllm_gpu

            vllm_gpu.prepare()  # this process reads vLLM's config classes (serve_args): the CUDA platform's imports
            # the engine core in its own process, as vllm serve runs it (vllm_gpu.ENV keeps it in process)
            env.update(FLYDSL_E2E_CUDA="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
            device_args = vllm_gpu.serve_args("eager")
        else:
            env.update(VLLM_TARGET_DEVICE="cpu")
            device_args = ["--enforce-eager", "-cc", '{"custom_ops": ["none"]}']
        cmd = [sys.executable, "-m", "integration_tests.e2e.vllm_serve", self.model,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--attention-backend", "FLYDSL",
               "--kv-cache-dtype", "fp8", "--block-size", "16",
               "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "8",
               "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0", *device_args]
        self.start(cmd, env)

    def stop(self) -> int:
        """SIGTERM to the group, then SIGKILL after STOP_TIMEOUT_S; returns the server's exit status
        (that of the SIGTERM)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                self.log.close()
                return -9999
        try:  # anything left in the group (the engine core) after the server exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.build_with_tokenizer(tmp_path_factory.mktemp("tiny_llama_serve"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("serve_log") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_completions_follow_the_kv_and_match_hf(server, model_dir):
    models = json.loads(get(server.base + "/v1/models")[1])
    assert [m["id"] for m in models["data"]] == [server.model]

    prompts = tm.prompts(2, seed=11, length=(12, 30))
    out = post(server.base + "/v1/completions", {
        "model": server.model, "prompt": [tm.as_text(p) for p in prompts], "max_tokens": NEW_TOKENS,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    assert out["usage"]["completion_tokens"] == 2 * NEW_TOKENS
    gen = []
    for p, c in zip(prompts, choices):
        assert c["finish_reason"] == "length", c
        assert c["prompt_token_ids"] == p  # the tokenizer: no BOS, word i -> id i
        ids = tm.from_text(c["text"])  # the detokenized text says the same as the ids
        assert ids == c["token_ids"], c
        assert tm.copy_rule_agreement(p, ids) == 1.0, (p, ids)
        gen.append(ids)
    assert gen == tm.hf_greedy(model_dir, prompts, NEW_TOKENS)

    log = server.log_text()
    assert "flydsl-backends: vLLM plugin registered" in log
    # the engine core's paged-attention calls went through this project's registry (torch on CPU, the Triton
    # kernels on a GPU)
    impl = expected_impl()
    assert re.search(rf"\(EngineCore[^)]*\) INFO flydsl_backends: pa_(decode|prefill): backend='auto' chose '{impl}'",
                     log), log[-4000:]
    if on_cuda():
        # nothing in the API server's process initialised CUDA (the plugin once did, by importing a KDA layer
        # module; a CUDA context there holds GPU memory the engine core needs): vllm_serve.trace_cuda_init
        # names the caller
        assert "Reasons: CUDA is initialized" not in log and "flydsl-e2e: CUDA initialised" not in log, \
            server.failure_text(2000)


def test_sigterm_shuts_down_cleanly(server):
    status = server.stop()
    log = server.log_text()
    assert status == 0, f"exit status {status}:\n{log[-4000:]}"
    assert "Application shutdown complete" in log
    with pytest.raises((urllib.error.URLError, OSError)):
        get(server.base + "/health", timeout=2.0)
