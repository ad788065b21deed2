"""Random vLLM 0.33.0 steps through the FLYDSL backend: the batch shapes a scheduler produces, drawn at random
rather than picked (decode, speculative rows, fresh prefills, chunked prefills on a prefix, in any order and
mix; CUDA-graph padding requests behind uniform batches; page sizes 16 / 32 / 48 / 64; both cache layouts
vLLM allocates for the backend). Each step runs the real metadata builder, ``do_kv_cache_update`` and
``forward`` on caches from vLLM's ``allocate_kv_cache`` and is checked against SDPA over the dequantized K/V,
with every slot outside the batch's tokens still holding the sentinel and the other layer untouched.

The ops run on the reference and on the Triton kernels (the interpreter on CPU, when Triton is usable).
FUZZ_CASES (default 5: the fifth has graph padding requests) and FUZZ_SEED widen a local run.

Run: VLLM_TARGET_DEVICE=cpu /work/venv-vllm/bin/python -m pytest -q integration_tests/vllm/test_batch_fuzz.py
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("vllm")

import pa_backend.vllm as pav  # noqa: E402
from integration_tests.vllm import attn_harness as H  # noqa: E402

ATOL, RTOL = 2e-2, 2e-2
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
N_CASES = int(os.environ.get("FUZZ_CASES", "5"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))


def _triton_usable() -> bool:
    from pa_backend import REGISTRY

    return bool(REGISTRY.get("triton").is_available()[0])


IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not _triton_usable(),
                                                                  reason="triton not usable here"))]


def draw(rng: random.Random):
    """(Batch, layout) of one random step."""
    n = rng.randint(1, 5)
    uniform = rng.random() < 0.4
    ql = rng.randint(1, 4)
    prefix, query = [], []
    for _ in range(n):
        if uniform:  # a decode / speculative-decode step: every request the same query length
            prefix.append(rng.randint(0, 90))
            query.append(ql)
            continue
        kind = rng.choice(["decode", "spec", "prefill", "chunk"])
        if kind == "decode":
            prefix.append(rng.randint(1, 90)), query.append(1)
        elif kind == "spec":
            prefix.append(rng.randint(1, 90)), query.append(rng.randint(2, 4))
        elif kind == "prefill":
            prefix.append(0), query.append(rng.randint(1, 40))
        else:
            prefix.append(rng.randint(1, 70)), query.append(rng.randint(2, 30))
    bs = rng.choice([16, 32, 48, 64])
    blocks = sum(-(-(p + q) // bs) for p, q in zip(prefix, query)) + rng.randint(2, 6)
    b = H.Batch(prefix_lens=prefix, query_lens=query, block_size=bs, num_blocks=blocks, seed=rng.randint(0, 10**6),
                pad_reqs=rng.randint(0, 2) if uniform else 0)
    return b, rng.choice(["LBHNC", "LHBNC"])


CASES = [draw(random.Random(SEED * 1000003 + i)) for i in range(N_CASES)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.tiny_llama_dir(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("impl_name", IMPLS)
@pytest.mark.parametrize("i", range(N_CASES))
def test_random_step_matches_sdpa(model_dir, i, impl_name):
    from vllm.config import set_current_vllm_config

    b, layout = CASES[i]
    spec = H.backend_spec(block_size=b.block_size)
    vc = H.vllm_config(model_dir, block_size=b.block_size)
    with set_current_vllm_config(vc):
        builder = pav.FlyDSLAttentionMetadataBuilder(spec, LAYERS, vc, torch.device("cpu"))
    max_blocks = max(-(-s // b.block_size) for s in b.seq_lens) + random.Random(i).randint(0, 3)
    rows = H.block_rows(b, max_blocks=max_blocks)
    cam = H.common_metadata(b, rows)
    md = builder.build(0, cam)
    uniform = len(set(b.query_lens)) == 1
    assert bool(md.query_length) == (uniform and b.query_lens[0] <= 4), (b, md.query_length)
    g = torch.Generator().manual_seed(1000 + i)
    k_all, v_all = H.random_kv(b, g)
    ks, vs = 0.5, 0.25
    impl = H.make_impl(pa_impl=impl_name)
    layer = H.layer_with_scales(ks, vs)
    caches = H.allocate(spec, b.num_blocks, LAYERS, layout)
    kv = caches[LAYERS[0]]
    other = caches[LAYERS[1]].view(torch.uint8).clone()
    H.write_prefix(impl, layer, kv, b, rows, k_all, v_all)
    k_new, v_new = H.new_tokens(b, k_all, v_all)
    T = cam.num_actual_tokens  # padding requests' tokens included (slots -1)
    pad = T - k_new.shape[0]
    if pad:
        k_new = torch.cat([k_new, torch.randn(pad, H.HKV, H.D, generator=g).bfloat16()])
        v_new = torch.cat([v_new, torch.randn(pad, H.HKV, H.D, generator=g).bfloat16()])
    impl.do_kv_cache_update(layer, k_new, v_new, kv, cam.slot_mapping)
    q = torch.randn(T, H.HQ, H.D, generator=g).bfloat16()
    out = torch.full((T, H.HQ, H.D), float("nan"), dtype=torch.bfloat16)
    impl.forward(layer, q, k_new, v_new, kv, md, out)
    real = T - pad
    want = H.sdpa_reference(q[:real], k_all, v_all, b, H.D ** -0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out[:real].float(), want, atol=ATOL, rtol=RTOL)
    sb = H.slot_bytes(kv, b.block_size)
    dead = torch.ones(sb.shape[0], dtype=torch.bool)
    dead[H.live_slots(b, rows)] = False
    assert bool((sb[dead] == H.SENTINEL_BYTE).all()), b  # padding tokens (slot -1) wrote nothing
    assert torch.equal(caches[LAYERS[1]].view(torch.uint8), other)
