"""Differential fuzz of the paged-attention contract's layout freedom (issue 15, "correct first").

The contract accepts caches, scales, queries and index vectors with any strides but a unit innermost one,
in any storage order of their dimensions. Each fuzz case draws a serving-shaped problem (``make_pa_case``:
scattered pages, stale table entries, NaN in every unused slot), then re-lays every tensor into a fresh
allocation with a random storage order of its leading dimensions and random padding between them, the
padding filled with a sentinel (NaN bytes, 1e30, or junk block ids). Then:

* the reference gives bit-identical output on both layouts (it reads values, not addresses);
* the Triton kernels (the interpreter on CPU) on the re-laid problem agree with the reference;
* attention leaves every byte of every re-laid cache allocation (padding included) as it was;
* ``write_kv`` on re-laid caches, with ``-1`` padding rows among the slots, writes exactly the bytes the
  reference writer writes into an identically re-laid copy: same live slots, every other byte untouched.

FUZZ_CASES (default 16) and FUZZ_SEED (default 0) widen a local run: ``FUZZ_CASES=500 pytest ...``.
"""

import os
import random

import pytest
import torch

from backend_core.tests.testing import relaid as relay
from pa_backend import REGISTRY, pa_decode, pa_prefill, write_kv
from pa_backend.cases import make_pa_case
from pa_backend.fp8 import fp8_nan_byte
from pa_backend.verify import tolerance

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
pytestmark = pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0], reason="triton not usable here")

N_CASES = int(os.environ.get("FUZZ_CASES", "16"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))
CACHES = ("key_cache", "value_cache", "key_scale", "value_scale")


def raw(alloc: torch.Tensor) -> torch.Tensor:
    """Bytes (FP8) or values with NaN made comparable."""
    if alloc.element_size() == 1:
        return alloc.view(torch.uint8).clone()
    return alloc.nan_to_num(1e30).clone() if alloc.is_floating_point() else alloc.clone()


def draw(rng: random.Random):
    """Keyword arguments of ``make_pa_case`` for one fuzz case."""
    prefill = rng.random() < 0.4
    N = rng.randint(1, 4)
    D = rng.choice([64, 64, 128])
    Hkv = rng.choice([1, 2])
    G = rng.choice([1, 2, 4, 8])
    kw = dict(Hq=G * Hkv, Hkv=Hkv, D=D, block_size=rng.choice([16, 32, 64]), v_layout=rng.choice(["4d", "5d"]),
              scales=rng.choice(["tensor", "token"]), extra_table=rng.randint(0, 4), spare_blocks=rng.randint(1, 4),
              seed=rng.randint(0, 10**6))
    if kw["v_layout"] == "5d" and kw["block_size"] % 16:
        kw["v_layout"] = "4d"
    if rng.random() < 0.25:
        kw["sliding_window"] = rng.randint(1, 60)
    if rng.random() < 0.25:
        kw["sinks"] = True
    if prefill:
        ctx = [rng.choice([0, rng.randint(1, 90)]) for _ in range(N)]
        kw["query_lengths"] = [rng.randint(1, c) if c else 0 for c in ctx]
    else:
        ql = rng.randint(1, 4)
        ctx = [rng.randint(ql, 120) for _ in range(N)]
        kw["query_length"] = ql
    kw["context_lengths"] = ctx
    return kw


CASES = [draw(random.Random(SEED * 100003 + i)) for i in range(N_CASES)]


def _ids():
    out = []
    for kw in CASES:
        out.append(f"{'pre' if 'query_lengths' in kw else 'dec'}-D{kw['D']}-G{kw['Hq'] // kw['Hkv']}-"
                   f"bs{kw['block_size']}-{kw['v_layout']}-{kw['scales']}")
    return out


@pytest.mark.parametrize("i", range(N_CASES), ids=_ids())
def test_attention_on_relaid_tensors(i):
    params = CASES[i]
    rng = random.Random(SEED * 7919 + i)
    case = make_pa_case(**params, device=DEVICE)
    kw = dict(case.kwargs)
    kw.pop("out")
    nan = fp8_nan_byte(kw["key_cache"].dtype)
    laid, allocs = dict(kw), {}
    for name in CACHES + ("query", "block_tables", "context_lengths", "query_start_loc"):
        if name not in kw:  # decode: no query_start_loc
            continue
        t = kw[name]
        if name in ("key_scale", "value_scale") and t.dim() < 3:
            continue  # per-tensor scales: a 0-dim / [1] tensor has no layout to vary
        sentinel = nan if t.element_size() == 1 else 10**6 if not t.is_floating_point() else float("nan")
        laid[name], allocs[name] = relay(t, rng, sentinel)
    fn = pa_prefill if case.prefill else pa_decode
    ref = fn(**kw, backend="torch")
    ref_laid = fn(**laid, backend="torch")
    assert torch.equal(ref.view(torch.int16), ref_laid.view(torch.int16)), case.desc
    before = {k: raw(a) for k, a in allocs.items() if k in CACHES}
    out = fn(**laid, out=torch.full_like(kw["query"], float("nan")), backend="triton")
    assert torch.isfinite(out).all(), case.desc
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err <= tolerance(DEVICE), (case.desc, err)
    for k, b in before.items():
        assert torch.equal(raw(allocs[k]), b), (case.desc, k)


@pytest.mark.parametrize("i", range(N_CASES), ids=_ids())
def test_write_kv_on_relaid_caches(i):
    params = dict(CASES[i])
    rng = random.Random(SEED * 104729 + i)
    case = make_pa_case(**params, device=DEVICE)
    kw = case.kwargs
    nan = fp8_nan_byte(kw["key_cache"].dtype)
    bs = int(kw["key_cache"].shape[3])
    NB, Hkv, D = int(kw["key_cache"].shape[0]), int(kw["key_cache"].shape[1]), 16 * int(kw["key_cache"].shape[2])
    # new tokens for some slots (distinct), -1 padding rows among them
    n = rng.randint(1, 24)
    slots = rng.sample(range(NB * bs), min(n, NB * bs))
    slots = [s if rng.random() > 0.2 else -1 for s in slots]
    g = torch.Generator().manual_seed(i)
    key = relay((torch.randn(len(slots), Hkv, D, generator=g) * 3).bfloat16().to(DEVICE), rng, float("nan"))[0]
    value = relay((torch.randn(len(slots), Hkv, D, generator=g) * 3).bfloat16().to(DEVICE), rng, float("nan"))[0]
    slot_mapping = relay(torch.tensor(slots, dtype=torch.int64, device=DEVICE), rng, 10**6)[0]
    state = random.Random(rng.random()).getstate()
    layouts = []
    for _ in range(2):  # the same re-laying twice: one copy for the reference writer, one for Triton
        r = random.Random()
        r.setstate(state)
        laid, allocs = {}, {}
        for name in CACHES:
            t = kw[name]
            if name in ("key_scale", "value_scale") and t.dim() < 3:
                laid[name] = t.clone()
                continue
            laid[name], allocs[name] = relay(t, r, nan if t.element_size() == 1 else float("nan"))
        layouts.append((laid, allocs))
    (want, want_allocs), (got, got_allocs) = layouts
    for k in want_allocs:  # the two copies start identical, byte for byte
        assert torch.equal(raw(got_allocs[k]), raw(want_allocs[k])), k
    before = raw(want_allocs["key_cache"])
    write_kv(key, value, want["key_cache"], want["value_cache"], slot_mapping, want["key_scale"], want["value_scale"],
             backend="torch")
    write_kv(key, value, got["key_cache"], got["value_cache"], slot_mapping, got["key_scale"], got["value_scale"],
             backend="triton")
    # the reference wrote something (a case is not vacuous) unless every row was padding
    assert not torch.equal(raw(want_allocs["key_cache"]), before) or all(s < 0 for s in slots)
    for k in want_allocs:
        assert torch.equal(raw(got_allocs[k]), raw(want_allocs[k])), (case.desc, k, slots)
