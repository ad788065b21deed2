"""What a vLLM 0.33 engine needs to run on a CPU machine without vLLM's compiled CPU extension
(this project's CI installs vLLM's Python tree only), and nothing else:

* ``torch.ops._C.init_cpu_memory_env`` (the CPU worker's NUMA memory set-up): a no-op;
* ``torch.ops._C.compute_slot_mapping_kernel_impl`` (the CPU stand-in of vLLM's Triton slot-mapping
  kernel): the same mapping in torch (slot = block_table[req, pos // bs] * bs + pos % bs, -1 past
  the step's tokens); ``torch.ops._C.greedy_argmax``: ``argmax(-1)``, what vLLM uses off CPU;
  ``torch.ops._C.rejection_greedy_sample_kernel_impl``: greedy draft verification (speculative
  decoding), the same rule as vLLM's Triton kernel;
* ``CpuPlatform.get_attn_backend_cls`` always answers CPU_ATTN: a backend the user named
  (``attention_backend="FLYDSL"``) is honoured instead, as the GPU platforms do;
* the CPU's AMX and AVX-512-BF16 units read as absent: on a CPU that has them vLLM takes kernels of
  its compiled CPU extension (``torch.ops._C.convert_weight_packed`` for its small-GEMM path, weight
  prepacking for causal-conv layers, ...), which is not installed; without them it stays on the torch
  / oneDNN paths (found on a Sapphire-Rapids-class CI machine, 2026-12-04: every engine case failed
  with ``'_C' object has no attribute 'convert_weight_packed'``).

Call ``prepare()`` in the process that builds the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
before ``vllm.LLM``. The model's attention then runs this project's backend on the torch
reference (``FLYDSL_BACKENDS_PA`` unset: ``auto`` picks ``torch`` on CPU).
"""

from __future__ import annotations

import os

_LIB = None


def _gumbel_argmax(logits, seeds):
    """Random sampling (the sampler's warm-up under torch.compile): Gumbel-max per row, each row's
    noise from its own seed."""
    import torch

    rows = []
    for i in range(logits.shape[0]):
        g = torch.Generator().manual_seed(int(seeds[i]))
        u = torch.rand(logits.shape[1], generator=g).clamp_(1e-20, 1.0)
        rows.append(int((logits[i] - torch.log(-torch.log(u))).argmax()))
    return torch.tensor(rows, dtype=torch.long)


def _slot_mapping(query_start_loc, positions, block_table, slot_mapping, block_size):
    import torch

    n = int(query_start_loc[-1])
    tok = torch.arange(n)
    req = torch.searchsorted(query_start_loc[1:].long(), tok, right=True)
    pos = positions[:n].long()
    slot_mapping[:n] = block_table[req, pos // block_size].long() * block_size + pos % block_size
    slot_mapping[n:] = -1


def _rejection_greedy(out, cu_num_draft, draft, target_argmax, bonus, is_greedy, max_spec_len):
    """Greedy verification of speculative drafts: each request keeps its drafts up to the first one
    the target disagrees with (that position gets the target's token), plus the bonus token when
    all were accepted (vLLM's rejection_greedy_sample_kernel, in torch)."""
    start = 0
    for r in range(int(cu_num_draft.shape[0])):
        end = int(cu_num_draft[r])
        if is_greedy is not None and not bool(is_greedy[r]):
            start = end
            continue
        rejected = False
        for pos in range(end - start):
            t = int(target_argmax[start + pos])
            out[r, pos] = t
            if int(draft[start + pos]) != t:
                rejected = True
                break
        if not rejected:
            out[r, end - start] = bonus[r]
        start = end


def prepare() -> None:
    global _LIB
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    if _LIB is None and not hasattr(torch.ops._C, "init_cpu_memory_env"):
        _LIB = torch.library.Library("_C", "FRAGMENT")
        _LIB.define("init_cpu_memory_env(int[] nodes) -> ()")
        _LIB.impl("init_cpu_memory_env", lambda nodes: None, "CompositeExplicitAutograd")
        _LIB.define("compute_slot_mapping_kernel_impl(Tensor query_start_loc, Tensor positions, Tensor block_table, "
                    "Tensor(a!) slot_mapping, int block_size) -> ()")
        _LIB.impl("compute_slot_mapping_kernel_impl", _slot_mapping, "CPU")
        _LIB.define("rejection_greedy_sample_kernel_impl(Tensor(a!) out, Tensor cu_num_draft, Tensor draft, "
                    "Tensor target_argmax, Tensor bonus, Tensor? is_greedy, int max_spec_len) -> ()")
        _LIB.impl("rejection_greedy_sample_kernel_impl", _rejection_greedy, "CPU")
        _LIB.define("greedy_argmax(Tensor logits) -> Tensor")
        _LIB.impl("greedy_argmax", lambda logits: logits.argmax(dim=-1).view(-1), "CPU")
        _LIB.define("fused_gumbel_argmax(Tensor logits, Tensor seeds) -> Tensor")
        _LIB.impl("fused_gumbel_argmax", _gumbel_argmax, "CPU")

    # vLLM asks torch for these per call: no AMX / AVX-512-BF16 kernels from the missing extension
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False

    from vllm.platforms import cpu as cpu_platform

    cls = cpu_platform.CpuPlatform
    if getattr(cls, "_flydsl_backend_honoured", False):
        return
    original = cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(klass, selected_backend, attn_selector_config, num_heads=None):
        name = getattr(selected_backend, "name", None)
        if name in ("FLYDSL", "CUSTOM"):
            return selected_backend.get_path()
        return original(klass, selected_backend, attn_selector_config, num_heads)

    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    cls._flydsl_backend_honoured = True
