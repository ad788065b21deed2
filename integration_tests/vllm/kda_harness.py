"""Harness for the KDA layer hook (``kda_backend.vllm``) against real vLLM 0.33.0 objects.

Built for real: ``ModelConfig`` (a tiny Llama directory: only ``dtype`` matters to the KDA layer),
``VllmConfig`` with ``additional_config``, a gloo world of size 1 (``init_distributed_environment`` +
``initialize_model_parallel``), ``KimiGatedDeltaNetAttention`` from a tiny ``KimiLinearConfig``
(through ``PluggableLayer.__new__``, so our subclass when the hook is registered), its ``MambaSpec``
(``get_kv_cache_spec``), the page buffer bound with ``MambaBase.bind_kv_cache`` (page-strided conv /
recurrent views, pages padded past the state bytes), ``GDNAttentionMetadataBuilder.build`` on a
``CommonAttentionMetadata`` (padded decode batch with null block 0 rows, or a mixed batch), and
``set_forward_context``. For Kimi-K3 (``k3=True``): ROCm's real ``KimiK3DeltaAttention`` and its
``KimiK3ROCmKDAMetadataBuilder`` (decode batches only; its prefill chunk metadata is a Triton kernel).

Not real: vLLM's Triton kernels (``causal_conv1d_update``, ``fused_recurrent_kda_packed_decode``,
the prefill kernels) do not run on CPU (vLLM disables Triton there), so vLLM's own ``_forward`` is
never executed on CPU: tests replace it by a recorder to see that it is called. The expected
output is :func:`expected_decode` (float64, written from the notes' §3.3 math, independent of
``kda_backend``).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

SENTINEL = 1e30
H_DEFAULT, D_DEFAULT, W_DEFAULT = 2, 32, 4
PREFIX = "model.layers.0.self_attn"

_dist_ready = False
_model_dir: Optional[str] = None
_model_config = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_config():
    """A real ``ModelConfig`` (tiny Llama directory, bf16, offline); built once per process."""
    global _model_dir, _model_config
    if _model_config is None:
        from vllm.config import ModelConfig

        _model_dir = tempfile.mkdtemp(prefix="kda-vllm-model-")
        with open(os.path.join(_model_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                       "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
                       "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 2048,
                       "torch_dtype": "bfloat16"}, f)
        _model_config = ModelConfig(model=_model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048,
                                    enforce_eager=True)
    return _model_config


def make_vllm_config(additional_config: Optional[dict] = None, *, full_cudagraph: bool = False, max_num_seqs: int = 16):
    """A real ``VllmConfig``; ``full_cudagraph`` sets FULL_DECODE_ONLY afterwards (the CPU platform
    forces NONE) so the builder stages decode metadata into its persistent buffers."""
    from vllm.config import CacheConfig, CUDAGraphMode, SchedulerConfig, VllmConfig

    mc = model_config()
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_model_len=2048,
                         is_encoder_decoder=False)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16), scheduler_config=sc,
                    additional_config=dict(additional_config or {}))
    vc.cache_config.mamba_block_size = 2048  # the runner sets it for hybrid models (mode "none": one block per request)
    if full_cudagraph:
        vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    return vc


def ensure_distributed(vc) -> None:
    """gloo world of size 1 (TP 1), once per process: the linear layers ask for their TP rank."""
    global _dist_ready
    if _dist_ready:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    _dist_ready = True


def kimi_linear_config(H: int = H_DEFAULT, D: int = D_DEFAULT, W: int = W_DEFAULT, lower_bound: Optional[float] = None,
                       k3: bool = False):
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    lac = {"kda_layers": [1], "full_attn_layers": [2], "head_dim": D, "num_heads": H, "short_conv_kernel_size": W}
    if k3:
        lac["use_full_rank_gate"] = True
    if lower_bound is not None:
        lac["gate_lower_bound"] = lower_bound
    return KimiLinearConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, linear_attn_config=lac)


def build_layer(vc, *, H: int = H_DEFAULT, D: int = D_DEFAULT, W: int = W_DEFAULT, lower_bound: Optional[float] = None,
                prefix: str = PREFIX, device="cpu", seed: int = 0, k3: bool = False):
    """``KimiGatedDeltaNetAttention(config, vc, prefix)`` (or, ``k3``, ROCm's ``KimiK3DeltaAttention``
    with a full-rank gate config) under ``set_current_vllm_config(vc)`` (what vLLM's model init
    does), with random parameters of the checkpoint's dtypes."""
    from vllm.config import set_current_vllm_config

    if k3:
        from vllm.models.kimi_k3.amd.kda import KimiK3DeltaAttention as layer_cls
    else:
        from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention as layer_cls

    ensure_distributed(vc)
    with set_current_vllm_config(vc), torch.device(device):
        layer = layer_cls(kimi_linear_config(H, D, W, lower_bound, k3), vc, prefix=prefix)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=g) * 0.5)
        layer.A_log.copy_(torch.rand(layer.A_log.shape, generator=g) * 0.5)
        layer.dt_bias.copy_(torch.randn(layer.dt_bias.shape, generator=g) * 0.5)
        layer.o_norm.weight.copy_(1.0 + 0.2 * torch.randn(layer.o_norm.weight.shape, generator=g))
    return layer


@dataclass
class Cache:
    pages: torch.Tensor  # [num_blocks, page_bytes] int8, the raw buffer behind both views
    conv_state: torch.Tensor  # layer.kv_cache[0]: SD [blocks, W-1, 3P] (page-strided)
    state: torch.Tensor  # layer.kv_cache[1]: [blocks, H, V, K] (page-strided)
    spec: object


def bind_cache(layer, vc, *, num_blocks: int, live_blocks: Sequence[int], pad_bytes: int = 4096, device="cpu",
               seed: int = 1) -> Cache:
    """Allocate vLLM's int8 page buffer ([blocks, 1, 1, page] like the runner's per-layer view),
    padded past the state bytes, and bind it with ``MambaBase.bind_kv_cache``. Live blocks hold
    random states, every other block (block 0 included) the 1e30 sentinel; the page padding
    holds a byte pattern."""
    spec = layer.get_kv_cache_spec(vc)
    page = int(spec.page_size_bytes) + pad_bytes
    pages = torch.full((num_blocks, page), 0x5A, dtype=torch.int8, device=device)
    layer.bind_kv_cache(pages.view(num_blocks, 1, 1, page))
    conv, state = layer.kv_cache
    g = torch.Generator().manual_seed(seed)
    conv.fill_(SENTINEL)
    state.fill_(SENTINEL)
    for blk in live_blocks:
        conv[blk].copy_(torch.randn(conv[blk].shape, generator=g).to(conv.dtype))
        state[blk].copy_((0.3 * torch.randn(state[blk].shape, generator=g)).to(state.dtype))
    return Cache(pages=pages, conv_state=conv, state=state, spec=spec)


def common_metadata(query_lens: Sequence[int], seq_lens: Sequence[int], blocks: Sequence[int], *, device="cpu",
                    is_prefilling: Optional[Sequence[bool]] = None):
    """``CommonAttentionMetadata`` as the runner builds it; rows with query length 0 are CUDA-graph
    padding (block 0, seq_len 0)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(query_lens)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    bt = torch.zeros(n, 4, dtype=torch.int32)
    bt[:, 0] = torch.tensor(blocks, dtype=torch.int32)
    T = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=sl.to(device), num_reqs=n,
        num_actual_tokens=T, max_query_len=max(query_lens), max_seq_len=int(sl.max()),
        block_table_tensor=bt.to(device), slot_mapping=torch.zeros(T, dtype=torch.int64, device=device),
        causal=True, seq_lens_cpu_upper_bound=sl.clone(),
        is_prefilling=None if is_prefilling is None else torch.tensor(is_prefilling, dtype=torch.bool),
    )


def metadata_builder(layer, vc, cache: Cache, device="cpu"):
    """The layer's own metadata builder (``GDNAttentionMetadataBuilder`` for Kimi-Linear,
    ``KimiK3ROCmKDAMetadataBuilder`` for ROCm K3), as the runner picks it."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vc):
        return layer.get_attn_backend().get_builder_cls()(cache.spec, [layer.prefix], vc, torch.device(device))


def decode_metadata(builder, live_blocks: Sequence[int], pad_rows: int, *, device="cpu", context: int = 7):
    """A real ``GDNAttentionMetadata`` for ``len(live_blocks)`` decode requests plus ``pad_rows``
    zero-length CUDA-graph padding rows (the runner pads with block 0 and seq_len 0; their tokens
    count in ``num_actual_tokens``, one per padded row, like the runner's token padding)."""
    n = len(live_blocks)
    ql = [1] * n + [0] * pad_rows
    sl = [context + 1 + i for i in range(n)] + [0] * pad_rows
    cam = common_metadata(ql, sl, list(live_blocks) + [0] * pad_rows, device=device,
                          is_prefilling=[False] * (n + pad_rows))
    cam.num_actual_tokens = n + pad_rows  # token-padded, as for FULL graph replay
    return builder.build(0, cam)


@dataclass
class DecodeInputs:
    mixed_qkv: torch.Tensor  # [T, 3P] row-strided view of the projection
    g1: torch.Tensor  # [1, T, H, D]
    g2: torch.Tensor  # [T, H, D]
    beta: torch.Tensor  # [1, T, H] row-strided view
    core_attn_out: torch.Tensor  # [1, T, H, D], NaN


def decode_inputs(layer, T: int, *, device="cpu", seed: int = 2, dtype=torch.bfloat16) -> DecodeInputs:
    """What ``KimiGatedDeltaNetAttention.forward`` hands ``_forward``: views of one projected
    buffer ``[q|k|v P*3 | beta H | f_a D]`` (row stride > row size), the projected gate, the output
    gate and a fresh ``core_attn_out`` (NaN: it must be fully written). For a full-rank-gate (K3)
    layer the buffer is ``[q|k|v P*3 | g P | f_a D | beta H | pad]`` and the output gate is a
    row-strided view of it, like ``KimiK3DeltaAttention.forward``."""
    H, D = layer.local_num_heads, layer.head_dim
    P = H * D
    g = torch.Generator().manual_seed(seed)
    if getattr(layer, "use_full_rank_gate", False):
        pad = -(4 * P + D + H) % 16
        proj = torch.randn(T, 4 * P + D + H + pad, generator=g).to(dtype).to(device)
        mixed_qkv, g_proj, _f_a, beta = proj.split([3 * P, P, D, H, pad], dim=-1)[:4]
        g2 = g_proj.view(T, H, D)
    else:
        proj = torch.randn(T, 3 * P + H + D, generator=g).to(dtype).to(device)
        mixed_qkv, beta, _f_a = proj.split([3 * P, H, D], dim=-1)
        g2 = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    g1 = torch.randn(1, T, H, D, generator=g).to(dtype).to(device)
    out = torch.full((1, T, H, D), float("nan"), dtype=dtype, device=device)
    return DecodeInputs(mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta.unsqueeze(0), core_attn_out=out)


def forward_context(vc, metadata: Dict[str, object]):
    from vllm.forward_context import set_forward_context

    return set_forward_context(metadata, vc)


def expected_decode(layer, inp: DecodeInputs, conv_state: torch.Tensor, state: torch.Tensor, rows_blocks: List[int]):
    """Float64 model of one decode step (notes §3.3 + the layer's o_norm), independent of
    kda_backend: returns (out [T, H, D], {block: (conv [W-1, 3P] SD, state [H, V, K])}).
    ``rows_blocks[n] <= 0`` is a padding row (zero output, no state change)."""
    f = torch.float64
    H, D = layer.local_num_heads, layer.head_dim
    P = H * D
    W = layer.conv_size
    w = layer.conv1d.weight.detach().to(f).view(3 * P, W)
    A = torch.exp(layer.A_log.detach().to(f))
    dt = layer.dt_bias.detach().to(f).view(H, D)
    nw = layer.o_norm.weight.detach().to(f)
    lb = layer.gate_lower_bound
    T = len(rows_blocks)
    out = torch.zeros(T, H, D, dtype=f)
    new = {}
    for n, blk in enumerate(rows_blocks):
        if blk <= 0:
            continue
        x = inp.mixed_qkv[n].to(f).cpu()
        win = torch.cat([conv_state[blk].to(f).cpu().t(), x[:, None]], dim=1)  # [3P, W] oldest first
        y = F.silu((win * w.cpu()).sum(-1))
        q, k, v = (t.view(H, D) for t in y.split(P))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        z = inp.g1[0, n].to(f).cpu() + dt.cpu()
        gate = lb * torch.sigmoid(A.cpu()[:, None] * z) if lb is not None else -A.cpu()[:, None] * F.softplus(z)
        beta = torch.sigmoid(inp.beta[0, n].to(f).cpu())
        S = state[blk].to(f).cpu() * torch.exp(gate)[:, None, :]  # [H, V, K]
        v_new = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
        S = S + v_new[:, :, None] * k[:, None, :]
        o = torch.einsum("hvk,hk->hv", S, q)
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + layer.o_norm.eps) * nw.cpu()
        out[n] = o * torch.sigmoid(inp.g2[n].to(f).cpu())
        new[blk] = (win[:, 1:].t().contiguous(), S)
    return out, new
