"""Differential fuzz of the KDA decode contract's layout freedom ("correct first").

The contract takes ``conv_state`` and ``b`` with any strides, ``conv_weight`` with either axis unit-stride,
``x`` / ``a`` / ``f_a`` / ``output_gate`` / ``out`` with any row strides, ``state`` with any slot stride and
``state_indices`` with any stride. Each case draws a call (``make_case``: padding and out-of-range rows,
sentinel-filled unused slots), then re-lays those tensors into fresh allocations with a random storage
order (where the contract allows it) and random padding holding a sentinel. Then:

* the reference gives bit-identical output and caches on both layouts;
* the Triton kernel (the interpreter on CPU) on the re-laid call agrees with the reference: output and
  live state within the verify tolerances, live conv windows exact, padding rows zero;
* every cache byte outside the live slots' views (other slots, padding between elements) is unchanged.

FUZZ_CASES (default 12) and FUZZ_SEED widen a local run.
"""

import os
import random

import pytest
import torch

from backend_core.tests.testing import relaid as relay
from kda_backend import REGISTRY
from kda_backend.cases import SENTINEL, make_case, rel_err
from kda_backend.verify import tolerances

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0], reason="triton not usable here")

N_CASES = int(os.environ.get("FUZZ_CASES", "12"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))


# name -> how the contract lets it be laid out
RULES = {"x": {}, "a": {}, "f_a": {}, "output_gate": {}, "b": {"any_order": True}, "conv_state": {"any_order": True},
         "state": {"slot_only": True}, "state_indices": {}, "out": {}}


def draw(rng: random.Random):
    B = rng.randint(1, 5)
    rows = list(range(B))
    rng.shuffle(rows)
    n_pad = rng.randint(0, min(2, B - 1))
    return dict(B=B, H=rng.choice([1, 2, 3]), K=rng.choice([32, 32, 64]), W=rng.choice([2, 3, 4]),
                state_dtype=rng.choice([torch.float32, torch.bfloat16]), conv=rng.random() < 0.8,
                conv_layout=rng.choice(["width", "channel"]), conv_bias=rng.random() < 0.3, norm=rng.random() < 0.7,
                with_f_b=rng.random() < 0.3, lower_bound=rng.choice([None, -5.0]),
                padding=rows[:n_pad], out_of_range=rows[n_pad:n_pad + rng.randint(0, 1)] if B > n_pad + 1 else [],
                seed=rng.randint(0, 10**6))


CASES = [draw(random.Random(SEED * 100003 + i)) for i in range(N_CASES)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def relaid_call(case, rng_state):
    """The case's kwargs with the RULES tensors re-laid (the same layout for the same ``rng_state``);
    returns (kwargs, {name: (view, allocation)})."""
    rng = random.Random()
    rng.setstate(rng_state)
    kw, laid = dict(case.kwargs), {}
    for name, rule in RULES.items():
        t = kw.get(name)
        if t is None:
            continue
        if name == "b":
            t = t[0]  # [1, B, H] -> [B, H]
        if name == "out":
            t = torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)
        sentinel = SENTINEL if t.is_floating_point() else 10**6
        if name == "state_indices":
            sentinel = 0  # a stray read of the gap would address slot 0 (live): it must not happen
        view, alloc = relay(t, rng, sentinel, **rule)
        kw[name], laid[name] = view, (view, alloc)
    if kw.get("conv_weight") is not None and rng.random() < 0.5:  # width-major storage of the taps
        kw["conv_weight"] = kw["conv_weight"].t().contiguous().t()
    return kw, laid


def live_mask(view, alloc, slots):
    """A boolean mask over ``alloc`` marking the elements of ``view[slots]``."""
    mask = torch.zeros(alloc.shape, dtype=torch.bool, device=alloc.device)
    mview = torch.as_strided(mask, view.shape, view.stride(), view.storage_offset() - alloc.storage_offset())
    if slots:
        mview[slots] = True
    return mask


@pytest.mark.parametrize("i", range(N_CASES))
def test_kda_on_relaid_tensors(i):
    from kda_backend import kda_decode, kda_decode_with_f_b

    params = CASES[i]
    case = make_case(**params, device=DEVICE)
    fn = kda_decode_with_f_b if case.with_f_b else kda_decode
    state0 = random.Random(SEED * 7919 + i).getstate()
    runs = {}
    for impl in ("ref-plain", "torch", "triton"):
        if impl == "ref-plain":  # the case's own layout, fresh caches
            kw = dict(case.kwargs)
            for name in ("state", "conv_state"):
                if kw.get(name) is not None:
                    kw[name] = kw[name].clone()
            kw["out"] = torch.full_like(kw["out"], float("nan"))
            laid = {}
        else:
            kw, laid = relaid_call(case, state0)
        before = {n: laid[n][1].clone() for n in ("state", "conv_state") if n in laid}
        out = fn(**kw, backend="torch" if impl == "ref-plain" else impl)
        runs[impl] = (kw, laid, before, out)
    (kp, _, _, out_p), (kr, lr, br, out_r), (kt, lt, bt, out_t) = runs["ref-plain"], runs["torch"], runs["triton"]
    live, slots = case.live_rows, case.live_slots
    # the reference does not depend on the layout
    assert torch.equal(_bits(out_p), _bits(out_r)), case.desc
    for name in ("state", "conv_state"):
        if kp.get(name) is not None:
            assert torch.equal(_bits(kp[name]), _bits(kr[name])), (case.desc, name)
    # Triton against it
    tol = tolerances(params["state_dtype"])
    assert rel_err(out_t[live], out_r[live]) <= tol["out_tol"] if live else True, case.desc
    dead = [n for n in range(params["B"]) if n not in live]
    assert bool((out_t[dead] == 0).all()), case.desc
    if slots:
        assert rel_err(kt["state"][slots], kr["state"][slots]) <= tol["state_tol"], case.desc
        if kt.get("conv_state") is not None:
            assert torch.equal(_bits(kt["conv_state"][slots]), _bits(kr["conv_state"][slots])), case.desc
    # nothing outside the live slots' views changed, for either implementation
    for laid_, before in ((lr, br), (lt, bt)):
        for name, b in before.items():
            view, alloc = laid_[name]
            keep = ~live_mask(view, alloc, slots)
            assert torch.equal(_bits(alloc)[keep], _bits(b)[keep]), (case.desc, name)
