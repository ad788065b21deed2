"""CPU (or GPU) harness for the flydsl SGLang attention backend against real SGLang objects.

Follows the pattern of SGLang's own attention test kit (a ``ModelRunner`` subclass that skips
``ModelRunner.__init__`` and carries real pools, published server args and a KV index
translator), written for this project. Built here, for real:

* ``ReqToTokenPool`` (row 0 = padding row) and, per side, the KV pool: the flydsl side gets
  ``FlyDSLMHATokenToKVPool`` (docs/design.md §4 layout, FP8), the reference side SGLang's own NHD
  ``MHATokenToKVPool`` with the same FP8 dtype;
* ``ForwardBatch`` (decode / extend / mixed) bound to its own KV plan;
* ``RadixAttention`` layers (GQA);
* SGLang's ``torch_native`` backend from ``ATTENTION_BACKENDS`` for the reference side.

Both sides share one request->slot mapping (pages of a request shuffled and interleaved with other
requests' pages; page 0 never used by live tokens) and see the same FP8-quantized K/V (scale 1,
the reference pool's ``set_kv_buffer`` casts with ``.to(fp8)``, ``write_kv`` with x / 1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Sequence

import torch
from torch import nn

HQ, HKV, HEAD_DIM = 8, 2, 64
MAX_CONTEXT = 256
FP8 = torch.float8_e4m3fn


_PARALLEL_OVERRIDE: list = []  # the entered override (one per process); conftest.py exits it at session end


def _enter_parallel_override():
    """Single-rank attention parallelism for the runners built here (SGLang reads it from its
    runtime context); entered once, undone by ``exit_parallel_override``."""
    from sglang.srt.runtime_context import get_parallel

    if not _PARALLEL_OVERRIDE:
        cm = get_parallel().override(attn_tp_size=1, attn_dcp_rank=0)
        cm.__enter__()
        _PARALLEL_OVERRIDE.append(cm)


def exit_parallel_override():
    while _PARALLEL_OVERRIDE:
        _PARALLEL_OVERRIDE.pop().__exit__(None, None, None)


class TinyConfig:
    """The model-config fields the backends and pools read."""

    def __init__(self, num_heads, num_kv_heads, head_dim, context_len):
        from sglang.srt.configs.model_config import AttentionArch

        self.attention_arch = AttentionArch.MHA
        self.context_len = context_len
        self.num_attention_heads = num_heads
        self.num_key_value_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        self.swa_v_head_dim = head_dim
        self.hidden_size = num_heads * head_dim
        self.is_encoder_decoder = False
        self.is_multimodal = False
        self.model_is_mrope = False
        self.is_generation = True
        self.quantization = None
        self.is_hybrid_swa = False
        self.is_local_attention_model = False
        self.attention_chunk_size = None
        self.sliding_window_size = None
        self.hf_config = SimpleNamespace(architectures=["TinyForCausalLM"], hidden_size=self.hidden_size,
                                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                         head_dim=head_dim)
        self.hf_config.get_text_config = lambda: self.hf_config
        self.hf_text_config = self.hf_config
        self.linear_attn_registry_result = None

    def get_num_attention_heads(self, tp_size):
        return self.num_attention_heads // tp_size

    def get_max_num_attention_heads(self):
        return self.num_attention_heads

    def get_num_kv_heads(self, tp_size, dcp_size=1):
        return self.num_key_value_heads // (tp_size // dcp_size)


def _mock_runner_class():
    from sglang.srt.model_executor.model_runner import ModelRunner

    class MockRunner(ModelRunner):
        """A ModelRunner shell: attributes the attention backends read, real pools."""

        def __init__(self, *, backend_name, page_size, device, dtype, kv_dtype, num_reqs, max_context_len,
                     num_heads, num_kv_heads, head_dim, layer_num, pool_cls, sliding_window_size=None):
            from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
            from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
            from sglang.srt.runtime_context import get_context
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            _enter_parallel_override()
            self.device = device
            self.dtype = dtype
            self.kv_cache_dtype = kv_dtype
            self.kv_cache_dtype_str = "fp8_e4m3"
            self.prefill_attention_backend_str = backend_name
            self.decode_attention_backend_str = backend_name
            self.draft_attention_backend = None
            self.gpu_id = 0
            self.canary_manager = None
            self.page_size = page_size
            self.model_config = TinyConfig(num_heads, num_kv_heads, head_dim, max_context_len)
            self.is_draft_worker = False
            self.max_running_requests = num_reqs
            self.model = nn.Module()
            self.spec_algorithm = SpeculativeAlgorithm.NONE
            self._kernel_warmed_up = True
            self._server_args_override = get_context().override_server_args(
                attention_backend=backend_name, chunked_prefill_size=-1,
                cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend=Backend.DISABLED),
                                                  prefill=PhaseConfig(backend=Backend.DISABLED)),
                disable_radix_cache=False, dllm_algorithm=None, dllm_algorithm_config=None, dp_size=1,
                enable_deterministic_inference=False, enable_mis=False, is_embedding=False,
                kv_cache_dtype="fp8_e4m3", max_running_requests=None, pp_size=1, revision=None,
                speculative_algorithm=None, speculative_eagle_topk=0, speculative_num_draft_tokens=0,
                speculative_num_steps=0, tp_size=1, triton_attention_num_kv_splits=8,
                triton_attention_split_tile_size=None)
            self.server_args = self._server_args_override.install()
            self.req_to_token_pool = ReqToTokenPool(size=num_reqs, max_context_len=max_context_len, device=device,
                                                    enable_memory_saver=False)
            pages = 1 + num_reqs * (-(-max_context_len // page_size))
            self.token_to_kv_pool = pool_cls(size=pages * page_size, page_size=page_size, dtype=kv_dtype,
                                             head_num=num_kv_heads, head_dim=head_dim, layer_num=layer_num,
                                             device=device, enable_memory_saver=False, enable_alt_stream=False)
            self.token_to_kv_pool_allocator = SimpleNamespace(page_size=page_size,
                                                              get_kvcache=lambda: self.token_to_kv_pool)
            self.init_kv_index_translator()
            self.attention_chunk_size = None
            self.hisparse_coordinator = None
            self.init_new_workspace = False
            self.is_hybrid_swa = sliding_window_size is not None
            self.sliding_window_size = sliding_window_size
            self.use_mla_backend = False

        hybrid_gdn_config = property(lambda self: None)
        hybrid_lightning_config = property(lambda self: None)
        kimi_linear_config = property(lambda self: None)
        linear_attn_model_spec = property(lambda self: None)
        mamba2_config = property(lambda self: None)
        mambaish_config = property(lambda self: None)

    return MockRunner


@dataclass
class Case:
    """One batch: per request a prefix (already cached) and a number of new tokens."""

    mode: str  # "decode" | "extend" | "mixed"
    page_size: int
    prefix_lens: Sequence[int]
    extend_lens: Sequence[int] = ()
    num_heads: int = HQ
    num_kv_heads: int = HKV
    head_dim: int = HEAD_DIM
    sliding_window_size: Optional[int] = None
    seed: int = 0

    @property
    def bs(self):
        return len(self.prefix_lens)

    @property
    def input_lens(self):
        return tuple([1] * self.bs) if self.mode == "decode" else tuple(self.extend_lens)

    @property
    def seq_lens(self):
        return tuple(p + n for p, n in zip(self.prefix_lens, self.input_lens))


def make_slot_map(case: Case, max_context_len: int, num_reqs: int) -> List[List[int]]:
    """slots[r][pos] for request r (req-pool row r + 1), pos < max_context_len: each request gets
    random distinct pages out of 1..num_pages (interleaved across requests, shuffled within one);
    page 0 is never used. The whole row goes into req_to_token (entries past seq_len are not read)."""
    P = case.page_size
    pages_per_req = -(-max_context_len // P)
    rng = random.Random(1000 + case.seed)
    all_pages = list(range(1, 1 + num_reqs * pages_per_req))
    rng.shuffle(all_pages)
    out = []
    for r in range(case.bs):
        mine = all_pages[r * pages_per_req:(r + 1) * pages_per_req]
        out.append([mine[pos // P] * P + pos % P for pos in range(max_context_len)])
    return out


@dataclass
class Side:
    runner: object
    backend: object
    layers: List[object]
    forward_batch: object


@dataclass
class Fixture:
    case: Case
    flydsl: Side
    ref: Side
    q: torch.Tensor  # [T, Hq*D]
    k: torch.Tensor  # [T, Hkv*D]
    v: torch.Tensor
    sinks: Optional[torch.Tensor] = None
    slots: List[List[int]] = field(default_factory=list)


def make_forward_batch(case: Case, runner, slots, device, req_rows=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    mode = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED}[case.mode]
    rows = list(req_rows) if req_rows is not None else [r + 1 for r in range(case.bs)]
    out_locs, positions = [], []
    for r, (p, n) in enumerate(zip(case.prefix_lens, case.input_lens)):
        runner.req_to_token_pool.req_to_token[rows[r], :len(slots[r])] = torch.tensor(slots[r], dtype=torch.int32)
        for pos in range(p, p + n):
            out_locs.append(slots[r][pos])
            positions.append(pos)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=case.bs,
        input_ids=torch.zeros(len(out_locs), dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(case.seq_lens, dtype=torch.int64),
        out_cache_loc=torch.tensor(out_locs, dtype=torch.int64, device=device),
        seq_lens_sum=sum(case.seq_lens),
        positions=torch.tensor(positions, dtype=torch.int64, device=device))
    runner.kv_index_translator.bind_own_plan(fb)
    if mode != ForwardMode.DECODE:
        fb.extend_prefix_lens = torch.tensor(case.prefix_lens, dtype=torch.int32, device=device)
        fb.extend_prefix_lens_cpu = list(case.prefix_lens)
        fb.extend_seq_lens = torch.tensor(case.input_lens, dtype=torch.int32, device=device)
        fb.extend_seq_lens_cpu = list(case.input_lens)
        fb.extend_num_tokens = sum(case.input_lens)
        fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    return fb


def make_layers(case: Case, num_layers: int):
    from sglang.srt.layers.radix_attention import RadixAttention

    return [RadixAttention(num_heads=case.num_heads, head_dim=case.head_dim, scaling=case.head_dim ** -0.5,
                           num_kv_heads=case.num_kv_heads, layer_id=i,
                           sliding_window_size=case.sliding_window_size if case.sliding_window_size is not None
                           else -1)
            for i in range(num_layers)]


def build_side(case: Case, which: str, *, device="cpu", dtype=torch.bfloat16, kv_dtype=FP8, num_reqs=None,
               max_context_len=MAX_CONTEXT, num_layers=2, pa_impl="torch", slots=None):
    """One side: ``which`` = "flydsl" (our pool + FlyDSLAttnBackend) or "torch_native" (SGLang's NHD pool
    and backend)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from pa_backend.sglang_backend import FlyDSLAttnBackend
    from pa_backend.sglang_pool import FlyDSLMHATokenToKVPool

    num_reqs = num_reqs or case.bs + 1
    pool_cls = FlyDSLMHATokenToKVPool if which == "flydsl" else MHATokenToKVPool
    runner = _mock_runner_class()(backend_name=which, page_size=case.page_size, device=device, dtype=dtype,
                                  kv_dtype=kv_dtype, num_reqs=num_reqs, max_context_len=max_context_len,
                                  num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                                  layer_num=num_layers, pool_cls=pool_cls,
                                  sliding_window_size=case.sliding_window_size)
    if which == "flydsl":
        backend = FlyDSLAttnBackend(runner, pa_impl=pa_impl)
    else:
        backend = ATTENTION_BACKENDS["torch_native"](runner)
    slots = slots if slots is not None else make_slot_map(case, max_context_len, num_reqs)
    layers = make_layers(case, num_layers)
    fb = make_forward_batch(case, runner, slots, device)
    return Side(runner, backend, layers, fb), slots


def populate_prefix(side: Side, case: Case, slots, prefix_kv):
    """Write each layer's prefix K/V (list over layers of (k [N, Hkv, D], v)) through the pool's own
    set_kv_buffer."""
    locs = [slots[r][pos] for r, p in enumerate(case.prefix_lens) for pos in range(p)]
    if not locs:
        return
    loc = torch.tensor(locs, dtype=torch.int64, device=side.runner.device)
    for layer, (k, v) in zip(side.layers, prefix_kv):
        side.runner.token_to_kv_pool.set_kv_buffer(layer, loc, k.clone(), v.clone())


def build_fixture(case: Case, *, device="cpu", dtype=torch.bfloat16, num_layers=2, pa_impl="torch",
                  with_sinks=False, max_context_len=MAX_CONTEXT) -> Fixture:
    g = torch.Generator().manual_seed(case.seed)
    fly, slots = build_side(case, "flydsl", device=device, dtype=dtype, num_layers=num_layers, pa_impl=pa_impl,
                            max_context_len=max_context_len)
    ref, _ = build_side(case, "torch_native", device=device, dtype=dtype, num_layers=num_layers, slots=slots,
                        max_context_len=max_context_len)
    npre = sum(case.prefix_lens)
    prefix_kv = [(torch.randn(npre, case.num_kv_heads, case.head_dim, generator=g).to(dtype).to(device),
                  torch.randn(npre, case.num_kv_heads, case.head_dim, generator=g).to(dtype).to(device))
                 for _ in range(num_layers)]
    populate_prefix(fly, case, slots, prefix_kv)
    populate_prefix(ref, case, slots, prefix_kv)
    T = sum(case.input_lens)
    q = torch.randn(T, case.num_heads * case.head_dim, generator=g).to(dtype).to(device)
    k = torch.randn(T, case.num_kv_heads * case.head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(T, case.num_kv_heads * case.head_dim, generator=g).to(dtype).to(device)
    sinks = torch.randn(case.num_heads, generator=g).to(device) if with_sinks else None
    return Fixture(case, fly, ref, q, k, v, sinks, slots)


def run_side(side: Side, q, k, v, *, init=True, **kwargs):
    """RadixAttention.forward on every layer (each its own K/V write) under a forward context; returns
    the outputs [layers][T, Hq*D]."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    outs = []
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=side.backend)):
        if init:
            side.backend.init_forward_metadata(side.forward_batch)
        for layer in side.layers:
            outs.append(layer(q.clone(), k.clone(), v.clone(), side.forward_batch, **kwargs))
    return outs


def fp8_reference_attention(case: Case, side: Side, q, layer_idx=0, sinks=None):
    """Independent reference over the flydsl pool's contents: dequantize each request's tokens via
    req_to_token, causal (and windowed) fp32 softmax. Returns [T, Hq*D] fp32."""
    pool = side.runner.token_to_kv_pool
    layer = side.layers[layer_idx]
    kc, vc = pool.caches(layer.layer_id)
    ks = float(layer.k_scale) if layer.k_scale is not None else 1.0
    vs = float(layer.v_scale) if layer.v_scale is not None else 1.0
    P, H, Hkv, D = case.page_size, case.num_heads, case.num_kv_heads, case.head_dim
    r2t = side.runner.req_to_token_pool.req_to_token
    rows = side.forward_batch.req_pool_indices.tolist()
    q3 = q.float().view(-1, H, D)
    out, t0 = [], 0
    for r, (p, n) in enumerate(zip(case.prefix_lens, case.input_lens)):
        L = p + n
        loc = r2t[rows[r], :L].long()
        pg, off = loc // P, loc % P
        K = kc[pg, :, :, off, :].float().reshape(L, Hkv, D) * ks
        V = vc[pg, :, off // 16, :, off % 16].float() * vs
        K = K.repeat_interleave(H // Hkv, dim=1)
        V = V.repeat_interleave(H // Hkv, dim=1)
        for i in range(n):
            qp = p + i
            lo = 0
            if case.sliding_window_size is not None and case.sliding_window_size > -1:
                lo = max(0, qp - case.sliding_window_size)
            s = torch.einsum("hd,khd->hk", q3[t0 + i], K[lo:qp + 1]) * layer.scaling
            if sinks is not None:
                s = torch.cat([s, sinks.float()[:, None]], dim=1)
            pr = torch.softmax(s, dim=-1)[:, :qp + 1 - lo]
            out.append(torch.einsum("hk,khd->hd", pr, V[lo:qp + 1]).reshape(-1))
        t0 += n
    return torch.stack(out)


def slot_bytes(pool, layer_id):
    """(K, V) bytes of every slot of a pool as [slots, Hkv*D] uint8 (flydsl 5-D layout or SGLang NHD)."""
    i = layer_id - pool.start_layer
    kb, vb = pool.k_buffer[i], pool.v_buffer[i]
    if kb.dim() == 3:  # NHD [slots, H, D]
        return kb.reshape(kb.shape[0], -1), vb.reshape(vb.shape[0], -1)
    nb, H, D16, P, X = kb.shape
    k = kb.permute(0, 3, 1, 2, 4).reshape(nb * P, H * D16 * X)
    nb, H, P16, D, X = vb.shape
    v = vb.permute(0, 2, 4, 1, 3).reshape(nb * P16 * X, H * D)
    return k, v


def decode_batch(runner, rows, seq_lens, out_locs, device, n=1, topk=1):
    """A real decode ForwardBatch with explicit (possibly padded) rows: req-pool rows, seq_lens and
    out_cache_loc as given (padded rows: row 0, seq_len 1, loc 0, as SGLang pads).

    ``n`` > 1: a TARGET_VERIFY batch of ``n`` draft tokens per request, as EAGLE builds it
    (``seq_lens`` without the drafts, ``out_cache_loc`` n slots per request, a real
    ``EagleVerifyInput`` as spec_info)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    bs = len(rows)
    if len(out_locs) != bs * n:
        raise ValueError(f"out_locs: expected {bs} x {n} slots, got {len(out_locs)}")
    spec_info = None
    positions = [max(s - 1, 0) for s in seq_lens]
    if n > 1:
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        spec_info = EagleVerifyInput.create_idle_input(topk=topk, spec_steps=n - 1, num_verify_tokens=n, device=device)
        positions = [s + i for s in seq_lens for i in range(n)]
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if n == 1 else ForwardMode.TARGET_VERIFY, batch_size=bs,
        input_ids=torch.zeros(bs * n, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=torch.tensor(out_locs, dtype=torch.int64, device=device),
        seq_lens_sum=int(sum(seq_lens)),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        spec_info=spec_info)
    runner.kv_index_translator.bind_own_plan(fb)
    return fb


def replay_view(fb, num_padding):
    """The fields SGLang's decode graph runner puts on its replay SimpleNamespace view (notes §1.3),
    taken from a ForwardBatch holding the padded replay values (a stand-in for build_replay_fb_view)."""
    return SimpleNamespace(batch_size=fb.batch_size, forward_mode=fb.forward_mode, actual_forward_mode=fb.forward_mode,
                           input_ids=fb.input_ids, positions=fb.positions, req_pool_indices=fb.req_pool_indices,
                           seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, out_cache_loc=fb.out_cache_loc,
                           seq_lens_sum=fb.seq_lens_sum, num_padding=num_padding, spec_info=fb.spec_info)
