"""Real vLLM 0.33.0 objects for the FLYDSL attention backend tests: a VllmConfig on a tiny local Llama, the
backend's customized FullAttentionSpec, KV caches allocated by vLLM's own ``allocate_kv_cache`` in a given
layout, CommonAttentionMetadata batches with a random block permutation (block 0 = the null block, never
assigned), and an independent SDPA reference over the dequantized K/V."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Sequence

import torch

HQ, HKV, D = 4, 2, 64
FP8 = torch.float8_e4m3fn
SENTINEL_BYTE = 0x7E  # 448.0 in e4m3fn: an unused slot read by mistake shows up


def tiny_llama_dir(tmp, head_dim=D, num_heads=HQ, num_kv_heads=HKV):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": num_heads * head_dim,
           "intermediate_size": 512, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
           "head_dim": head_dim, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "rope_theta": 10000.0}
    (tmp / "config.json").write_text(json.dumps(cfg))
    return str(tmp)


def vllm_config(model_dir, block_size=16, full_graphs=False, max_num_seqs=8):
    from vllm.config import CacheConfig, CUDAGraphMode, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
                     enforce_eager=not full_graphs)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block_size, cache_dtype="fp8"),
                    scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=1024,
                                                     is_encoder_decoder=False))
    if full_graphs:
        vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    return vc


def backend_spec(block_size=16, num_kv_heads=HKV, head_size=D, page_size_padded=None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode
    from vllm.v1.worker.utils import customize_attention_spec

    import pa_backend.vllm as pav

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    spec = customize_attention_spec(pav.FlyDSLAttentionBackend, spec)
    if page_size_padded is not None:
        from dataclasses import replace

        spec = replace(spec, page_size_padded=page_size_padded)
    return spec


def allocate(spec, num_blocks, layer_names, layout_name="LBHNC", device="cpu"):
    """vLLM's own allocation path: KVCacheConfig -> allocate_kv_cache -> one [B, 2, N, Hkv*D] view per
    layer in ``layout_name``. Every byte starts as the sentinel."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    L = len(layer_names)
    # as vLLM's planner does (kv_cache_planning): a padded page fixes the block stride
    fixed = spec.page_size_bytes if spec.page_size_padded is not None else None
    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, num_blocks, L, layout,
                                                                 fixed_strides=(None, fixed, None, None, None))
    t = KVCacheTensor(size=spec.page_size_bytes * num_blocks * L, layers=list(layer_names),
                      layer_stride=layer_stride, block_stride=block_stride)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[t],
                        kv_cache_groups=[KVCacheGroupSpec(list(layer_names), spec)])
    caches = allocate_kv_cache(cfg, torch.device(device), layout)
    for v in caches.values():
        v.view(torch.uint8).fill_(SENTINEL_BYTE)
    return caches


@dataclass
class Batch:
    prefix_lens: Sequence[int]  # tokens already cached
    query_lens: Sequence[int]  # new tokens this step
    block_size: int
    num_blocks: int
    seed: int = 0
    pad_reqs: int = 0  # CUDA-graph padding requests (query 0, seq 0, null block row, slots -1)

    @property
    def seq_lens(self):
        return [p + q for p, q in zip(self.prefix_lens, self.query_lens)]


def block_rows(b: Batch, max_blocks: int) -> List[List[int]]:
    """Per request a random distinct set of blocks out of 1..num_blocks-1 (block 0 is vLLM's null block)."""
    rng = random.Random(500 + b.seed)
    pool = list(range(1, b.num_blocks))
    rng.shuffle(pool)
    out, at = [], 0
    for s in b.seq_lens:
        n = -(-s // b.block_size)
        out.append(pool[at:at + n] + [0] * (max_blocks - n))
        at += n
    if at > len(pool):
        raise ValueError("batch needs more blocks than the cache has")
    return out


def slots_of(rows, b: Batch, r: int, positions):
    return [rows[r][p // b.block_size] * b.block_size + p % b.block_size for p in positions]


def common_metadata(b: Batch, rows, device="cpu"):
    """A real CommonAttentionMetadata of this step (the runner's conventions for padded requests)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qs = list(b.query_lens) + [0] * b.pad_reqs
    seq = b.seq_lens + [0] * b.pad_reqs
    qsl = [0]
    for q in qs:
        qsl.append(qsl[-1] + q)
    max_blocks = len(rows[0])
    bt = rows + [[0] * max_blocks] * b.pad_reqs
    slots = []
    for r, (p, q) in enumerate(zip(b.prefix_lens, b.query_lens)):
        slots += slots_of(rows, b, r, range(p, p + q))
    num_tokens = qsl[-1]
    pad_tokens = b.pad_reqs * (max(b.query_lens) if b.pad_reqs else 0)
    slots += [-1] * pad_tokens
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t.to(device), query_start_loc_cpu=qsl_t,
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device), num_reqs=len(qs),
        num_actual_tokens=num_tokens + pad_tokens, max_query_len=max(qs), max_seq_len=max(seq),
        block_table_tensor=torch.tensor(bt, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), causal=True,
        seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32))


def quantized(x: torch.Tensor, scale: float, fp8=FP8) -> torch.Tensor:
    """What a per-tensor FP8 cache returns for x: fp8(x / scale) * scale (fp32)."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(fp8).float() * scale


def sdpa_reference(q, k_all, v_all, b: Batch, scale, *, k_scale=1.0, v_scale=1.0, sliding_window=0, sinks=None):
    """Independent reference: per request, causal fp32 attention over the dequantized K/V of all its
    tokens (k_all/v_all: list per request of [seq_len, Hkv, D]); q: [T, Hq, D]. Returns [T, Hq, D] fp32."""
    outs, t0 = [], 0
    for r, (p, n) in enumerate(zip(b.prefix_lens, b.query_lens)):
        K = quantized(k_all[r], k_scale).repeat_interleave(HQ // HKV, dim=1)
        V = quantized(v_all[r], v_scale).repeat_interleave(HQ // HKV, dim=1)
        for i in range(n):
            pos = p + i
            lo = max(0, pos - sliding_window + 1) if sliding_window else 0
            s = torch.einsum("hd,khd->hk", q[t0 + i].float(), K[lo:pos + 1]) * scale
            if sinks is not None:
                s = torch.cat([s, sinks.float()[:, None]], dim=1)
            pr = torch.softmax(s, dim=-1)[:, :pos + 1 - lo]
            outs.append(torch.einsum("hk,khd->hd", pr, V[lo:pos + 1]))
        t0 += n
    return torch.stack(outs)


def layer_with_scales(k_scale=1.0, v_scale=1.0, device="cpu"):
    return SimpleNamespace(_k_scale=torch.tensor(k_scale, dtype=torch.float32, device=device),
                           _v_scale=torch.tensor(v_scale, dtype=torch.float32, device=device))


def make_impl(sliding_window=None, sinks=None, pa_impl="torch"):
    import pa_backend.vllm as pav

    impl = pav.FlyDSLAttentionImpl(HQ, D, D ** -0.5, HKV, None, sliding_window, "fp8", None, "decoder", None,
                                   sinks=sinks)
    impl.pa_impl = pa_impl
    return impl


def write_prefix(impl, layer, kv, b: Batch, rows, k_all, v_all, device="cpu"):
    """Put every request's prefix tokens in the cache through the impl's own do_kv_cache_update."""
    ks, vs, sl = [], [], []
    for r, p in enumerate(b.prefix_lens):
        if p:
            ks.append(k_all[r][:p])
            vs.append(v_all[r][:p])
            sl += slots_of(rows, b, r, range(p))
    if sl:
        impl.do_kv_cache_update(layer, torch.cat(ks).to(device), torch.cat(vs).to(device), kv,
                                torch.tensor(sl, dtype=torch.int64, device=device))


def random_kv(b: Batch, generator):
    k_all = [torch.randn(s, HKV, D, generator=generator).bfloat16() for s in b.seq_lens]
    v_all = [torch.randn(s, HKV, D, generator=generator).bfloat16() for s in b.seq_lens]
    return k_all, v_all


def new_tokens(b: Batch, k_all, v_all):
    k = torch.cat([k_all[r][p:p + n] for r, (p, n) in enumerate(zip(b.prefix_lens, b.query_lens))])
    v = torch.cat([v_all[r][p:p + n] for r, (p, n) in enumerate(zip(b.prefix_lens, b.query_lens))])
    return k, v


def live_slots(b: Batch, rows) -> List[int]:
    return sorted(s for r, seq in enumerate(b.seq_lens) for s in slots_of(rows, b, r, range(seq)))


def slot_bytes(kv, block_size):
    """[num_blocks * block_size, 2 * Hkv * D] bytes per slot (K page bytes | V page bytes), from the layer view."""
    import pa_backend.vllm as pav

    kc, vc = pav.kv_cache_views(kv, HKV, D, FP8)
    k = kc.view(torch.uint8).permute(0, 3, 1, 2, 4).reshape(kc.shape[0] * block_size, -1)
    nb, H, P16, DD, X = vc.shape
    v = vc.view(torch.uint8).permute(0, 2, 4, 1, 3).reshape(nb * P16 * X, H * DD)
    return torch.cat([k, v], dim=1)

