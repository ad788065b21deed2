"""Plugin discovery through the *installed* entry point, in fresh processes, as
``python -m sglang.launch_server`` would do it: the server's argument parser accepts the flydsl
flags and server-arg resolution accepts working combinations and rejects the others with a message
naming a working combination. The YAML launch configs in ``configs/sglang/`` go through the same path
(their model swapped for a tiny local config of the same family).

Models are tiny local ``config.json`` files (no weights are needed to resolve arguments): a Llama
(GQA 4/2, head_dim 64) and a Kimi-Linear (MLA full attention + KDA layers). ``--device cpu`` because
this machine has no GPU; ``--disable-radix-cache`` on Kimi-Linear because SGLang's CPU platform has
no Mamba-state snapshots for its default radix strategy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("sglang")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROBE = HERE / "resolve_probe.py"

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
         "torch_dtype": "bfloat16", "rope_theta": 10000.0}
KIMI_LINEAR = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 256,
               "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
               "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
               "torch_dtype": "bfloat16", "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 32, "v_head_dim": 64, "mla_use_nope": True, "num_experts": 4,
               "num_experts_per_token": 2, "moe_intermediate_size": 128,
               "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 32, "num_heads": 4,
                                      "short_conv_kernel_size": 4}}
EAGLE3 = dict(LLAMA, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=1024)
# a GDN hybrid (linear attention that is not KDA): --linear-attn-decode-backend names its decode kernel too
QWEN3_NEXT = dict(LLAMA, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_hidden_layers=4,
                  full_attention_interval=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                  linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
                  mlp_only_layers=[])
COMMON = ["--device", "cpu", "--skip-tokenizer-init"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, cfg in (("llama", LLAMA), ("kimi", KIMI_LINEAR), ("eagle3", EAGLE3), ("qwen3_next", QWEN3_NEXT)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        out[name] = str(root / name)
    return out


def _probe(cases, env_extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    eps = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.name == "flydsl"]
    assert [ep.value for ep in eps] == ["flydsl_backends.plugins:register_sglang"], \
        "flydsl-backends is not installed in this environment (pip install -e .[sglang])"


def _cases(m):
    llama, kimi = m["llama"], m["kimi"]
    fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
    eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", m["eagle3"]]
    chain = ["--speculative-eagle-topk", "1", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3"]
    return {
        "gqa_page16": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16"], None),
        "gqa_page64_split": (["--model-path", llama, "--decode-attention-backend", "flydsl",
                              "--prefill-attention-backend", "flydsl", *fp8, "--page-size", "64"], None),
        "gqa_split_triton_prefill": (["--model-path", llama, "--decode-attention-backend", "flydsl",
                                      "--prefill-attention-backend", "triton", *fp8, "--page-size", "16"],
                                     "--prefill-attention-backend triton with flydsl on the other path"),
        "gqa_pd_prefill": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                            "--disaggregation-mode", "prefill"], "--disaggregation-mode prefill"),
        "gqa_hicache_storage": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                                 "--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
                                "--hicache-storage-backend file"),
        "gqa_kv_canary": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                           "--kv-canary", "log"], "use --kv-canary none"),
        # two batches in flight on two streams would share the per-GPU split-K workspace
        "gqa_pdmux": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                       "--enable-pdmux", "--chunked-prefill-size", "-1", "--disable-overlap-schedule"],
                      "drop --enable-pdmux"),
        "gqa_page128": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "128"], None),
        "gqa_bf16_kv": (["--model-path", llama, "--attention-backend", "flydsl", "--page-size", "16"],
                        "--kv-cache-dtype fp8_e4m3"),
        "gqa_page32": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "32"],
                       "--page-size 16"),
        "kimi_flydsl_attention": (["--model-path", kimi, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                                   "--disable-radix-cache"], "--linear-attn-decode-backend flydsl"),
        "kimi_mla_plus_flydsl_kda": (["--model-path", kimi, "--attention-backend", "triton",
                                      "--linear-attn-decode-backend", "flydsl", "--disable-radix-cache"], None),
        "kimi_linear_attn_backend": (["--model-path", kimi, "--attention-backend", "triton",
                                      "--linear-attn-backend", "flydsl", "--disable-radix-cache"],
                                     "--linear-attn-decode-backend flydsl"),
        # the KDA op's dtypes: bf16 activations, an fp32 / bf16 state (SGLang accepts float16 for both)
        "kimi_kda_ssm_bf16": (["--model-path", kimi, "--attention-backend", "triton", "--linear-attn-decode-backend",
                               "flydsl", "--mamba-ssm-dtype", "bfloat16", "--disable-radix-cache"], None),
        "kimi_kda_ssm_fp16": (["--model-path", kimi, "--attention-backend", "triton", "--linear-attn-decode-backend",
                               "flydsl", "--mamba-ssm-dtype", "float16", "--disable-radix-cache"],
                              "--mamba-ssm-dtype float32"),
        "kimi_kda_fp16_model": (["--model-path", kimi, "--attention-backend", "triton", "--linear-attn-decode-backend",
                                 "flydsl", "--dtype", "float16", "--disable-radix-cache"], "--dtype bfloat16"),
        # a model without KDA layers: GDN's decode has no flydsl kernel (SGLang would fail at model init)
        "gdn_flydsl_decode": (["--model-path", m["qwen3_next"], "--attention-backend", "triton",
                               "--linear-attn-decode-backend", "flydsl", "--disable-radix-cache"],
                              "leave --linear-attn-decode-backend unset"),
        "gdn_triton_decode": (["--model-path", m["qwen3_next"], "--attention-backend", "triton",
                               "--linear-attn-decode-backend", "triton", "--disable-radix-cache"], None),
        "llama_flydsl_kda": (["--model-path", llama, "--attention-backend", "triton", "--linear-attn-decode-backend",
                              "flydsl"], "leave --linear-attn-decode-backend unset"),
        "gqa_eagle3_chain": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                              *eagle, *chain, "--speculative-draft-attention-backend", "triton"], None),
        "gqa_eagle3_no_draft_backend": (["--model-path", llama, "--attention-backend", "flydsl", *fp8,
                                         "--page-size", "16", *eagle, *chain],
                                        "--speculative-draft-attention-backend triton"),
        "gqa_eagle3_5_tokens": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                                 *eagle, "--speculative-eagle-topk", "1", "--speculative-num-steps", "4",
                                 "--speculative-num-draft-tokens", "5", "--speculative-draft-attention-backend",
                                 "triton"], "--speculative-num-draft-tokens 3"),
        # SGLang's default adaptive tiers verify up to 8 draft tokens at run time
        "gqa_eagle3_adaptive": (["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--page-size", "16",
                                 *eagle, "--speculative-eagle-topk", "1", "--speculative-num-steps", "3",
                                 "--speculative-num-draft-tokens", "4", "--speculative-draft-attention-backend",
                                 "triton", "--speculative-adaptive"], "drop --speculative-adaptive"),
        "k3_config": (["--config", str(ROOT / "configs/sglang/kimi-k3-tp8-mi355x.yaml"), "--model-path", kimi,
                       "--disable-radix-cache"], None),
        "gqa_config": (["--config", str(ROOT / "configs/sglang/llama-3.1-8b-fp8kv.yaml"), "--model-path", llama],
                       None),
    }


def test_flags_parse_and_resolve_through_installed_plugin(models):
    cases = _cases(models)
    out = _probe([argv + COMMON for argv, _ in cases.values()])
    assert out["heavy_modules"] == [], f"resolving arguments imported kernel modules: {out['heavy_modules']}"
    by_name = dict(zip(cases, out["results"]))
    for name, (argv, expect_error) in cases.items():
        r = by_name[name]
        if expect_error is None:
            assert r["ok"], f"{name}: {r['error']}"
        else:
            assert not r["ok"], f"{name} resolved but should have been rejected"
            assert expect_error in r["error"], f"{name}: message does not name {expect_error!r}: {r['error']}"
    a = by_name["gqa_page16"]["args"]
    assert (a["attention_backend"], a["kv_cache_dtype"], a["page_size"]) == ("flydsl", "fp8_e4m3", 16)
    a = by_name["gqa_page64_split"]["args"]
    assert (a["decode_attention_backend"], a["prefill_attention_backend"], a["page_size"]) == ("flydsl", "flydsl", 64)
    assert by_name["kimi_mla_plus_flydsl_kda"]["args"]["linear_attn_decode_backend"] == "flydsl"
    assert "MLA" in by_name["kimi_flydsl_attention"]["error"]
    # the launch configs' own flags survive the merge (the CLI overrides only what the test swaps)
    a = by_name["k3_config"]["args"]
    assert (a["attention_backend"], a["linear_attn_decode_backend"], a["tp_size"]) == ("aiter", "flydsl", 8)
    a = by_name["gqa_config"]["args"]
    assert (a["attention_backend"], a["kv_cache_dtype"], a["page_size"]) == ("flydsl", "fp8_e4m3", 16)


def test_prefill_cuda_graph_is_off_for_flydsl_with_cuda_defaults(models):
    """SGLang turns its breakable prefill CUDA graph on by default on CUDA (the probe applies that default on
    this CPU machine): with flydsl on the prefill path it is turned off at resolution (never run with this
    backend), other backends keep it, and asking for it explicitly is refused naming the flag to drop."""
    llama, fp8 = models["llama"], ["--kv-cache-dtype", "fp8_e4m3", "--page-size", "16"]
    cases = [["--model-path", llama, "--attention-backend", "flydsl", *fp8],
             ["--model-path", llama, "--decode-attention-backend", "flydsl", "--prefill-attention-backend", "flydsl",
              *fp8],
             ["--model-path", llama, "--attention-backend", "triton", *fp8],
             ["--model-path", llama, "--attention-backend", "flydsl", *fp8, "--cuda-graph-backend-prefill",
              "breakable"]]
    out = _probe([argv + COMMON for argv in cases], env_extra={"FLYDSL_PROBE_CUDA_DEFAULTS": "1"})["results"]
    assert [r["args"].get("prefill_graph") for r in out[:3]] == ["disabled", "disabled", "breakable"], out
    assert not out[3]["ok"] and "drop --cuda-graph-backend-prefill" in out[3]["error"], out[3]


def test_without_the_plugin_sglang_rejects_flydsl(models):
    """The control: with the plugin filtered out (SGLANG_PLUGINS names another plugin), SGLang's own
    parser refuses ``flydsl`` — so the acceptance above is the plugin's doing."""
    argv = ["--model-path", models["llama"], "--attention-backend", "flydsl", "--kv-cache-dtype", "fp8_e4m3",
            "--page-size", "16", *COMMON]
    out = _probe([argv], env_extra={"SGLANG_PLUGINS": "not-flydsl"})
    assert out["results"][0] == {"ok": False, "error": "SystemExit(2)", "args": {}}
