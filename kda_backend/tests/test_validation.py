"""Bad input raises ValueError/TypeError naming the argument, before any cache is touched."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kda_backend
from backend_core.tests.testing import CORRUPTIONS, corrupt
from kda_backend.cases import clone_caches, make_case, rel_err

from .conftest import DEVICE


def snapshot(case):
    return {k: v.clone() for k, v in case.storage.items()}


def unchanged(case, snap):
    return all(torch.equal(case.storage[k].view(torch.uint8), snap[k].view(torch.uint8)) for k in snap)


# (id, mutation of the kwargs, exception type, message fragment)
MUTATIONS = [
    # the argument that is wrong is named: a state with another H or K (x, dt_bias agree with each other), a
    # conv_weight of another width, an f_a of another rank (both arguments named: nothing says which is wrong)
    ("state-heads", lambda kw: kw.update(state=kw["state"][:, :1]), ValueError,
     "state: expected [slots, H, V, K] with H*K = 64"),
    ("state-head-dim", lambda kw: kw.update(state=kw["state"].new_zeros(kw["state"].shape[0], 2, 16, 16)), ValueError,
     "state: expected [slots, H, V, K] with H*K = 64"),
    ("cw-width", lambda kw: kw.update(conv_weight=kw["conv_weight"][:, :3]), ValueError,
     "conv_weight / conv_state: the conv width disagrees: conv_weight [3*H*K, W] = [192, 3] has W=3"),
    ("x-not-tensor", lambda kw: kw.update(x=kw["x"].tolist()), TypeError, "x: expected a torch.Tensor"),
    ("x-dtype", lambda kw: kw.update(x=kw["x"].float()), ValueError, "x: expected dtype bfloat16"),
    ("x-shape", lambda kw: kw.update(x=torch.cat([kw["x"], kw["x"][:, :1]], 1)), ValueError,
     "x: expected shape [B, 3*H*K]"),
    ("x-rank", lambda kw: kw.update(x=kw["x"][None]), ValueError, "x: expected shape"),
    ("x-stride", lambda kw: kw.update(x=torch.cat([kw["x"], kw["x"]], 1)[:, ::2]), ValueError,
     "x: expected unit stride"),
    ("state-dtype", lambda kw: kw.update(state=kw["state"].half()), ValueError,
     "state: expected dtype float32 or bfloat16"),
    ("state-rank", lambda kw: kw.update(state=kw["state"][0]), ValueError, "state: expected shape [slots, H, V, K]"),
    ("state-v-ne-k", lambda kw: kw.update(state=kw["state"][:, :, :16]), ValueError, "state: expected"),
    ("state-not-contig", lambda kw: kw.update(state=kw["state"].transpose(2, 3)), ValueError,
     "state: expected each slot contiguous"),
    ("state-overlap", lambda kw: kw.update(state=torch.as_strided(kw["state"], kw["state"].shape, (1024, 1024, 32, 1))),
     ValueError, "state: slots overlap"),
    ("idx-dtype", lambda kw: kw.update(state_indices=kw["state_indices"].float()), ValueError,
     "state_indices: expected dtype int32 or int64"),
    ("idx-shape", lambda kw: kw.update(state_indices=kw["state_indices"][:1]), ValueError,
     "state_indices: expected shape [B]"),
    ("cw-shape", lambda kw: kw.update(conv_weight=kw["conv_weight"][:-1]), ValueError,
     "conv_weight: expected shape [3*H*K, W]"),
    ("cw-dtype", lambda kw: kw.update(conv_weight=kw["conv_weight"].bfloat16()), ValueError,
     "conv_weight: expected dtype float32"),
    ("cw-width1", lambda kw: kw.update(conv_weight=kw["conv_weight"][:, :1]), ValueError,
     "conv_weight: expected conv width W >= 2"),
    ("cw-no-unit-stride", lambda kw: kw.update(conv_weight=torch.cat([kw["conv_weight"]] * 2, 1)[:, ::2]),
     ValueError, "conv_weight: expected one unit-stride axis"),
    ("cs-missing", lambda kw: kw.update(conv_state=None), TypeError, "conv_state: expected a torch.Tensor"),
    ("cs-width", lambda kw: kw.update(conv_state=kw["conv_state"][:, :, :2]), ValueError,
     "conv_weight / conv_state: the conv width disagrees"),
    ("cs-overlap", lambda kw: kw.update(conv_state=kw["conv_state"][:1].expand(kw["conv_state"].shape)), ValueError,
     "conv_state: elements overlap"),
    ("cs-dtype", lambda kw: kw.update(conv_state=kw["conv_state"].float()), ValueError,
     "conv_state: expected dtype bfloat16"),
    ("bias-shape", lambda kw: kw.update(conv_bias=torch.zeros(7, device=kw["x"].device)), ValueError,
     "conv_bias: expected shape [3*H*K]"),
    ("bias-without-conv", lambda kw: kw.update(conv_weight=None, conv_bias=torch.zeros(kw["x"].shape[1],
                                                                                       device=kw["x"].device)),
     ValueError, "conv_bias: given without conv_weight"),
    ("a-shape", lambda kw: kw.update(a=kw["a"][:, :-1]), ValueError, "a: expected shape [B, H*K]"),
    ("a-dtype", lambda kw: kw.update(a=kw["a"].float()), ValueError, "a: expected dtype bfloat16"),
    ("a-missing", lambda kw: kw.update(a=None), TypeError, "a: expected a torch.Tensor"),
    ("b-shape", lambda kw: kw.update(b=kw["b"][..., :1]), ValueError, "b: expected shape [B, H] or [1, B, H]"),
    ("A_log-shape", lambda kw: kw.update(A_log=kw["A_log"][None]), ValueError, "A_log: expected shape [H]"),
    ("dt_bias-per-head", lambda kw: kw.update(dt_bias=kw["dt_bias"][: kw["A_log"].shape[0]]), ValueError,
     "dt_bias: expected shape [H*K]"),
    ("gate-alone", lambda kw: kw.update(norm_weight=None), ValueError,
     "norm_weight: output_gate and norm_weight go together"),
    ("nw-shape", lambda kw: kw.update(norm_weight=kw["norm_weight"][:-1]), ValueError,
     "norm_weight: expected shape [V]"),
    ("gate-shape", lambda kw: kw.update(output_gate=kw["output_gate"][:, :1]), ValueError,
     "output_gate: expected shape [B, H, V]"),
    ("out-dtype", lambda kw: kw.update(out=kw["out"].float()), ValueError, "out: expected dtype bfloat16"),
    ("out-stride", lambda kw: kw.update(out=torch.cat([kw["out"]] * 2, -1)[..., ::2]), ValueError,
     "out: expected unit stride"),
    ("out-overlap", lambda kw: kw.update(out=kw["out"][:1].expand(kw["out"].shape)), ValueError,
     "out: elements overlap"),
    ("device", lambda kw: kw.update(a=kw["a"].to("meta")), ValueError, "a: expected a tensor on"),
    ("eps-negative", lambda kw: kw.update(norm_eps=-1.0), ValueError, "norm_eps: expected a positive number"),
    ("eps-nan", lambda kw: kw.update(norm_eps=float("nan")), ValueError, "norm_eps: expected a finite number"),
    ("lb-type", lambda kw: kw.update(lower_bound="-5"), TypeError, "lower_bound: expected a Python float"),
    ("lb-inf", lambda kw: kw.update(lower_bound=float("-inf")), ValueError, "lower_bound: expected a finite number"),
    ("scale-tensor", lambda kw: kw.update(scale=torch.tensor(0.1)), TypeError, "scale: expected a Python float"),
    ("backend", lambda kw: kw.update(backend="cuda-magic"), ValueError,
     "backend: 'cuda-magic' is not an implementation"),
]


F_B_MUTATIONS = [
    ("fa-rank", lambda kw: kw.update(f_a=kw["f_a"][:, :-1]), ValueError,
     "f_a / f_b_weight: the rank R disagrees: f_a [B, R] = [3, 31] has R=31"),
    ("fa-batch", lambda kw: kw.update(f_a=kw["f_a"][:1]), ValueError, "f_a: expected shape [B, R]"),
    ("fbw-shape", lambda kw: kw.update(f_b_weight=kw["f_b_weight"][:, :, :-1]), ValueError,
     "f_a / f_b_weight: the rank R disagrees"),
    ("fbw-heads", lambda kw: kw.update(f_b_weight=kw["f_b_weight"][:1]), ValueError,
     "f_b_weight: expected shape [H, K, R]"),
    ("fbw-dtype", lambda kw: kw.update(f_b_weight=kw["f_b_weight"].float()), ValueError,
     "f_b_weight: expected dtype bfloat16"),
    ("fbw-stride", lambda kw: kw.update(f_b_weight=kw["f_b_weight"].transpose(1, 2)), ValueError,
     "f_b_weight: expected"),
]


ALL_MUTATIONS = [(False, *m) for m in MUTATIONS] + [(True, *m) for m in F_B_MUTATIONS]


@pytest.mark.parametrize("with_f_b,mid,mutate,exc,msg", ALL_MUTATIONS, ids=[m[1] for m in ALL_MUTATIONS])
def test_bad_argument_raises_before_any_write(with_f_b, mid, mutate, exc, msg, impl):
    case = make_case(B=3, H=2, K=32, W=4, with_f_b=with_f_b, device=DEVICE, seed=2)
    snap = snapshot(case)
    kw = dict(case.kwargs, backend=impl)
    mutate(kw)
    fn = kda_backend.kda_decode_with_f_b if with_f_b else kda_backend.kda_decode
    with pytest.raises(exc) as info:
        fn(**kw)
    assert msg in str(info.value), str(info.value)
    assert unchanged(case, snap)
    assert torch.isnan(case.kwargs["out"]).all()


def test_int32_index_space_overflow_rejected():
    """A conv_state slot spanning more than 2**31 elements cannot be addressed with 32-bit offsets."""
    case = make_case(B=1, H=1, K=32, W=4, slots=2, device="meta")
    kw = dict(case.kwargs)
    C = kw["x"].shape[1]
    kw["conv_state"] = torch.empty_strided((2, C, 3), (2**40, 2**31, 1), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="conv_state: one slot spans .* past the int32 index space"):
        kda_backend.kda_decode(**kw, backend="torch")


def test_int32_row_span_overflow_rejected():
    case = make_case(B=2, H=1, K=32, W=4, slots=2, device="meta")
    kw = dict(case.kwargs)
    kw["output_gate"] = torch.empty_strided((2, 1, 32), (2**33, 2**32, 2**26), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="output_gate: expected unit stride"):
        kda_backend.kda_decode(**kw, backend="torch")
    kw["output_gate"] = torch.empty_strided((2, 2, 32), (2**33, 2**32, 1), dtype=torch.bfloat16, device="meta")
    kw["state"] = torch.empty((2, 2, 32, 32), device="meta")
    kw["x"] = torch.empty((2, 3 * 64), dtype=torch.bfloat16, device="meta")
    kw["a"] = torch.empty((2, 64), dtype=torch.bfloat16, device="meta")
    kw["b"] = torch.empty((2, 2), dtype=torch.bfloat16, device="meta")
    kw["A_log"] = torch.empty(2, device="meta")
    kw["dt_bias"] = torch.empty(64, device="meta")
    kw["conv_weight"] = torch.empty((192, 4), device="meta")
    kw["conv_state"] = torch.empty((2, 192, 3), dtype=torch.bfloat16, device="meta")
    kw["out"] = None
    with pytest.raises(ValueError, match="output_gate: one row spans .* past the int32 index space"):
        kda_backend.kda_decode(**kw, backend="torch")


# -- property-based: random malformed arguments -------------------------------------------------

ARGS = ["x", "conv_weight", "conv_state", "a", "b", "A_log", "dt_bias", "state", "state_indices", "output_gate",
        "norm_weight", "out", "conv_bias"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.float64]


@st.composite
def corruption(draw):
    name = draw(st.sampled_from(ARGS))
    kind = draw(st.sampled_from(CORRUPTIONS))
    dtype = draw(st.sampled_from(DTYPES))
    dim = draw(st.integers(0, 3))
    return name, kind, dtype, dim


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=corruption(), seed=st.integers(0, 2**16), conv_layout=st.sampled_from(["width", "channel"]),
       backend=st.sampled_from(["torch", "triton"]))
def test_property_malformed_arguments(c, seed, conv_layout, backend):
    if backend == "triton" and not kda_backend.REGISTRY.get("triton").is_available()[0]:
        backend = "torch"
    case = make_case(B=2, H=2, K=16 if backend == "torch" else 32, W=3, conv_layout=conv_layout, device=DEVICE,
                     seed=seed, conv_bias=True)
    twin = clone_caches(case)
    snap = snapshot(case)
    kw = dict(case.kwargs)
    corrupt(kw, *c)
    try:
        out = kda_backend.kda_decode(**kw, backend=backend)
    except (ValueError, TypeError):
        assert unchanged(case, snap), f"{c}: cache changed on error"
        return
    if c[1] == "alias":
        return  # an accepted alias overlaps two read-only inputs: any bits, no answer to compare
    # accepted: then the result must equal the reference on the same (mutated) arguments
    kw2 = dict(twin.kwargs)
    corrupt(kw2, *c)
    ref = kda_backend.kda_decode(**kw2, backend="torch")
    assert _close(out, ref), c
    for k in case.storage:
        assert _close(case.storage[k], twin.storage[k]), (c, k)


def _close(a, b):
    """Same non-finite pattern (aliased inputs can hold any bits), finite parts within 1e-2."""
    a, b = a.float(), b.float()
    fin = torch.isfinite(a)
    if not torch.equal(fin, torch.isfinite(b)) or not torch.equal(a[~fin].nan_to_num(), b[~fin].nan_to_num()):
        return False
    return rel_err(a[fin], b[fin]) < 1e-2 if fin.any() else True


def test_checks_are_memoized_on_what_they_read(monkeypatch):
    """A server's decode step repeats the same argument set layer after layer: it is checked in full once;
    the problem rebuilt from the memo is the one the full checks give; any argument that differs (another
    dtype, an overlapping output, a bad scalar) is checked again and still raises."""
    import kda_backend.contract as contract
    from backend_core.validation import CheckMemo

    calls = []
    full = contract._prepare
    monkeypatch.setattr(contract, "_CALL_MEMO", CheckMemo())  # (earlier tests' buffers)
    monkeypatch.setattr(contract, "_prepare", lambda *a, **k: calls.append(1) or full(*a, **k))
    for with_f_b in (False, True):
        case = make_case(B=3, H=2, K=32, W=4, with_f_b=with_f_b, device=DEVICE, seed=5)
        kw = dict(case.kwargs)
        kw.setdefault("a", None)
        if kw["b"].dim() == 2:  # the [1, B, H] form (vLLM's): the rebuilt problem must squeeze it too
            kw["b"] = kw["b"][None]
        calls.clear()
        first = contract.prepare(**kw, with_f_b=with_f_b)
        again = [contract.prepare(**kw, with_f_b=with_f_b) for _ in range(3)]
        assert len(calls) == 1
        assert first.b.dim() == 2
        for p in again:
            for name in ("B", "H", "K", "V", "W", "num_slots", "lower_bound", "norm_eps", "scale"):
                assert getattr(p, name) == getattr(first, name), name
            for a, b in zip(p.kernel_tensors(), first.kernel_tensors()):
                assert a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())
            assert p.kernel_strides() == first.kernel_strides()
        no_out = dict(kw, out=None)
        p1, p2 = contract.prepare(**no_out, with_f_b=with_f_b), contract.prepare(**no_out, with_f_b=with_f_b)
        assert p1.out.data_ptr() != p2.out.data_ptr() and p2.out.shape == first.out.shape  # a fresh out each call
    kw = dict(make_case(B=3, H=2, K=32, W=4, device=DEVICE, seed=6).kwargs)
    contract.prepare(**kw)
    n = len(calls)
    for bad, exc, msg in ((dict(out=kw["out"][:1].expand(kw["out"].shape)), ValueError, "out: elements overlap"),
                          (dict(x=kw["x"].float()), ValueError, "x: expected dtype bfloat16"),
                          (dict(norm_eps=-1.0), ValueError, "norm_eps: expected a positive number"),
                          (dict(scale=torch.tensor(0.1)), TypeError, "scale: expected a Python float")):
        with pytest.raises(exc, match=msg):
            contract.prepare(**dict(kw, **bad))
    assert len(calls) == n + 4 and len(contract._CALL_MEMO) == 5  # failed calls are never stored
