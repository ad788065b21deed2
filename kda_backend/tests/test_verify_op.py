"""The speculative-verify op ``kda_verify``: every implementation against the float64 reference (both
destination forms, T = 1..8, ragged T, accepted offsets, chain and tree, both state dtypes, the safe gate,
f_b, padding), the invariant that keeping the first k tokens equals k ``kda_decode`` steps, tree tokens
equal decoding their ancestor path, H up to 96, and bad input rejected before anything is written."""

import pytest
import torch

from kda_backend import kda_decode, kda_verify
from kda_backend.cases import clone_verify, compare_verify, make_case, make_verify_case
from kda_backend.reference import run_verify_reference
from kda_backend.verify import tolerances

from .conftest import DEVICE

FAST = [
    dict(B=2, H=2, T=1),
    dict(B=3, H=2, T=4, accepted=[1, 4, 2], padding=[1]),
    dict(B=3, H=2, T=3, accepted=[2, 0, 3]),  # accepted count 0: padding
    dict(B=3, H=1, T=4, lengths=[2, 0, 4], extra_rows=2, conv_layout="channel"),
    dict(B=2, H=2, T=3, state_dtype=torch.bfloat16, with_f_b=True, R=24, lower_bound=-5.0),
    dict(B=2, H=1, T=2, W=2, conv_bias=True, norm=False, K=64),
    dict(B=2, H=2, T=3, conv=False, norm=False),
    dict(B=3, H=2, T=4, form="buffer", padding=[0]),
    dict(B=3, H=1, T=5, form="buffer", tree=True, state_dtype=torch.bfloat16),
    dict(B=2, H=2, T=4, form="buffer", tree=True, W=3, lengths=[4, 3], conv_layout="channel", lower_bound=-3.0),
    dict(B=2, H=1, T=3, form="buffer", conv=False, with_f_b=True, R=40),
    dict(B=2, H=2, T=3, accepted=[3, 2], lengths=[3, 2], index_dtype=torch.int64),
    dict(B=2, H=2, T=3, form="buffer", tree=True, lengths=[2, 3], index_dtype=torch.int64),
]

SLOW = [dict(B=3, H=2, T=T, form=form, state_dtype=sd, accepted=[T, 1, (T + 1) // 2] if form == "slot" else None,
             tree=form == "buffer" and T > 2, lengths=[T, max(T - 1, 0), 1])
        for T in range(1, 9) for form in ("slot", "buffer") for sd in (torch.float32, torch.bfloat16)]


def _check(params, impl, seed):
    case = make_verify_case(**params, device=DEVICE, seed=seed)
    ref = clone_verify(case)
    run_verify_reference(ref.problem(), compute_dtype=torch.float64)
    run = clone_verify(case)
    run.call(impl)
    res = compare_verify(run, ref, case, **tolerances(params.get("state_dtype", torch.float32)))
    assert res["ok"], (case.desc, res)


@pytest.mark.parametrize("i", range(len(FAST)))
def test_verify_matches_float64_reference(impl, i):
    _check(FAST[i], impl, seed=i)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SLOW)))
def test_verify_every_T_matches_float64_reference(impl, i):
    _check(SLOW[i], impl, seed=100 + i)


def test_comparison_catches_a_wrong_state():
    """The comparison the tests rely on fails when one step's state, or a slot nobody should write, differs."""
    case = make_verify_case(B=2, H=1, T=3, device=DEVICE, seed=3)
    ref = clone_verify(case)
    run_verify_reference(ref.problem())
    tol = tolerances(torch.float32)
    bad = clone_verify(ref)
    slot = int(case.kwargs["state_indices"][0, 1])
    bad.kwargs["state"][slot] *= 1.01
    assert not compare_verify(bad, ref, case, **tol)["ok"]
    stray = clone_verify(ref)
    used = set(case.kwargs["state_indices"].flatten().tolist())
    spare = next(s for s in range(case.kwargs["state"].shape[0]) if s not in used)
    stray.kwargs["state"][spare, 0, 0, 0] = 0.0
    assert not compare_verify(stray, ref, case, **tol)["ok"]


def _decode_steps(case, k_max, impl):
    """Run ``kda_decode`` token by token on a copy of ``case``'s caches; yields (k, out rows, state, conv window)
    after each step, per live request, in the layout kda_decode uses."""
    kw = case.kwargs
    x = kw["x"]
    B = kw["state_indices"].shape[0]
    T = x.shape[0] // B
    state = kw["state"].clone()
    buffer_form = kw.get("step_state") is not None
    slot = kw["state_indices"] if buffer_form else kw["state_indices"][:, 0]
    conv = kw["conv_state"]
    W = kw["conv_weight"].shape[1] if conv is not None else 0
    conv = conv[:, :, :W - 1].clone() if conv is not None else None  # the window at offset 0 (accepted = 1)
    for k in range(k_max):
        rows = [n * T + k for n in range(B)]
        a = kw.get("a")
        out = kda_decode(x[rows].contiguous(), kw["conv_weight"], conv, a[rows].contiguous() if a is not None else None,
                         kw["b"][0][rows].contiguous(), kw["A_log"], kw["dt_bias"], state, slot,
                         kw["output_gate"][rows].contiguous(), kw["norm_weight"], lower_bound=kw.get("lower_bound"),
                         backend=impl)
        yield k, out, state, conv, slot


@pytest.mark.parametrize("form", ["slot", "buffer"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_keeping_k_tokens_equals_k_decode_steps(impl, form, state_dtype):
    """The state and conv window the next call reads after accepting k tokens, and the first k output rows,
    are what k ``kda_decode`` steps give (bit for bit in the reference, within tolerance in a kernel)."""
    T = 5 if impl == "torch" else 4
    case = make_verify_case(B=2, H=2, T=T, form=form, state_dtype=state_dtype, lower_bound=-4.0, device=DEVICE,
                            seed=11)
    run = clone_verify(case)
    run.call(impl)
    kw = run.kwargs
    exact = impl == "torch"
    for k, out, state, conv, slot in _decode_steps(clone_verify(case), T, impl):
        for n in range(2):
            if form == "slot":
                got_state = kw["state"][int(kw["state_indices"][n, k])]
                got_conv = kw["conv_state"][int(kw["state_indices"][n, 0]), :, k:k + 3]  # read at offset k
            else:
                row = int(kw["step_state_indices"][n])
                got_state = kw["step_state"][row, k]
                got_conv = kw["step_conv_state"][row, k]
            want_state = state[int(slot[n])]
            assert torch.equal(got_conv, conv[int(slot[n])]), (k, n)
            got_out = kw["out"][n * T + k]
            if exact:
                assert torch.equal(got_state, want_state), (k, n)
                assert torch.equal(got_out, out[n]), (k, n)
            else:
                tol = 1e-5 if state_dtype == torch.float32 else 1e-2
                assert (got_state.double() - want_state.double()).norm() <= tol * want_state.double().norm(), (k, n)
                assert (got_out.double() - out[n].double()).norm() <= 1e-2 * out[n].double().norm(), (k, n)


def test_tree_token_equals_decoding_its_path(impl):
    """In a tree every token's state and output are those of decoding its ancestor path from the root."""
    T = 6
    case = make_verify_case(B=1, H=1, T=T, form="buffer", tree=True, device=DEVICE, seed=5)
    par = case.kwargs["parent_indices"][0].tolist()
    assert any(par[t] != t - 1 for t in range(1, T)), "the tree is a chain: pick another seed"
    run = clone_verify(case)
    run.call(impl)
    kw = case.kwargs
    row = int(kw["step_state_indices"][0])
    W = kw["conv_weight"].shape[1]
    for t in range(T):
        path = [t]
        while path[-1] > 0:
            path.append(par[path[-1]])
        path.reverse()
        state = kw["state"].clone()
        conv = kw["conv_state"].clone()
        for j in path:
            out = kda_decode(kw["x"][j:j + 1], kw["conv_weight"], conv, kw["a"][j:j + 1], kw["b"][0][j:j + 1],
                             kw["A_log"], kw["dt_bias"], state, kw["state_indices"], kw["output_gate"][j:j + 1],
                             kw["norm_weight"], backend="torch")
        s = int(kw["state_indices"][0])
        got = run.kwargs["step_state"][row, t]
        assert (got.double() - state[s].double()).norm() <= 1e-5 * state[s].double().norm(), t
        assert torch.equal(run.kwargs["step_conv_state"][row, t], conv[s, :, :W - 1]), t
        assert (run.kwargs["out"][t].double() - out[0].double()).norm() <= 1e-2 * out[0].double().norm(), t


@pytest.mark.parametrize("op", ["decode", "verify"])
def test_96_heads(impl, op):
    """K3 at TP1 runs 96 KDA heads: both ops take them (the Triton grids put heads on an axis up to 65535)."""
    if op == "decode":
        from kda_backend.cases import clone_caches, compare_runs
        from kda_backend.reference import run_reference

        case = make_case(B=1, H=96, K=32, W=4, device=DEVICE, seed=7)
        ref = clone_caches(case)
        run_reference(ref.problem(), compute_dtype=torch.float64)
        run = clone_caches(case)
        run.call(impl)
        res = compare_runs(run, ref, case, **tolerances(torch.float32))
    else:
        _check(dict(B=1, H=96, T=2, K=32, accepted=[2]), impl, seed=8)
        return
    assert res["ok"], res


def test_memoized_checks_rebuild_the_same_problem():
    case = make_verify_case(B=2, H=1, T=3, form="buffer", tree=True, device=DEVICE, seed=2)
    p1 = case.problem()
    p2 = case.problem()  # the memo's path
    for f in ("B", "T", "N", "H", "K", "V", "W", "num_slots", "num_rows", "scale", "norm_eps", "lower_bound"):
        assert getattr(p1, f) == getattr(p2, f), f
    for f in ("state_indices", "step_state", "step_state_indices", "step_conv_state", "parent_indices", "x", "b"):
        assert getattr(p2, f) is getattr(p1, f) or torch.equal(getattr(p1, f), getattr(p2, f)), f


# -- bad input: ValueError/TypeError naming the argument, nothing written ----------------------------------------

def _alias_step_state_with_state(kw):
    """state and step_state as overlapping views of one buffer."""
    st, ss = kw["state"], kw["step_state"]
    big = torch.zeros(st.numel() + ss.numel(), dtype=st.dtype, device=st.device)
    big[:st.numel()].copy_(st.flatten())
    kw["state"] = big[:st.numel()].view(st.shape)
    kw["step_state"] = big[st.numel() // 2:st.numel() // 2 + ss.numel()].view(ss.shape)


def _bad_calls():
    def slot_case():
        return make_verify_case(B=2, H=1, T=3, device=DEVICE, seed=1)

    def buf_case():
        return make_verify_case(B=2, H=1, T=3, form="buffer", device=DEVICE, seed=1)

    dev = DEVICE
    yield "state_indices", slot_case, lambda kw: kw.update(state_indices=kw["state_indices"][:, 0])
    yield "state_indices", buf_case, lambda kw: kw.update(state_indices=kw["state_indices"][:, None])
    yield "state_indices", slot_case, lambda kw: kw.update(state_indices=kw["state_indices"].float())
    yield "state_indices", slot_case, lambda kw: kw.update(
        state_indices=torch.zeros(1, 9, dtype=torch.int32, device=dev), x=kw["x"][:1].expand(9, -1).contiguous())
    yield "conv_state", slot_case, lambda kw: kw.update(conv_state=kw["conv_state"][:, :, :3])
    yield "num_accepted_tokens", slot_case, lambda kw: kw.update(
        num_accepted_tokens=torch.ones(3, dtype=torch.int32, device=dev))
    yield "num_accepted_tokens", buf_case, lambda kw: kw.update(
        num_accepted_tokens=torch.ones(2, dtype=torch.int32, device=dev))
    yield "parent_indices", slot_case, lambda kw: kw.update(
        parent_indices=torch.zeros(2, 3, dtype=torch.int32, device=dev))
    yield "parent_indices", buf_case, lambda kw: kw.update(
        parent_indices=torch.zeros(2, 4, dtype=torch.int32, device=dev))
    yield "step_state", buf_case, lambda kw: kw.update(step_state=kw["step_state"].to(torch.bfloat16))
    yield "step_state", buf_case, lambda kw: kw.update(step_state=kw["step_state"].transpose(3, 4))
    yield "step_state_indices", buf_case, lambda kw: kw.update(step_state_indices=None)
    yield "step_conv_state", buf_case, lambda kw: kw.update(step_conv_state=None)
    yield "step_conv_state", buf_case, lambda kw: kw.update(step_conv_state=kw["step_conv_state"][:, :2])
    yield "step_state", buf_case, _alias_step_state_with_state
    yield "query_start_loc", slot_case, lambda kw: kw.update(
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32, device=dev))
    yield "x", slot_case, lambda kw: kw.update(x=kw["x"][:5])
    yield "out", slot_case, lambda kw: kw.update(out=kw["out"][:5])
    yield "a", slot_case, lambda kw: kw.update(a=kw["a"][:5])
    yield "conv_bias", slot_case, lambda kw: kw.update(conv_weight=None, conv_state=None,
                                                       conv_bias=torch.zeros(96, device=dev))


@pytest.mark.parametrize("name,make,mutate", list(_bad_calls()))
def test_bad_input_names_the_argument_and_writes_nothing(name, make, mutate):
    case = make()
    before = {k: v.clone() for k, v in case.storage.items()}
    kw = dict(case.kwargs)
    mutate(kw)
    with pytest.raises((ValueError, TypeError)) as err:
        kda_verify(**kw)
    assert str(err.value).startswith(name), str(err.value)
    for k, v in case.storage.items():
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), k
