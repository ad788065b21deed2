"""Plugin discovery through the *installed* ``vllm.general_plugins`` entry point, in fresh processes, as
``vllm serve`` does it: the CLI (``--attention-backend FLYDSL``, ``CUSTOM``, ``-ac``) and
``create_engine_config`` select the backend; a spawned process that unpickles the config before its
plugins load resolves ``FLYDSL`` and ``CUSTOM``; the backend's
``validate_configuration`` rejects what it cannot serve with the reason. The model is a tiny local
Llama ``config.json`` (no weights needed to build the engine config).

Run: VLLM_TARGET_DEVICE=cpu /work/venv-vllm/bin/python -m pytest -q integration_tests/vllm
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
         "torch_dtype": "bfloat16", "rope_theta": 10000.0}
COMMON = ["--skip-tokenizer-init", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    (d / "config.json").write_text(json.dumps(LLAMA))
    return str(d)


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.update(extra or {})
    return env


def _run(script, *args, extra=None):
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          env=_env(extra), timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    eps = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "flydsl"]
    assert [ep.value for ep in eps] == ["flydsl_backends.plugins:register_vllm"], \
        "flydsl-backends is not installed in this environment (pip install -e .[vllm])"


def test_cli_selects_the_backend(llama, tmp_path):
    fp8 = ["--kv-cache-dtype", "fp8"]
    cases = {
        "flydsl": ["--model", llama, "--attention-backend", "FLYDSL", *fp8, "--block-size", "16"],
        "lowercase": ["--model", llama, "--attention-backend", "flydsl", "--kv-cache-dtype", "fp8_e4m3",
                      "--block-size", "64"],
        "custom": ["--model", llama, "--attention-backend", "CUSTOM", *fp8],
        "ac_json": ["--model", llama, "-ac", '{"backend": "FLYDSL"}', *fp8],
        "gqa_config": ["--model", llama, "--config", str(ROOT / "configs/vllm/llama-3.1-8b-fp8kv.yaml")],
    }
    pkl = tmp_path / "attention_config.pkl"
    out = _run("engine_probe.py", json.dumps([argv + COMMON for argv in cases.values()]), "--pickle", str(pkl))
    assert out["heavy_modules"] == [], f"building the engine config imported kernel modules: {out['heavy_modules']}"
    # vllm serve's parent process: nothing that initialises the GPU at import (a context there holds GPU memory,
    # and under `vllm.LLM` it forces vLLM to spawn its engine core)
    assert out["gpu_at_import"] == [], out["gpu_at_import"]
    by = dict(zip(cases, out["results"]))
    for name, r in by.items():
        assert r["ok"], f"{name}: {r['error']}"
        assert r["path"] == "pa_backend.vllm.FlyDSLAttentionBackend", (name, r)
    flydsl = by["flydsl"]
    assert (flydsl["backend"], flydsl["kv_cache_dtype"], flydsl["block_size"]) == ("FLYDSL", "fp8", 16)
    assert (by["lowercase"]["backend"], by["lowercase"]["block_size"]) == ("FLYDSL", 64)
    assert by["custom"]["backend"] == "CUSTOM" and by["ac_json"]["backend"] == "FLYDSL"
    assert (by["gqa_config"]["backend"], by["gqa_config"]["kv_cache_dtype"], by["gqa_config"]["block_size"]) == \
        ("FLYDSL", "fp8", 16)


def test_k3_launch_config_parses_to_the_documented_flags():
    """The Kimi-K3 config (TP8, MLA on vLLM's backend, the flydsl_kda switch) through vLLM's own --config
    handling; building its engine config needs the real checkpoint and 8 GPUs, so only the flags are
    checked here."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "/path/to/Kimi-K3", "--config",
                              str(ROOT / "configs/vllm/kimi-k3-tp8-mi355x.yaml")])
    assert args.tensor_parallel_size == 8 and args.attention_backend is None
    extra = args.additional_config if isinstance(args.additional_config, dict) else json.loads(args.additional_config)
    assert extra == {"flydsl_kda": True}


def test_without_the_plugin_vllm_rejects_flydsl(llama):
    """The control: with the plugin filtered out (VLLM_PLUGINS names another one) FLYDSL is unknown."""
    out = _run("engine_probe.py", json.dumps([["--model", llama, "--attention-backend", "FLYDSL",
                                               "--kv-cache-dtype", "fp8", *COMMON]]),
               extra={"VLLM_PLUGINS": "not-flydsl"})
    r = out["results"][0]
    assert not r["ok"] and "FLYDSL" in r["error"], r


def _pickled_config(llama, tmp_path, backend):
    pkl = tmp_path / f"{backend}.pkl"
    _run("engine_probe.py", json.dumps([["--model", llama, "--attention-backend", backend, "--kv-cache-dtype", "fp8",
                                         *COMMON]]), "--pickle", str(pkl))
    return pkl


def test_spawned_process_resolves_custom(llama, tmp_path):
    out = _run("unpickle_probe.py", str(_pickled_config(llama, tmp_path, "CUSTOM")))
    assert out == {"unpickled": "CUSTOM", "class": "pa_backend.vllm.FlyDSLAttentionBackend", "name": "FLYDSL"}


def test_spawned_process_unpickles_flydsl(llama, tmp_path):
    """`vllm serve`'s CLI spawns the engine core by default, which unpickles the config before its plugins
    load: the plugin's FLYDSL member pickles as a call that adds it there first (vLLM's own dynamic
    members fail with "... is not a valid AttentionBackendEnum"), and it pickles on from there."""
    out = _run("unpickle_probe.py", str(_pickled_config(llama, tmp_path, "FLYDSL")))
    assert out == {"unpickled": "FLYDSL", "class": "pa_backend.vllm.FlyDSLAttentionBackend", "name": "FLYDSL",
                   "pickles_on": "FLYDSL"}, out


# --------------------------------------------------------------------------------------------
# validate_configuration, in this process (the plugin registered here as vLLM would)


@pytest.fixture(scope="module")
def backend():
    from flydsl_backends.plugins import register_vllm

    register_vllm()
    register_vllm()  # idempotent
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum["FLYDSL"].get_class()
    assert cls is AttentionBackendEnum.CUSTOM.get_class()
    return cls


def _validate(cls, **over):
    import torch
    from vllm.platforms.interface import DeviceCapability

    kw = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=16, use_mla=False, has_sink=False,
              use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
              device_capability=DeviceCapability(9, 0), attn_type="decoder")
    kw.update(over)
    return cls.validate_configuration(**kw)


@pytest.mark.parametrize("over", [{}, dict(head_size=64), dict(head_size=256), dict(block_size=64),
                                  dict(block_size=128), dict(block_size=32), dict(block_size=48), dict(block_size=112),
                                  dict(kv_cache_dtype="fp8_e4m3"), dict(has_sink=True),
                                  dict(has_sliding_window=True), dict(dtype="float16")])
def test_validate_accepts(backend, over):
    import torch

    if over.get("dtype") == "float16":
        over = dict(over, dtype=torch.float16)
    assert _validate(backend, **over) == []


@pytest.mark.parametrize("over, needle", [
    (dict(head_size=80), "head sizes"),
    (dict(head_size=96), "head_size not supported"),
    (dict(kv_cache_dtype="auto"), "--kv-cache-dtype fp8"),
    (dict(kv_cache_dtype="fp8_e5m2"), "--kv-cache-dtype fp8"),
    (dict(block_size=144), "--block-size 16"),
    (dict(block_size=40), "--block-size 16"),
    (dict(block_size=8), "block_size not supported"),
    (dict(use_mla=True), "MLA not supported"),
    (dict(attn_type="encoder"), "attention type encoder not supported"),
    (dict(use_kv_connector=True), "KV connector not supported"),
    (dict(use_per_head_quant_scales=True), "per-head quant scales"),
    (dict(use_dcp=True), "DCP not supported"),
    # the plan is made from the host's query offsets; drafts trimmed on the device would not match it
    (dict(use_adaptive_verification=True), "adaptive verification"),
])
def test_validate_rejects_with_reason(backend, over, needle):
    import torch

    if over.get("dtype") == "float32":
        over = dict(over, dtype=torch.float32)
    reasons = _validate(backend, **over)
    assert reasons and any(needle in r for r in reasons), reasons


def test_validate_rejects_fp32(backend):
    import torch

    assert "dtype not supported" in _validate(backend, dtype=torch.float32)
