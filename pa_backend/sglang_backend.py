"""SGLang 0.5.23 adapter, the attention backend: ``FlyDSLAttnBackend``, ``--attention-backend flydsl``
for MHA/GQA models over the FP8 paged KV pool (``pa_backend.sglang_pool``).

An adapter only: it turns SGLang's metadata (``req_to_token``, ``seq_lens``, ``out_cache_loc``,
``extend_seq_lens``) into the arguments of :func:`pa_backend.write_kv` and one paged-attention plan per
batch (:func:`pa_backend.plan_decode` / :func:`pa_backend.plan_prefill`, docs/design.md §4). No kernel
code lives here. The plugin's backend factory imports this module when SGLang first builds the backend;
the server-argument policy runs earlier, from ``pa_backend.sglang``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from . import contract as _contract
from .contract import PAPlan, plan_decode, plan_prefill
from .sglang import ACT_DTYPES, WORKING, check_head_dims, check_kv_dtype, check_page_size
from .sglang_pool import FlyDSLMHATokenToKVPool

__all__ = ["FlyDSLAttnBackend", "FlyDSLForwardMetadata"]


@dataclass
class FlyDSLForwardMetadata:
    block_tables: torch.Tensor  # [bs, max_blocks] int32 page ids
    context_lens: torch.Tensor  # [bs] int32, new tokens included
    query_start_loc: Optional[torch.Tensor]  # [bs + 1] int32 for extend / mixed; None for decode / verify
    query_length: int = 1  # rows per request on the pa_decode path (target verify: the draft tokens, 2..4)
    plan: Optional[PAPlan] = None  # the batch's paged-attention plan (built once, run by every layer)


def _kv_pool_leaf(pool):
    return getattr(pool, "full_kv_pool", None) or pool


class FlyDSLAttnBackend(AttentionBackend):
    """``--attention-backend flydsl``: FP8 paged attention for MHA/GQA models.

    ``pa_impl`` picks the op implementation (``torch`` | ``triton`` | ``flydsl`` | ``auto``);
    default: ``auto``, which honours ``FLYDSL_BACKENDS_PA``.
    Decode (query length 1) → ``pa_decode``; extend / mixed → ``pa_prefill``; K/V written at
    ``out_cache_loc`` through the pool (``write_kv``). Decode CUDA graphs: static block table
    and context-length buffers, filled in place by ``init_forward_metadata_out_graph``.
    Speculative decoding (EAGLE / EAGLE3 / NEXTN / STANDALONE with ``--speculative-eagle-topk 1``):
    TARGET_VERIFY batches (``seq_lens`` without the draft tokens; their slots already in
    ``req_to_token``) run ``pa_decode`` with ``query_length`` = draft tokens (2..4) and context
    ``seq_lens + n``, eager and in CUDA graphs. Draft-model passes run on the draft worker's own
    backend (``--speculative-draft-attention-backend``) over SGLang's own pool.
    """

    def __init__(self, model_runner, pa_impl: Optional[str] = None):
        super().__init__()
        self.pa_impl = pa_impl or "auto"
        self.device = torch.device(model_runner.device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # the planner's workspace is keyed by the tensors' device (cuda:N), not "cuda"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
        self.page_size = int(model_runner.page_size)
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.data_type = model_runner.dtype
        self.needs_cpu_seq_lens = False  # only device seq_lens are read
        self.forward_metadata = None
        self.max_context_len = int(self.req_to_token.shape[1])

        self._validate(model_runner)
        if pa_impl:
            _kv_pool_leaf(self.token_to_kv_pool).pa_impl = self.pa_impl  # the pool's write_kv follows
        P = self.page_size
        self.max_blocks = -(-self.max_context_len // P)
        # a view, [pool rows, max_blocks]: the token slot of each page's first token (no copy)
        self._page_first_slots = self.req_to_token[:, ::P]
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        # eager decode / verify batches write their tables here (grow-only): the same addresses step after
        # step, so the layers' memoized argument checks keep hitting (a fresh tensor per step missed them)
        self._eager_block_tables = None
        self._eager_context_lens = None
        self.cuda_graph_block_tables = None
        self.cuda_graph_context_lens = None
        self.cuda_graph_max_bs = 0
        self.cuda_graph_query_length = 1
        self._graph_metadata = {}

    # -- construction checks -----------------------------------------------------------
    def _validate(self, runner):
        if getattr(runner, "use_mla_backend", False):
            raise ValueError("--attention-backend flydsl serves MHA/GQA attention, this model uses MLA; use "
                             "--attention-backend aiter (or triton) with --linear-attn-decode-backend flydsl "
                             "for Kimi-Linear / Kimi-K3, or " + WORKING)
        mc = getattr(runner, "model_config", None)
        arch = getattr(mc, "attention_arch", None)
        if arch is not None and getattr(arch, "name", str(arch)) == "MLA":
            raise ValueError("--attention-backend flydsl: the model's attention is MLA (not served); " + WORKING)
        check_page_size(self.page_size)
        check_kv_dtype(self.kv_cache_dtype)
        self._check_model_layers(runner)
        if self.data_type not in ACT_DTYPES:
            raise ValueError(f"--dtype: the flydsl attention backend computes in bfloat16 or float16, got "
                             f"{self.data_type}; use --dtype bfloat16 ({WORKING})")
        # speculative decoding: the combination is checked at argument resolution (the plugin) and the
        # draft-chain shape per verify batch (_verify_tokens)
        from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

        if isinstance(self.token_to_kv_pool, BaseSWAKVPool):
            raise ValueError("--attention-backend flydsl does not serve the hybrid full/SWA KV pool (separate "
                             "sliding-window sub-pool with translated locations); start the server with "
                             "--disable-hybrid-swa-memory (sliding windows are then applied in the kernel)")
        leaf = _kv_pool_leaf(self.token_to_kv_pool)
        if not isinstance(leaf, FlyDSLMHATokenToKVPool):
            raise ValueError(
                f"--attention-backend flydsl needs its FP8 paged KV pool (FlyDSLMHATokenToKVPool), but the "
                f"runner's pool is {type(leaf).__name__}: the flydsl plugin installs it through "
                f"pa_backend.sglang.install_kv_pool_hook() (SRTPlatform.get_kv_pool_cls); a platform that "
                f"returns its own MHA pool class cannot be combined with flydsl")
        if leaf.page_size != self.page_size:
            raise ValueError(f"--page-size mismatch: runner {self.page_size}, KV pool {leaf.page_size}")
        check_head_dims(leaf.head_dim, leaf.v_head_dim)
        tr = self.kv_index_translator
        if tr is not None and (getattr(tr, "is_translating", False) or getattr(tr, "reads_are_translated", False)):
            raise ValueError("--attention-backend flydsl reads physical page ids straight from req_to_token; the "
                             "unified (virtual->physical translated) KV pool and decode context parallelism are "
                             "not supported: leave unified memory / DCP off")
        self.num_kv_heads = leaf.head_num
        self.head_dim = leaf.head_dim
        tp = 1
        try:
            from sglang.srt.runtime_context import get_parallel

            tp = int(get_parallel().attn_tp_size)
        except Exception:
            pass
        self.num_q_heads = None
        if mc is not None and hasattr(mc, "get_num_attention_heads"):
            self.num_q_heads = int(mc.get_num_attention_heads(tp))
            g = self.num_q_heads // self.num_kv_heads
            if self.num_q_heads % self.num_kv_heads or not 1 <= g <= _contract.MAX_GQA:
                raise ValueError(f"--attention-backend flydsl supports GQA ratios 1..{_contract.MAX_GQA}; got "
                                 f"{self.num_q_heads} query heads over {self.num_kv_heads} KV heads per rank")

    @staticmethod
    def _check_model_layers(runner):
        """At start-up (SGLang builds attention backends after loading the model): reject what the
        forward would refuse at the first request — encoder-only and other non-causal layers (BERT-like
        and bidirectional embedding models), cross-attention, logit soft-capping (Gemma-2, Grok) —
        naming the working combination. An embedding model whose layers are causal decoder layers (a
        decoder LLM served with --is-embedding) runs causal prefill, which this backend serves."""
        model = getattr(runner, "model", None)
        if model is None or not hasattr(model, "named_modules"):
            return
        from sglang.srt.layers.radix_attention import RadixAttention

        for name, m in model.named_modules():
            if not isinstance(m, RadixAttention):
                continue
            if getattr(m, "is_cross_attention", False) or \
                    getattr(getattr(m, "attn_type", None), "name", "DECODER") != "DECODER":
                raise ValueError(f"--attention-backend flydsl serves causal decoder self-attention only; layer "
                                 f"{name} is cross-attention or non-causal: use --attention-backend triton "
                                 f"(or flashinfer) for this model ({WORKING})")
            if (getattr(m, "logit_cap", 0) or 0) > 0:
                raise ValueError(f"--attention-backend flydsl does not apply logit soft-capping (layer {name}: "
                                 f"logit_cap={m.logit_cap}, e.g. Gemma-2 / Grok): use --attention-backend triton "
                                 f"for this model ({WORKING})")

    # -- metadata ----------------------------------------------------------------------
    def _block_tables(self, req_pool_indices: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[bs, max_blocks] int32 page ids: req_to_token[row, j*P] // P, written into ``out`` when given
        (static shape, no host sync, two kernels: a row gather and the division; padded rows use req-pool
        row 0, which is all zeros, i.e. page 0)."""
        if out is None:
            out = torch.empty((int(req_pool_indices.shape[0]), self.max_blocks), dtype=torch.int32,
                              device=self.device)
        rows = torch.index_select(self._page_first_slots, 0, req_pool_indices)
        return torch.floor_divide(rows, self.page_size, out=out)

    @staticmethod
    def _reject_spec(mode):
        if mode.is_target_verify():
            return
        if mode.is_draft_extend_v2() or getattr(mode, "name", "").startswith("DRAFT"):
            raise NotImplementedError(f"flydsl attention backend: forward mode {mode.name} (a draft-model pass) is "
                                      "not served; the draft runs on --speculative-draft-attention-backend")

    @staticmethod
    def _verify_tokens(spec_info, default: int) -> int:
        """Draft tokens per request of a TARGET_VERIFY batch (spec_info's count, else ``default``);
        topk 1 only: a chain, so causal masking among the drafts is exact."""
        topk = getattr(spec_info, "topk", 1)
        if topk not in (None, 1):
            raise NotImplementedError(f"flydsl attention backend: target verify of a draft tree (topk={topk}) is "
                                      "not supported; use --speculative-eagle-topk 1")
        n = int(getattr(spec_info, "num_tokens_per_req", -1) or -1)
        if n <= 0:
            n = int(getattr(spec_info, "draft_token_num", -1) or -1)
        if n <= 0:
            n = default
        if not 1 <= n <= _contract.MAX_QUERY_LENGTH:
            raise NotImplementedError(f"flydsl attention backend: target verify with {n} draft tokens per request; "
                                      f"supported 1..{_contract.MAX_QUERY_LENGTH} (--speculative-num-draft-tokens)")
        return n

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        self._reject_spec(mode)
        bs = int(forward_batch.batch_size)
        max_context = self._max_context(forward_batch, bs)
        if mode.is_target_verify():
            n = self._verify_tokens(forward_batch.spec_info,
                                    int(forward_batch.out_cache_loc.shape[0]) // max(bs, 1))
            md = FlyDSLForwardMetadata(*self._eager_tables(forward_batch, bs, n), None, n)
            md.plan = plan_decode(md.block_tables, md.context_lens, query_length=n,
                                  max_context=None if max_context is None else max_context + n)
            self.forward_metadata = md
            return
        if not mode.is_decode():
            block_tables = self._block_tables(forward_batch.req_pool_indices[:bs])
            context_lens = forward_batch.seq_lens[:bs].to(torch.int32)
            lens = getattr(forward_batch, "extend_seq_lens", None)
            lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
            if lens is None:  # a decode batch relabelled as a 1-token extend (DP padding)
                qsl = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
                qsl_host = list(range(bs + 1))
            else:
                qsl = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
                torch.cumsum(lens[:bs].to(torch.int32), 0, out=qsl[1:])
                qsl_host = None
                if lens_cpu is not None:  # SGLang's host copy of the extend lengths: no sync
                    qsl_host = [0]
                    for x in list(lens_cpu)[:bs]:
                        qsl_host.append(qsl_host[-1] + int(x))
            md = FlyDSLForwardMetadata(block_tables, context_lens, qsl)
            md.plan = plan_prefill(block_tables, qsl, context_lens, query_start_loc_host=qsl_host,
                                   max_context=max_context)
        else:
            md = FlyDSLForwardMetadata(*self._eager_tables(forward_batch, bs, 0), None)
            md.plan = plan_decode(md.block_tables, md.context_lens, max_context=max_context)
        self.forward_metadata = md

    def _eager_tables(self, forward_batch, bs: int, extra: int):
        """(block tables, context lengths + ``extra``) of an eager decode / verify batch, written into the
        persistent eager buffers (their first ``bs`` rows)."""
        if self._eager_block_tables is None or self._eager_block_tables.shape[0] < bs:
            rows = max(bs, 1)
            self._eager_block_tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32, device=self.device)
            self._eager_context_lens = torch.zeros((rows,), dtype=torch.int32, device=self.device)
        return self._fill_tables(self._eager_block_tables, self._eager_context_lens, forward_batch, bs, extra)

    def _fill_tables(self, block_tables, context_lens, forward_batch, bs: int, extra: int):
        """The first ``bs`` rows of the persistent ``block_tables`` / ``context_lens`` filled in place
        (seq_lens + ``extra``: the draft tokens of a verify batch); returns those views."""
        block_tables, context_lens = block_tables[:bs], context_lens[:bs]
        self._block_tables(forward_batch.req_pool_indices[:bs], out=block_tables)
        torch.add(forward_batch.seq_lens[:bs], extra, out=context_lens)
        return block_tables, context_lens

    @staticmethod
    def _max_context(forward_batch, bs: int):
        """The batch's longest context from SGLang's host copy of seq_lens (None when absent)."""
        cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if cpu is None or bs == 0:
            return None
        return int(cpu[:bs].max())

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        n = max_num_tokens // max_bs if max_bs > 0 else 1
        if max_bs <= 0 or max_num_tokens != n * max_bs or not 1 <= n <= _contract.MAX_QUERY_LENGTH:
            raise NotImplementedError(f"flydsl attention backend: CUDA graphs need 1..{_contract.MAX_QUERY_LENGTH} "
                                      f"query tokens per request (got max_num_tokens={max_num_tokens} for "
                                      f"max_bs={max_bs})")
        if self.cuda_graph_block_tables is None or self.cuda_graph_max_bs < max_bs:
            self.cuda_graph_block_tables = torch.zeros((max_bs, self.max_blocks), dtype=torch.int32,
                                                       device=self.device)
            self.cuda_graph_context_lens = torch.ones((max_bs,), dtype=torch.int32, device=self.device)
            self.cuda_graph_max_bs = max_bs
            self._graph_metadata = {}  # (bs, query length) -> the metadata over these buffers
        self.cuda_graph_query_length = n  # 1: decode graphs; 2..4: target-verify graphs (speculative decoding)
        if self.device.type == "cuda" and self.num_q_heads is not None:
            from .planner import reserve

            reserve(max_bs, self.num_q_heads, self.num_kv_heads, self.head_dim, self.max_blocks * self.page_size,
                    self.page_size, query_length=n, device=self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Capture (real ForwardBatch, in_capture=True) and replay (a SimpleNamespace view): fill the
        static buffers' first ``bs`` rows in place; the metadata always views those buffers.
        Decode and TARGET_VERIFY (context = seq_lens + draft tokens) batches."""
        mode = forward_batch.forward_mode
        verify = mode.is_target_verify()
        if not (mode.is_decode() or verify):
            self._reject_spec(mode)
            raise NotImplementedError(f"flydsl attention backend: CUDA graphs for {mode.name} are not supported")
        if self.cuda_graph_block_tables is None:
            raise RuntimeError("init_cuda_graph_state must run before init_forward_metadata_out_graph")
        bs = int(forward_batch.batch_size)
        n = self._verify_tokens(getattr(forward_batch, "spec_info", None), self.cuda_graph_query_length) \
            if verify else 1
        # decode seq_lens include the new token; verify seq_lens exclude the n drafts
        block_tables, context_lens = self._fill_tables(self.cuda_graph_block_tables, self.cuda_graph_context_lens,
                                                       forward_batch, bs, n if verify else 0)
        # shape-only plan over the static buffers (the captured kernels split the replayed contexts), made
        # once per graph: a replay refills the same rows, so the plan made at capture still describes them
        md = self._graph_metadata.get((bs, n))
        if md is None or in_capture:
            plan = plan_decode(block_tables, context_lens, query_length=n)
            md = self._graph_metadata[(bs, n)] = FlyDSLForwardMetadata(block_tables, context_lens, None, n, plan)
        self.forward_metadata = md

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        pass

    # -- forward -----------------------------------------------------------------------
    def _layer_args(self, layer, kwargs):
        if layer.is_cross_attention or getattr(getattr(layer, "attn_type", None), "name", "DECODER") != "DECODER":
            raise NotImplementedError("flydsl attention backend: only causal decoder self-attention is supported")
        if layer.logit_cap and layer.logit_cap > 0:
            raise NotImplementedError("flydsl attention backend: logit capping (logit_cap > 0) is not supported")
        if layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError("flydsl attention backend: qk_head_dim != v_head_dim is not supported")
        sw = layer.sliding_window_size
        # SGLang's window w admits keys q-w .. q (w + 1 tokens, as torch_native / flashinfer / the triton
        # extend kernel do); the op's sliding_window counts tokens including the current one.
        sliding_window = int(sw) + 1 if sw is not None and sw > -1 else 0
        sinks = kwargs.get("sinks")
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        ks = layer.k_scale if layer.k_scale is not None else self._one
        vs = layer.v_scale if layer.v_scale is not None else self._one
        return sliding_window, sinks, ks.detach(), vs.detach()

    def _save_kv(self, layer, forward_batch, k, v, save_kv_cache):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v,
                                                layer.k_scale, layer.v_scale)

    def _caches(self, layer):
        return (self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id))

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs, extend=False):
        """Shared by decode and extend: the layer's arguments, then the plan's run, which checks them
        all before it calls back for the K/V write (a refused call leaves the pool untouched). The
        output is the plan's own fresh tensor (``out=None``: an output argument would enter the
        per-layer check memo with a new address at almost every call)."""
        sliding_window, sinks, ks, vs = self._layer_args(layer, kwargs)
        kc, vc = self._caches(layer)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        md = self.forward_metadata
        if extend and md.query_start_loc is None:  # a decode-shaped metadata relabelled as a 1-token extend
            raise RuntimeError("flydsl attention backend: extend forward without extend metadata")
        o = md.plan.run(q3, kc, vc, ks, vs, softmax_scale=layer.scaling, sliding_window=sliding_window,
                        sinks=sinks, backend=self.pa_impl,
                        before_launch=lambda: self._save_kv(layer, forward_batch, k, v, save_kv_cache))
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        mode = forward_batch.forward_mode
        self._reject_spec(mode)
        if mode.is_target_verify():  # draft tokens: query_length rows per request, on the decode kernel
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs, extend=True)
