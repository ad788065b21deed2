"""SGLang 0.5.23 adapter, the KV pool: ``FlyDSLMHATokenToKVPool``, the subclass of SGLang's
``MHATokenToKVPool`` whose per-layer buffers are the docs/design.md §4 layout (which is the pool's own
``vectorized_5d`` label): K ``[num_blocks, Hkv, D/16, P, 16]``, V ``[num_blocks, Hkv, P/16, D, 16]``,
FP8 stored as uint8, ``num_blocks = (size + P) // P`` (block 0 = SGLang's reserved padding page).
Writes go through ``write_kv`` (which divides by the per-tensor scale itself and does *not* mutate the
caller's K/V, unlike the in-tree pool), slot moves and CPU copies are page/offset aware.

SGLang builds it through ``pa_backend.sglang.install_kv_pool_hook`` (which imports this module when
it first resolves the pool class); the checks it shares with the backend live there.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from .api import write_kv
from .sglang import ACT_DTYPES, check_head_dims, check_kv_dtype, check_page_size

__all__ = ["FlyDSLMHATokenToKVPool"]


class FlyDSLMHATokenToKVPool(MHATokenToKVPool):
    """FP8 paged KV pool in the docs/design.md §4 layout (SGLang's ``vectorized_5d`` shapes, X = 16).

    Constructed by SGLang's configurator with the in-tree keyword arguments. Slot ``s`` is
    block ``s // P``, offset ``s % P``; block 0 is the padding page SGLang reserves.
    """

    LAYOUT = "vectorized_5d"

    def __init__(self, size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                 v_head_dim=None, swa_head_num=None, swa_head_dim=None, swa_v_head_dim=None, **kwargs):
        check_page_size(page_size)
        check_kv_dtype(dtype)
        hd = swa_head_dim if swa_head_dim is not None else head_dim
        vhd = swa_v_head_dim if swa_v_head_dim is not None else (v_head_dim if v_head_dim is not None else hd)
        check_head_dims(hd, vhd)
        if kwargs.get("post_capture_active"):
            raise ValueError("the flydsl KV pool does not support post-capture KV backing "
                             "(leave the post-capture / elastic KV option off)")
        if kwargs.get("quant_method") is not None:
            raise ValueError("the flydsl KV pool stores plain FP8 with per-tensor scales; block-scaled KV "
                             "quantization recipes (FP4 / MXFP8) are not supported: use --kv-cache-dtype fp8_e4m3")
        kwargs["kv_cache_layout"] = self.LAYOUT
        # the in-tree tiled slot-row copy assumes [slots, ...] rows; moves are done page-aware below
        kwargs["enable_kv_cache_copy"] = False
        self._kv_vector_x = 16  # 16 FP8 bytes per chunk (the in-tree code sets this only under AITER)
        self._scale_cache = {}
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                         v_head_dim=v_head_dim, swa_head_num=swa_head_num, swa_head_dim=swa_head_dim,
                         swa_v_head_dim=swa_v_head_dim, **kwargs)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        # write_kv implementation; "auto" honours FLYDSL_BACKENDS_PA. FlyDSLAttnBackend(pa_impl=...) sets it.
        self.pa_impl = "auto"

    # -- helpers -----------------------------------------------------------------------
    def num_blocks(self) -> int:
        return (self.size + self.page_size) // self.page_size

    def caches(self, layer_id: int):
        """(key_cache, value_cache) FP8 views of layer ``layer_id`` in the docs/design.md §4 layout."""
        i = layer_id - self.start_layer
        return self.k_buffer[i].view(self.dtype), self.v_buffer[i].view(self.dtype)

    def scale_tensor(self, s) -> torch.Tensor:
        """A 0-dim / [1] fp32 device tensor for a scale given as None, a float or a tensor."""
        if s is None:
            return self._one
        if isinstance(s, torch.Tensor):
            if s.dtype == torch.float32 and s.device == self._one.device and s.numel() == 1:
                return s.detach()
            return s.detach().to(device=self._one.device, dtype=torch.float32).reshape(())
        key = float(s)
        t = self._scale_cache.get(key)
        if t is None:
            t = torch.full((), key, dtype=torch.float32, device=self.device)
            self._scale_cache[key] = t
        return t

    def _page_off(self, loc: torch.Tensor):
        loc = loc.long()
        return loc // self.page_size, loc % self.page_size

    # -- writes ------------------------------------------------------------------------
    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        self._check_physical_write_loc(loc_info, "set_kv_buffer (flydsl MHA)")
        if dcp_kv_mask is not None:
            raise NotImplementedError("flydsl KV pool: decode context parallelism (dcp_kv_mask) is not supported")
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        kc, vc = self.caches(layer_id)
        H, D, Dv = self.head_num, self.head_dim, self.v_head_dim
        cache_k = cache_k.reshape(-1, H, D)
        cache_v = cache_v.reshape(-1, H, Dv)
        raw = (self.dtype, self.store_dtype)
        if cache_k.dtype in raw or cache_v.dtype in raw:
            # already quantized (e.g. a transfer): place the bytes directly, both checked before either is written
            for name, t in (("cache_k", cache_k), ("cache_v", cache_v)):
                if t.dtype not in raw:
                    raise ValueError(f"flydsl KV pool: {name} is {t.dtype} while the other is quantized "
                                     f"({self.dtype} bytes): K and V must both be activations or both FP8")
            if cache_k.shape[0] != loc.numel() or cache_v.shape[0] != loc.numel():
                raise ValueError(f"flydsl KV pool: {loc.numel()} locations for {cache_k.shape[0]} K and "
                                 f"{cache_v.shape[0]} V rows")
            self._scatter_raw(kc, vc, loc, cache_k.view(self.dtype), cache_v.view(self.dtype))
            return
        if cache_k.dtype not in ACT_DTYPES:
            cache_k = cache_k.to(torch.bfloat16)
            cache_v = cache_v.to(torch.bfloat16)
        if cache_k.stride(-1) != 1:
            cache_k = cache_k.contiguous()
        if cache_v.stride(-1) != 1:
            cache_v = cache_v.contiguous()
        write_kv(cache_k, cache_v, kc, vc, loc, self.scale_tensor(k_scale), self.scale_tensor(v_scale),
                 backend=self.pa_impl)

    def _scatter_raw(self, kc, vc, loc, k, v):
        # as write_kv: a location outside the pool (padding -1, or past its last slot) writes nothing
        keep = (loc >= 0) & (loc < self.num_blocks() * self.page_size)
        loc, k, v = loc[keep], k[keep], v[keep]
        pg, off = self._page_off(loc)
        n = loc.numel()
        kc.view(torch.uint8)[pg, :, :, off, :] = k.view(torch.uint8).reshape(n, self.head_num, -1, 16)
        vc.view(torch.uint8)[pg, :, off // 16, :, off % 16] = v.view(torch.uint8)

    # -- slot moves / CPU offload (slot-indexed in the in-tree pool) ---------------------
    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        if self.layer_num == 0 or tgt_loc.numel() == 0:
            return
        pt, ot = self._page_off(tgt_loc)
        ps, os_ = self._page_off(src_loc)
        for kb, vb in zip(self.k_buffer, self.v_buffer):
            kb[pt, :, :, ot, :] = kb[ps, :, :, os_, :]
            vb[pt, :, ot // 16, :, ot % 16] = vb[ps, :, os_ // 16, :, os_ % 16]

    def _gather_slots(self, i, loc):
        pg, off = self._page_off(loc)
        return (self.k_buffer[i][pg, :, :, off, :], self.v_buffer[i][pg, :, off // 16, :, off % 16])

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        idx = torch.as_tensor(indices, device=self.k_buffer[0].device)
        out = []
        for i in range(self.layer_num):
            chunks = []
            for s in range(0, idx.numel(), self.cpu_offloading_chunk_size):
                k, v = self._gather_slots(i, idx[s:s + self.cpu_offloading_chunk_size])
                chunks.append([k.cpu(), v.cpu()])
            out.append(chunks)
        return out

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        idx = torch.as_tensor(indices, device=self.k_buffer[0].device)
        cs = self.cpu_offloading_chunk_size
        for i in range(self.layer_num):
            for s in range(0, idx.numel(), cs):
                k_cpu, v_cpu = kv_cache_cpu[i][s // cs]
                pg, off = self._page_off(idx[s:s + cs])
                self.k_buffer[i][pg, :, :, off, :] = k_cpu.to(self.k_buffer[i].device)
                self.v_buffer[i][pg, :, off // 16, :, off % 16] = v_cpu.to(self.v_buffer[i].device)
