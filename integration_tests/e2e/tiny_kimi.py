"""A tiny Kimi-Linear model (``KimiLinearForCausalLM``: KDA linear-attention layers + one MLA layer,
dense MLP) built at run time with seeded random weights (no download).

``build(path)`` writes config.json (vLLM's ``KimiLinearConfig`` fields, ``model_type`` "kimi_linear")
and model.safetensors with the checkpoint's per-projection names (``q_proj`` / ``k_proj`` / ``v_proj``
/ ``b_proj`` / ``f_a_proj`` and ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, which vLLM's loader
packs into ``in_proj_qkvgfab`` and ``conv1d``; ``gate_proj`` / ``up_proj``).

Sizes: hidden 256, 4 layers (1-3 KDA, 4 MLA), KDA 2 heads x head_dim 64 (P = 128, conv width 4),
MLA 2 heads, NoPE (``mla_use_nope``), kv_lora_rank 512 + rope 64 = 576 (the only latent width the
CPU MLA backend accepts), qk_nope / v head dim 64, MLP 512, vocab 512. Weights are scaled so that
activations stay O(1) and logits spread over several nats (the KDA layers' output is a sizeable
part of the residual stream); they are random, so the model's tokens mean nothing: compare two
runs of the same weights and dtype. Prompts are token ids (``skip_tokenizer_init=True``).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
HIDDEN = 256
LAYERS = 4
KDA_LAYERS = (1, 2, 3)  # 1-based, as in linear_attn_config
MLA_LAYERS = (4,)
KDA_HEADS = 2
KDA_HEAD_DIM = 64
CONV = 4
MLA_HEADS = 2
KV_LORA = 512
ROPE = 64
NOPE = 64
V_DIM = 64
INTER = 512


def config() -> dict:
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": MLA_HEADS, "num_key_value_heads": MLA_HEADS, "head_dim": KDA_HEAD_DIM,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "q_lora_rank": None, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
        "v_head_dim": V_DIM, "mla_use_nope": True,
        "linear_attn_config": {"kda_layers": list(KDA_LAYERS), "full_attn_layers": list(MLA_LAYERS),
                               "head_dim": KDA_HEAD_DIM, "num_heads": KDA_HEADS, "short_conv_kernel_size": CONV},
    }


def weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def lin(out_f, in_f, gain=1.0):
        return torch.randn(out_f, in_f, generator=g) * (gain / in_f ** 0.5)

    P = KDA_HEADS * KDA_HEAD_DIM
    w = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
         "model.norm.weight": torch.ones(HIDDEN),
         "lm_head.weight": lin(VOCAB, HIDDEN, 3.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "mlp.gate_proj.weight"] = lin(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = lin(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTER, 0.5)
        if i + 1 in KDA_LAYERS:
            for n in ("q", "k", "v"):
                w[a + f"{n}_proj.weight"] = lin(P, HIDDEN)
                w[a + f"{n}_conv1d.weight"] = torch.randn(P, 1, CONV, generator=g) * 0.6
            w[a + "b_proj.weight"] = lin(KDA_HEADS, HIDDEN)
            w[a + "f_a_proj.weight"] = lin(KDA_HEAD_DIM, HIDDEN)
            w[a + "f_b_proj.weight"] = lin(P, KDA_HEAD_DIM)
            w[a + "g_a_proj.weight"] = lin(KDA_HEAD_DIM, HIDDEN)
            w[a + "g_b_proj.weight"] = lin(P, KDA_HEAD_DIM)
            w[a + "A_log"] = torch.log(torch.rand(KDA_HEADS, generator=g) * 3 + 0.5)
            w[a + "dt_bias"] = torch.randn(P, generator=g) * 0.5
            w[a + "o_norm.weight"] = torch.ones(KDA_HEAD_DIM)
            w[a + "o_proj.weight"] = lin(HIDDEN, P, 2.0)
        else:
            w[a + "q_proj.weight"] = lin(MLA_HEADS * (NOPE + ROPE), HIDDEN)
            w[a + "kv_a_proj_with_mqa.weight"] = lin(KV_LORA + ROPE, HIDDEN)
            w[a + "kv_a_layernorm.weight"] = torch.ones(KV_LORA)
            w[a + "kv_b_proj.weight"] = lin(MLA_HEADS * (NOPE + V_DIM), KV_LORA)
            w[a + "o_proj.weight"] = lin(HIDDEN, MLA_HEADS * V_DIM, 2.0)
    return {k: v.contiguous().float() for k, v in w.items()}


def build(path, seed: int = 0) -> Path:
    from integration_tests.e2e.tiny_model import write_model

    return write_model(path, config(), weights(seed))


def prompts(n: int, seed: int, length=(10, 40)) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        m = int(torch.randint(length[0], length[1] + 1, (1,), generator=g))
        out.append([int(t) for t in torch.randint(3, VOCAB, (m,), generator=g)])
    return out
