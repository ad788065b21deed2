"""Random SGLang 0.5.23 forward batches through the flydsl backend: the shapes a scheduler produces, drawn at
random rather than picked (decode batches, extends of fresh and cached prompts, mixed batches with decode rows
among the extends; pages of 16 / 64 / 128, the sizes the pool takes; GQA groups 1-8 at D 64 and 128). Each batch runs
through real
pools, ``ForwardBatch`` and ``RadixAttention`` layers and is checked against SGLang's own ``torch_native``
backend on the same FP8 bytes and against an independent dequantize-and-softmax reference; the pools must hold
the same bytes at every live slot and nothing anywhere else.

The ops run on the reference and on the Triton kernels (the interpreter on CPU, when Triton is usable).
FUZZ_CASES (default 4) and FUZZ_SEED (default 3) widen a local run.

Run: PYTHONPATH=integration_tests/stubs:. /work/venv-sgl/bin/python -m pytest -q
integration_tests/sglang/test_batch_fuzz.py
"""

from __future__ import annotations

import os
import random

import pytest
import torch

try:
    import sglang.srt.layers.attention.base_attn_backend  # noqa: F401
    import sglang.srt.mem_cache.memory_pool  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang 0.5.23 is not importable here ({type(exc).__name__}: {exc})", allow_module_level=True)

from integration_tests.sglang import harness as H  # noqa: E402

ATOL, RTOL = 2e-2, 2e-2
N_CASES = int(os.environ.get("FUZZ_CASES", "4"))
SEED = int(os.environ.get("FUZZ_SEED", "3"))  # 3: the first four cases cover every mode, page size and head dim


def _triton_usable() -> bool:
    from pa_backend import REGISTRY

    return bool(REGISTRY.get("triton").is_available()[0])


IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not _triton_usable(),
                                                                  reason="triton not usable here"))]


def draw(rng: random.Random) -> H.Case:
    bs = rng.randint(1, 5)
    mode = rng.choice(["decode", "extend", "mixed"])
    Hkv = rng.choice([1, 2])
    kw = dict(mode=mode, page_size=rng.choice([16, 64, 128]), num_kv_heads=Hkv,
              num_heads=Hkv * rng.choice([1, 2, 4, 8]), head_dim=rng.choice([64, 64, 128]), seed=rng.randint(0, 999))
    if mode == "decode":
        kw["prefix_lens"] = tuple(rng.randint(1, 120) for _ in range(bs))
    else:
        prefix, ext = [], []
        for _ in range(bs):
            if mode == "mixed" and rng.random() < 0.5:  # a decode row inside the extend batch
                prefix.append(rng.randint(1, 120)), ext.append(1)
            else:
                prefix.append(rng.choice([0, rng.randint(1, 80)])), ext.append(rng.randint(1, 40))
        kw["prefix_lens"], kw["extend_lens"] = tuple(prefix), tuple(ext)
    return H.Case(**kw)


CASES = [draw(random.Random(SEED * 1000003 + i)) for i in range(N_CASES)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("i", range(N_CASES))
def test_random_batch_matches_torch_native(i, impl):
    case = CASES[i]
    fx = H.build_fixture(case, pa_impl=impl)
    out = H.run_side(fx.flydsl, fx.q, fx.k, fx.v)
    ref = H.run_side(fx.ref, fx.q, fx.k, fx.v)
    live = torch.tensor(sorted(fx.slots[r][pos] for r in range(case.bs) for pos in range(case.seq_lens[r])))
    for layer_idx, (a, b) in enumerate(zip(out, ref)):
        torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{case}: {m}")
        ka, va = H.slot_bytes(fx.flydsl.runner.token_to_kv_pool, layer_idx)
        kb, vb = H.slot_bytes(fx.ref.runner.token_to_kv_pool, layer_idx)
        assert torch.equal(ka[live], kb[live]) and torch.equal(va[live], vb[live]), case
        dead = torch.ones(ka.shape[0], dtype=torch.bool)
        dead[live] = False
        assert int(ka[dead].count_nonzero()) == 0 and int(va[dead].count_nonzero()) == 0, case
    torch.testing.assert_close(out[0].float(), H.fp8_reference_attention(case, fx.flydsl, fx.q).float(), atol=ATOL,
                               rtol=RTOL)
