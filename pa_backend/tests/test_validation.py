"""Malformed pa_decode / pa_prefill / write_kv arguments raise before anything is written."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend_core.tests.testing import CORRUPTIONS, corrupt
from pa_backend import REGISTRY, pa_decode, pa_prefill, write_kv
from pa_backend.cases import make_pa_case


def base(**kw):
    return make_pa_case([5, 20], Hq=4, Hkv=2, D=64, seed=1, **kw)


def snapshot(kw):
    return {k: kw[k].view(torch.uint8).clone() if kw[k].dtype.itemsize == 1 else kw[k].clone()
            for k in ("key_cache", "value_cache", "key_scale", "value_scale")}


def unchanged(kw, snap):
    for k, v in snap.items():
        now = kw[k].view(torch.uint8) if kw[k].dtype.itemsize == 1 else kw[k]
        if not torch.equal(now.nan_to_num(), v.nan_to_num()):
            return False
    return True


DECODE_MUTATIONS = [
    ("q-dtype", lambda kw: kw.update(query=kw["query"].float()), ValueError,
     "query: expected dtype bfloat16 or float16"),
    ("q-rank", lambda kw: kw.update(query=kw["query"][0]), ValueError, "query: expected shape [tokens, Hq, D]"),
    ("q-headdim", lambda kw: kw.update(query=kw["query"][..., :32]), ValueError, "query: head dim 32 does not match"),
    ("gqa-ratio", lambda kw: kw.update(query=kw["query"][:, :3]), ValueError,
     "query: Hq=3 must be a multiple of Hkv=2"),
    ("q-rows", lambda kw: kw.update(query=kw["query"][:1]), ValueError, "query: expected 2 sequences"),
    ("ql-range", lambda kw: kw.update(query_length=5), ValueError, "query_length: expected 1..4"),
    ("ql-type", lambda kw: kw.update(query_length=1.0), TypeError, "query_length: expected an int"),
    ("kc-dtype", lambda kw: kw.update(key_cache=kw["key_cache"].float()), ValueError,
     "key_cache: expected dtype float8_e4m3fn or float8_e4m3fnuz"),
    ("kc-rank", lambda kw: kw.update(key_cache=kw["key_cache"][0]), ValueError,
     "key_cache: expected shape [num_blocks, Hkv, D/16, block_size, 16]"),
    ("kc-blocksize", lambda kw: kw.update(key_cache=kw["key_cache"][:, :, :, :8]), ValueError,
     "key_cache: block_size 8 not in"),
    ("kc-headdim", lambda kw: kw.update(key_cache=kw["key_cache"][:, :, :3]), ValueError,
     "key_cache: head dim D = 16 * 3 = 48"),
    ("kc-stride", lambda kw: kw.update(key_cache=torch.cat([kw["key_cache"]] * 2, -1)[..., ::2]), ValueError,
     "key_cache: expected unit stride"),
    ("vc-dtype", lambda kw: kw.update(value_cache=kw["value_cache"].view(torch.float8_e4m3fnuz)), ValueError,
     "value_cache: expected dtype float8_e4m3fn"),
    ("vc-shape", lambda kw: kw.update(value_cache=kw["value_cache"][:, :, :32]), ValueError,
     "value_cache: expected shape [num_blocks, Hkv, D, block_size]"),
    ("vc-rank", lambda kw: kw.update(value_cache=kw["value_cache"][0]), ValueError,
     "value_cache: expected [num_blocks, Hkv, D, block_size] or"),
    ("ks-shape", lambda kw: kw.update(key_scale=torch.ones(2)), ValueError, "key_scale: expected a per-tensor scale"),
    ("vs-dtype", lambda kw: kw.update(value_scale=kw["value_scale"].double()), ValueError,
     "value_scale: expected dtype float32"),
    ("ks-token-shape", lambda kw: kw.update(key_scale=torch.ones(3, 2, 16)), ValueError,
     "key_scale: expected shape [num_blocks, Hkv, block_size]"),
    ("bt-dtype", lambda kw: kw.update(block_tables=kw["block_tables"].long()), ValueError,
     "block_tables: expected dtype int32"),
    ("bt-rank", lambda kw: kw.update(block_tables=kw["block_tables"][0]), ValueError,
     "block_tables: expected shape [num_seqs, max_blocks]"),
    ("cl-shape", lambda kw: kw.update(context_lengths=kw["context_lengths"][:1]), ValueError,
     "context_lengths: expected shape [num_seqs]"),
    ("cl-dtype", lambda kw: kw.update(context_lengths=kw["context_lengths"].long()), ValueError,
     "context_lengths: expected dtype int32"),
    ("window", lambda kw: kw.update(sliding_window=-1), ValueError, "sliding_window: expected >= 0"),
    ("window-type", lambda kw: kw.update(sliding_window=2.5), TypeError, "sliding_window: expected an int"),
    ("sinks-shape", lambda kw: kw.update(sinks=torch.zeros(3)), ValueError, "sinks: expected shape [Hq]"),
    ("scale-neg", lambda kw: kw.update(softmax_scale=-0.1), ValueError, "softmax_scale: expected a positive number"),
    # finite in float64 but not a normal fp32 number (the kernels scale the logits in fp32)
    ("scale-fp32-overflow", lambda kw: kw.update(softmax_scale=1e39), ValueError,
     "softmax_scale: expected a normal fp32"),
    ("scale-fp32-underflow", lambda kw: kw.update(softmax_scale=1e-50), ValueError,
     "softmax_scale: expected a normal fp32"),
    ("parts", lambda kw: kw.update(num_partitions=0), ValueError, "num_partitions: expected None or an int >= 1"),
    ("out-dtype", lambda kw: kw.update(out=kw["out"].float()), ValueError, "out: expected dtype bfloat16"),
    ("out-shape", lambda kw: kw.update(out=kw["out"][:1]), ValueError, "out: expected shape the query's shape"),
    ("device", lambda kw: kw.update(block_tables=kw["block_tables"].to("meta")), ValueError,
     "block_tables: expected a tensor on"),
    ("q-missing", lambda kw: kw.update(query=None), TypeError, "query: expected a torch.Tensor"),
    ("backend", lambda kw: kw.update(backend="magic"), ValueError, "backend: 'magic' is not an implementation"),
]


@pytest.mark.parametrize("mid,mutate,exc,msg", DECODE_MUTATIONS, ids=[m[0] for m in DECODE_MUTATIONS])
def test_bad_decode_argument(mid, mutate, exc, msg):
    case = base()
    kw = dict(case.kwargs)
    snap = snapshot(kw)
    kw.setdefault("backend", "torch")
    mutate(kw)
    with pytest.raises(exc) as info:
        pa_decode(**kw)
    assert msg in str(info.value), str(info.value)
    assert unchanged(case.kwargs, snap)
    assert torch.isnan(case.kwargs["out"]).all()


def test_bad_prefill_query_start_loc():
    case = make_pa_case([5, 20], query_lengths=[2, 3], seed=2)
    kw = dict(case.kwargs)
    with pytest.raises(ValueError, match=r"query_start_loc: expected shape \[num_seqs \+ 1\]"):
        pa_prefill(**dict(kw, query_start_loc=kw["query_start_loc"][:2]))
    with pytest.raises(TypeError, match="query_start_loc: expected a torch.Tensor"):
        pa_prefill(**dict(kw, query_start_loc=None))


def test_context_longer_than_its_table_row_raises_in_the_reference():
    case = base(extra_table=0)
    kw = dict(case.kwargs, context_lengths=torch.tensor([5, 10_000], dtype=torch.int32))
    with pytest.raises(ValueError, match="context_lengths: sequence 1 has 10000 tokens"):
        pa_decode(**kw, backend="torch")


WRITE_MUTATIONS = [
    ("key-dtype", lambda kw: kw.update(key=kw["key"].float()), ValueError, "key: expected dtype bfloat16 or float16"),
    ("key-heads", lambda kw: kw.update(key=kw["key"][:, :1]), ValueError, "key: expected shape [tokens, Hkv, D]"),
    ("value-dtype", lambda kw: kw.update(value=kw["value"].half()), ValueError, "value: expected dtype bfloat16"),
    ("slots-shape", lambda kw: kw.update(slot_mapping=kw["slot_mapping"][:1]), ValueError,
     "slot_mapping: expected shape [tokens]"),
    ("slots-dtype", lambda kw: kw.update(slot_mapping=kw["slot_mapping"].float()), ValueError,
     "slot_mapping: expected dtype int32 or int64"),
    ("cache-dtype", lambda kw: kw.update(key_cache=kw["key_cache"].view(torch.int8)), ValueError,
     "key_cache: expected dtype"),
]


@pytest.mark.parametrize("mid,mutate,exc,msg", WRITE_MUTATIONS, ids=[m[0] for m in WRITE_MUTATIONS])
def test_bad_write_argument(mid, mutate, exc, msg):
    case = base()
    c = case.kwargs
    snap = snapshot(c)
    kw = dict(key=torch.randn(3, 2, 64).bfloat16(), value=torch.randn(3, 2, 64).bfloat16(), key_cache=c["key_cache"],
              value_cache=c["value_cache"], slot_mapping=torch.tensor([1, 2, 3]), key_scale=c["key_scale"],
              value_scale=c["value_scale"])
    mutate(kw)
    with pytest.raises(exc) as info:
        write_kv(**kw, backend="torch")
    assert msg in str(info.value), str(info.value)
    assert unchanged(c, snap)


ARGS = ["query", "key_cache", "value_cache", "block_tables", "context_lengths", "key_scale", "value_scale", "sinks",
        "out"]
HAS_TRITON = REGISTRY.supported_on("triton", "cpu")  # the draws' cases are CPU tensors: the interpreter only


@st.composite
def corruption(draw, args):
    return (draw(st.sampled_from(args)),
            draw(st.sampled_from(CORRUPTIONS)),
            draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.float8_e4m3fn,
                                  torch.uint8])),
            draw(st.integers(0, 4)))


def _backend(name):
    return name if name == "torch" or HAS_TRITON else "torch"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=corruption(ARGS + ["query_start_loc"]), seed=st.integers(0, 2**16),
       scales=st.sampled_from(["tensor", "token"]),
       v_layout=st.sampled_from(["4d", "5d"]), prefill=st.booleans(), backend=st.sampled_from(["torch", "triton"]))
def test_property_malformed_arguments(c, seed, scales, v_layout, prefill, backend):
    """Malformed, strided and aliased arguments: a ValueError/TypeError with the cache unchanged, or
    the reference's answer on the same arguments (strided views are read through their strides)."""
    backend = _backend(backend)

    def make():
        return make_pa_case([3, 17], query_lengths=[2, 3] if prefill else None, Hq=4, Hkv=2, D=64, scales=scales,
                            v_layout=v_layout, seed=seed, sinks=True)

    case = make()
    kw = dict(case.kwargs)
    snap = snapshot(kw)
    corrupt(kw, *c)
    fn = pa_prefill if prefill else pa_decode
    try:
        out = fn(**kw, backend=backend)
    except (ValueError, TypeError):
        assert unchanged(case.kwargs, snap), c
        return
    assert unchanged(case.kwargs, snap), c  # attention never writes the cache
    assert out.shape == kw["query"].shape, c
    if c[1] != "strided":
        return  # other accepted corruptions (an aliased read-only input, ...) may hold any bits: no answer to compare
    twin = dict(make().kwargs)
    corrupt(twin, *c)
    ref = fn(**dict(twin, out=None), backend="torch")
    assert torch.equal(out.isnan(), ref.isnan()), c
    assert (out.float() - ref.float()).nan_to_num().abs().max() <= 0.02 * ref.float().nan_to_num().abs().max() + 1e-3, c


WRITE_ARGS = ["key", "value", "key_cache", "value_cache", "slot_mapping", "key_scale", "value_scale"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=corruption(WRITE_ARGS), seed=st.integers(0, 2**16), scales=st.sampled_from(["tensor", "token"]),
       backend=st.sampled_from(["torch", "triton"]))
def test_property_malformed_write_arguments(c, seed, scales, backend):
    backend = _backend(backend)

    def make():
        case = make_pa_case([3, 17], Hq=4, Hkv=2, D=64, scales=scales, seed=seed)
        cw = case.kwargs
        g = torch.Generator().manual_seed(seed)
        free = [b for b in range(cw["key_cache"].shape[0]) if b not in case.used_blocks]
        return dict(key=torch.randn(3, 2, 64, generator=g).bfloat16(), value=torch.randn(3, 2, 64,
                                                                                         generator=g).bfloat16(),
                    key_cache=cw["key_cache"], value_cache=cw["value_cache"],
                    slot_mapping=torch.tensor([free[0] * 16 + 1, -1, free[1] * 16 + 5]), key_scale=cw["key_scale"],
                    value_scale=cw["value_scale"])

    orig = make()
    snap = snapshot(orig)
    kw = dict(orig)
    corrupt(kw, *c)
    try:
        write_kv(**kw, backend=backend)
    except (ValueError, TypeError):
        assert unchanged(orig, snap), c
        return
    twin = make()
    corrupt(twin, *c)
    write_kv(**twin, backend="torch")
    for k in ("key_cache", "value_cache", "key_scale", "value_scale"):
        a, b = kw[k], twin[k]
        if a.element_size() == 1:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (c, k)
        else:
            assert torch.equal(a.nan_to_num(1e30), b.nan_to_num(1e30)), (c, k)
