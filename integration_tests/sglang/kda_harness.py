"""CPU (or GPU) harness for the flydsl KDA decode kernel against real SGLang 0.5.23 objects.

Built for real: the published server args (``--linear-attn-decode-backend flydsl``), the
plugin's hooks applied through SGLang's ``HookRegistry``, a KDA ``HybridReqToTokenPool`` (real
``MambaPool``, Kimi-Linear state shapes), ``KDAAttnBackend`` (its ``KDAKernelDispatcher`` built
through our AROUND hook), a decode ``ForwardBatch``, ``RadixLinearAttention`` layers and the
mamba CUDA-graph metadata paths (``init_cuda_graph_state`` / ``init_forward_metadata_out_graph``).

Stand-ins (CPU only): SGLang's triton ``causal_conv1d_update`` (the ``kda_backend`` module binding)
is replaced by :func:`torch_causal_conv1d_update` through pytest's ``monkeypatch``; our op runs with
``FLYDSL_BACKENDS_KDA=torch`` (the reference). The ModelRunner is a shell (harness.py's pattern)
that never runs ``ModelRunner.__init__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from integration_tests.sglang import harness as _pa_harness

H_DEFAULT, D_DEFAULT, W_DEFAULT = 2, 32, 4


def apply_plugin_hooks() -> None:
    """The plugin entry point as SGLang runs it (``load_plugins`` calls it, then applies hooks)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from flydsl_backends.plugins import register_sglang

    register_sglang()
    HookRegistry.apply_hooks()


def torch_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                               conv_state_indices=None, pad_slot_id=-1, **kwargs):
    """Torch stand-in of SGLang's triton ``causal_conv1d_update`` (decode, one token per row):
    ``x`` [B, C], ``conv_state`` [slots, C, W-1] (any strides), ``weight`` [C, W]. Rows whose index
    equals ``pad_slot_id`` are skipped (their output is left as SGLang's kernel leaves it: x)."""
    assert x.dim() == 2 and cache_seqlens is None and not kwargs, "decode-only stand-in"
    out = x.clone()
    idx = conv_state_indices.tolist() if conv_state_indices is not None else list(range(x.shape[0]))
    for n, s in enumerate(idx):
        if s == pad_slot_id:
            continue
        win = torch.cat([conv_state[s].float(), x[n].float()[:, None]], dim=1)  # [C, W]
        y = (win * weight.float()).sum(-1)
        if bias is not None:
            y = y + bias.float()
        if activation in ("silu", "swish"):
            y = F.silu(y)
        conv_state[s].copy_(win[:, 1:].to(conv_state.dtype))
        out[n] = y.to(x.dtype)
    return out


def _kda_mock_runner_class():
    base = _pa_harness._mock_runner_class()

    class KDAMockRunner(base):
        """ModelRunner shell with a KDA HybridReqToTokenPool and linear-attn server args."""

        def __init__(self, *, num_heads, head_dim, conv_width, num_layers, mamba_size, num_reqs, max_context_len,
                     decode_backend="flydsl", device="cpu", dtype=torch.bfloat16):
            from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape
            from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
            from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
            from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
            from sglang.srt.runtime_context import get_context
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            _pa_harness._enter_parallel_override()
            self.device = device
            self.dtype = dtype
            self.kv_cache_dtype = dtype
            self.kv_cache_dtype_str = "auto"
            self.prefill_attention_backend_str = "triton"
            self.decode_attention_backend_str = "triton"
            self.draft_attention_backend = None
            self.gpu_id = 0
            self.canary_manager = None
            self.page_size = 1
            self.model_config = _pa_harness.TinyConfig(num_heads, num_heads, head_dim, max_context_len)
            self.is_draft_worker = False
            self.max_running_requests = num_reqs
            self.model = torch.nn.Module()
            self.spec_algorithm = SpeculativeAlgorithm.NONE
            self._kernel_warmed_up = True
            self._server_args_override = get_context().override_server_args(
                attention_backend="triton", chunked_prefill_size=-1,
                cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend=Backend.DISABLED),
                                                  prefill=PhaseConfig(backend=Backend.DISABLED)),
                disable_radix_cache=True, dllm_algorithm=None, dllm_algorithm_config=None, dp_size=1,
                enable_deterministic_inference=False, enable_mis=False, is_embedding=False,
                kv_cache_dtype="auto", max_running_requests=None, pp_size=1, revision=None,
                speculative_algorithm=None, speculative_eagle_topk=0, speculative_num_draft_tokens=0,
                speculative_num_steps=0, tp_size=1, linear_attn_backend="triton",
                linear_attn_decode_backend=decode_backend, linear_attn_prefill_backend=None,
                linear_attn_verify_backend=None, enable_linear_replayssm=False)
            self.server_args = self._server_args_override.install()
            shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=num_heads, head_dim=head_dim,
                                                conv_kernel_size=conv_width)
            self.cache_params = KimiLinearCacheParams(shape=shape, layers=list(range(num_layers)))
            self.req_to_token_pool = HybridReqToTokenPool(
                size=num_reqs, mamba_size=mamba_size, mamba_spec_state_size=mamba_size,
                max_context_len=max_context_len, device=device, enable_memory_saver=False,
                cache_params=self.cache_params, mamba_layer_ids=list(range(num_layers)),
                enable_mamba_extra_buffer=False, speculative_num_draft_tokens=None, enable_overlap_schedule=False)
            self.token_to_kv_pool = None
            self.token_to_kv_pool_allocator = SimpleNamespace(page_size=1, get_kvcache=lambda: None)
            self.attention_chunk_size = None
            self.hisparse_coordinator = None
            self.init_new_workspace = False
            self.is_hybrid_swa = False
            self.sliding_window_size = None
            self.use_mla_backend = False
            self.linear_attn_backends = resolve_linear_attn_backends()

    return KDAMockRunner


def _no_full_attn_backend_class():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class NoFullAttnBackend(AttentionBackend):
        """Stand-in full-attention side of ``HybridLinearAttnBackend`` (the fixture has no full
        attention layers): metadata calls are no-ops, forward raises."""

        needs_cpu_seq_lens = False
        use_captured_forward_metadata_for_breakable_cuda_graph = False

        def __init__(self, runner):
            super().__init__()
            self.token_to_kv_pool = None
            self.req_to_token_pool = runner.req_to_token_pool
            self.kv_index_translator = None
            self.device = runner.device

        def init_forward_metadata(self, forward_batch):
            return None

        def init_cuda_graph_state(self, max_bs, max_num_tokens):
            return None

        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            return None

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        def forward_decode(self, *args, **kwargs):
            raise AssertionError("no full-attention layer in this fixture")

        forward_extend = forward_decode

    return NoFullAttnBackend


@dataclass
class KDAFixture:
    runner: object
    backend: object  # KDAAttnBackend
    hybrid: object  # HybridLinearAttnBackend(NoFullAttnBackend, KDAAttnBackend)
    layers: List[object]  # RadixLinearAttention
    H: int
    D: int
    W: int


def build_kda_fixture(*, num_heads=H_DEFAULT, head_dim=D_DEFAULT, conv_width=W_DEFAULT, num_layers=2, mamba_size=6,
                      num_reqs=6, max_context_len=64, lower_bound: Optional[float] = None, seed=0,
                      device="cpu") -> KDAFixture:
    """Runner + KDAAttnBackend (built under ``--linear-attn-decode-backend flydsl`` with the hook
    applied) + layers with random fp32 conv weights / A_log / dt_bias; the caches get random
    contents (slot 0 included) so untouched-slot checks mean something."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    apply_plugin_hooks()
    runner = _kda_mock_runner_class()(num_heads=num_heads, head_dim=head_dim, conv_width=conv_width,
                                      num_layers=num_layers, mamba_size=mamba_size, num_reqs=num_reqs,
                                      max_context_len=max_context_len, device=device)
    backend = KDAAttnBackend(runner)
    hybrid = HybridLinearAttnBackend(_no_full_attn_backend_class()(runner), backend, full_attn_layers=[])
    g = torch.Generator().manual_seed(seed)
    C = 3 * num_heads * head_dim
    layers = []
    for i in range(num_layers):
        layers.append(RadixLinearAttention(
            layer_id=i, num_q_heads=num_heads, num_k_heads=num_heads, num_v_heads=num_heads, head_q_dim=head_dim,
            head_k_dim=head_dim, head_v_dim=head_dim,
            conv_weights=(torch.randn(C, conv_width, generator=g) * 0.5).to(device),
            bias=None, activation="silu",
            A_log=torch.randn(1, 1, num_heads, 1, generator=g).mul(0.5).to(device),
            dt_bias=torch.randn(num_heads * head_dim, generator=g).mul(0.5).to(device),
            lower_bound=lower_bound))
    pool = runner.req_to_token_pool
    for i in range(num_layers):
        cache = pool.mamba2_layer_cache(i)
        cache.conv[0].copy_(torch.randn(cache.conv[0].shape, generator=g).to(cache.conv[0].dtype))
        cache.temporal.copy_(torch.randn(cache.temporal.shape, generator=g).mul(0.3).to(cache.temporal.dtype))
    return KDAFixture(runner, backend, hybrid, layers, num_heads, head_dim, conv_width)


def assign_requests(fx: KDAFixture, rows: Sequence[int], slots: Sequence[int]) -> None:
    """req-pool row -> mamba slot, as ``HybridReqToTokenPool.alloc`` leaves it."""
    m = fx.runner.req_to_token_pool.req_index_to_mamba_index_mapping
    for r, s in zip(rows, slots):
        m[r] = s


def decode_batch(fx: KDAFixture, rows: Sequence[int], seq_lens: Optional[Sequence[int]] = None):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    bs = len(rows)
    seq_lens = list(seq_lens) if seq_lens is not None else [5] * bs
    dev = fx.runner.device
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
        req_pool_indices=torch.tensor(list(rows), dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=dev),
        seq_lens_sum=int(sum(seq_lens)),
        positions=torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64, device=dev))


def replay_view(fb, num_padding):
    return _pa_harness.replay_view(fb, num_padding)


def decode_inputs(fx: KDAFixture, bs: int, seed=1, dtype=torch.bfloat16):
    """Pre-conv ``mixed_qkv`` [B, 3HK], raw ``a`` [B, HK], raw ``b`` [1, B, H], as KimiDeltaAttention
    hands them to ``RadixLinearAttention`` at decode."""
    g = torch.Generator().manual_seed(seed)
    HK = fx.H * fx.D
    dev = fx.runner.device
    x = torch.randn(bs, 3 * HK, generator=g).to(dtype).to(dev)
    a = torch.randn(bs, HK, generator=g).to(dtype).to(dev)
    b = torch.randn(1, bs, fx.H, generator=g).to(dtype).to(dev)
    return x, a, b


def run_layers(fx: KDAFixture, fb, inputs, *, init="eager", num_padding=0):
    """``RadixLinearAttention.forward`` on every layer under a forward context whose backend is
    ``HybridLinearAttnBackend`` (-> ``KDAAttnBackend.forward_decode``). ``init``: "eager"
    (``init_forward_metadata``) or "none" (metadata already set, e.g. by the graph paths)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    outs = []
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.hybrid)):
        if init == "eager":
            fx.hybrid.init_forward_metadata(fb)
        for layer in fx.layers:
            x, a, b = inputs
            outs.append(layer(fb, mixed_qkv=x.clone(), a=a.clone(), b=b.clone()))
    return outs


def snapshot(fx: KDAFixture):
    """Clones of every layer's (conv [slots, W-1, C], ssm [slots, H, V, K])."""
    pool = fx.runner.req_to_token_pool
    out = []
    for layer in fx.layers:
        c = pool.mamba2_layer_cache(layer.layer_id)
        out.append((c.conv[0].clone(), c.temporal.clone()))
    return out


def reference_step(fx: KDAFixture, caches, inputs, slots: Sequence[int]):
    """The project's reference on cloned caches: ``kda_decode(backend="torch")`` with the conv stage
    fused (pre-conv x, conv_weight, transposed-view conv state), no output norm. Returns
    (outs [layers][1, B, H, V], caches updated)."""
    from kda_backend import kda_decode

    x, a, b = inputs
    idx = torch.tensor(list(slots), dtype=torch.int32)
    outs = []
    for layer, (conv, ssm) in zip(fx.layers, caches):
        o = kda_decode(x, layer.conv_weights, conv.transpose(-1, -2), a, b, layer.A_log.reshape(-1), layer.dt_bias,
                       ssm, idx, None, None, conv_bias=layer.bias, lower_bound=layer.lower_bound,
                       scale=layer.head_k_dim ** -0.5, backend="torch")
        outs.append(o.unsqueeze(0))
    return outs, caches
