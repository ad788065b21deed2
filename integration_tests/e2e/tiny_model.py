"""A tiny Llama-architecture GQA model built at run time (no download) whose greedy tokens depend
on reading the right K/V.

Seeded random weights are numerically chaotic (bf16 vs fp32 already disagree on many greedy
tokens), so two backends' disagreement would say nothing. This model plants, in layer 0, one
attention head that attends to the token ``COPY_BACK`` positions back (a RoPE-relative pattern
made from a constant feature of every embedding) and copies its identity into the residual
stream; the LM head reads that identity. Greedy decoding therefore repeats the context with
period ``COPY_BACK + 1`` (position m copies token m - COPY_BACK as the next one) by margins of
~100 nats: FP8/bf16 rounding never flips a token, while a K or V read from
the wrong slot does. The other heads and layers hold small seeded random weights (the stack must
still run every layer's attention).

``build(path)`` writes config.json + model.safetensors (Llama: hidden 512, 4 layers, 8 query / 2
KV heads, head_dim 128, vocab 512); prompts are token ids (``skip_tokenizer_init=True``).
``save_tokenizer(path)`` adds a word-level tokenizer (token id i is the word ``w<i>``, ids 0-2 are
``<unk>``, ``<s>``, ``</s>``; no BOS added, decoded words joined by spaces) for servers that need
text: ``as_text(ids)`` / ``from_text(text)`` convert.
``copy_rule_agreement(prompt, generated)``: the fraction of generated tokens that equal the token
COPY_BACK + 1 positions earlier (1.0 when every K/V read was right). ``prompts(n, seed)``: seeded
token-id prompts. References from HF transformers (``LlamaForCausalLM``, eager attention, bf16, on
CPU): ``hf_greedy`` (greedy tokens) and ``hf_argmax_agreement`` (teacher-forced on an engine's own
tokens: the share of positions where HF's argmax is the engine's next token).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VOCAB = 512
HIDDEN = 512
LAYERS = 4
HEADS = 8
KV_HEADS = 2
HEAD_DIM = 128
INTER = 1024
COPY_BACK = 7
ROPE_THETA = 10000.0
CODE = 128  # residual dims 0..127: the token's identity code (random +-1)
CONST = 128  # residual dim 128: constant for every token (drives the planted head's q and k)
COPIED = 256  # residual dims 256..383: the identity code the planted head copies from COPY_BACK back
NOISE = 0.004  # scale of the seeded random weights everywhere else


def config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": ROPE_THETA, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
    }


def weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * NOISE

    codes = torch.where(torch.rand(VOCAB, CODE, generator=g) < 0.5, -1.0, 1.0)
    emb = torch.zeros(VOCAB, HIDDEN)
    emb[:, :CODE] = codes
    emb[:, CONST] = math.sqrt(CODE)
    w = {"model.embed_tokens.weight": emb}
    half = HEAD_DIM // 2
    inv = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD_DIM)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        q, k = rnd(HEADS * HEAD_DIM, HIDDEN), rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        v, o = rnd(KV_HEADS * HEAD_DIM, HIDDEN), rnd(HIDDEN, HEADS * HEAD_DIM)
        if i == 0:
            # query head 0 (KV head 0). RoPE pairs dims (j, j + half) (HF's rotate_half): q = (c, 0) and
            # k = c * (cos a_j, sin a_j) with a_j = COPY_BACK * theta_j per pair, so after rotation
            # q_m . k_n = c^2 * sum_j cos((n - m + COPY_BACK) * theta_j): largest at n = m - COPY_BACK
            c = 0.25
            q[:HEAD_DIM] = 0
            k[:HEAD_DIM] = 0
            ang = (COPY_BACK * inv).float()
            q[:half, CONST] = c
            k[:half, CONST] = c * torch.cos(ang)
            k[half:HEAD_DIM, CONST] = c * torch.sin(ang)
            v[:HEAD_DIM] = 0
            v[:HEAD_DIM, :CODE] = torch.eye(HEAD_DIM)  # V of KV head 0 = the identity code
            o[:, :HEAD_DIM] = 0
            o[COPIED:COPIED + HEAD_DIM, :HEAD_DIM] = torch.eye(HEAD_DIM)  # into the copied-code dims
        w[p + "self_attn.q_proj.weight"] = q
        w[p + "self_attn.k_proj.weight"] = k
        w[p + "self_attn.v_proj.weight"] = v
        w[p + "self_attn.o_proj.weight"] = o
        w[p + "mlp.gate_proj.weight"] = rnd(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rnd(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rnd(HIDDEN, INTER)
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    w["model.norm.weight"] = torch.ones(HIDDEN)
    lm = torch.zeros(VOCAB, HIDDEN)
    lm[:, COPIED:COPIED + CODE] = codes  # logit of v = code(v) . copied code
    w["lm_head.weight"] = lm
    return {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}


def build(path, seed: int = 0) -> Path:
    return write_model(path, config(), weights(seed))


def build_with_tokenizer(path, seed: int = 0) -> Path:
    """``build`` plus ``save_tokenizer``: a model a server can take text requests for."""
    path = build(path, seed)
    save_tokenizer(path)
    return path


def write_model(path, cfg: dict, tensors: dict) -> Path:
    """A model directory an engine loads without a download: config.json, generation_config.json
    (BOS 1, EOS 2) and model.safetensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _vocab() -> dict:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    return vocab


def save_tokenizer(path) -> Path:
    """Write tokenizer.json + tokenizer_config.json (a Hugging Face fast tokenizer) into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=131072)
    fast.save_pretrained(str(path))
    return Path(path)


def as_text(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def from_text(text: str) -> list:
    """Token ids of ``as_text``-style text (``ValueError`` on a word outside the vocabulary)."""
    vocab = _vocab()
    unknown = [w for w in text.split() if w not in vocab]
    if unknown:
        raise ValueError(f"not words of the tiny model's vocabulary: {unknown[:5]}")
    return [vocab[w] for w in text.split()]


def copy_rule_agreement(prompt, generated) -> float:
    seq = list(prompt) + list(generated)
    n0 = len(prompt)
    period = COPY_BACK + 1
    ok = sum(seq[i] == seq[i - period] for i in range(n0, len(seq)))
    return ok / max(len(seq) - n0, 1)


def prompts(n: int, seed: int, length=(10, 40), prefix=()) -> list:
    """``n`` seeded prompts of ``length`` (inclusive range) random token ids (3 .. VOCAB-1) after
    ``prefix``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(length[0], length[1] + 1, (1,), generator=g))
        out.append(list(prefix) + torch.randint(3, VOCAB, (L,), generator=g).tolist())
    return out


def _hf_model(model_dir):
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="eager")
    return m.eval()


def hf_greedy(model_dir, prompts, n: int) -> list:
    m = _hf_model(model_dir)
    res = []
    with torch.no_grad():
        for p in prompts:
            out = m.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
            res.append(out[0, len(p):].tolist())
    return res


def hf_argmax_agreement(model_dir, prompts, generated) -> float:
    """Teacher-forced on the engine's tokens: the share of positions where HF's argmax is the
    engine's next token."""
    m = _hf_model(model_dir)
    ok = total = 0
    with torch.no_grad():
        for p, gen in zip(prompts, generated):
            seq = torch.tensor([list(p) + list(gen)])
            pred = m(seq).logits[0, len(p) - 1:-1].argmax(-1).tolist()
            ok += sum(a == b for a, b in zip(pred, gen))
            total += len(gen)
    return ok / max(total, 1)
