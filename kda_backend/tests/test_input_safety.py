"""KDA decode inputs the validation accepts never make a kernel touch the wrong memory (issue 14):
strided index vectors are read through their strides, outputs and in-place caches that overlap any
other argument are rejected before anything is written, meta tensors raise ValueError."""

import pytest
import torch

import kda_backend
from kda_backend.cases import clone_caches, make_case

from .conftest import DEVICE


def snapshot(case):
    return {k: v.clone() for k, v in case.storage.items()}


def unchanged(case, snap):
    return all(torch.equal(case.storage[k].view(torch.uint8), snap[k].view(torch.uint8)) for k in snap)


def test_strided_state_indices(impl):
    case = make_case(B=4, H=2, K=32, W=4, padding=[2], device=DEVICE, seed=5)
    twin = clone_caches(case)
    idx = case.kwargs["state_indices"]
    # the skipped elements name live slot 0: a kernel ignoring the stride would update it twice
    wide = torch.stack([idx, torch.zeros_like(idx)], 1).reshape(-1)[::2]
    assert wide.stride(0) == 2 and torch.equal(wide, idx)
    got = case.call(impl, state_indices=wide)
    want = twin.call(impl)
    assert torch.equal(got, want)
    for k in case.storage:
        assert torch.equal(case.storage[k].view(torch.uint8), twin.storage[k].view(torch.uint8)), k


@pytest.mark.parametrize("target", ["state", "conv_state"])
def test_out_over_a_cache_is_rejected(impl, target):
    case = make_case(B=2, H=2, K=32, W=4, conv_layout="channel", device=DEVICE, seed=1)
    snap = snapshot(case)
    buf = case.storage[target]
    out = buf.view(torch.uint8).reshape(-1)[:case.kwargs["out"].numel() * 2].view(torch.bfloat16)
    out = out.view(case.kwargs["out"].shape)
    with pytest.raises(ValueError, match=f"out: shares memory with {target}"):
        case.call(impl, out=out)
    assert unchanged(case, snap)


def test_state_over_conv_state_is_rejected(impl):
    case = make_case(B=2, H=2, K=32, W=4, state_dtype=torch.bfloat16, conv_layout="channel", device=DEVICE, seed=1)
    snap = snapshot(case)
    st = case.kwargs["state"]
    cs = case.kwargs["conv_state"]
    # conv_state laid over the state's first slots (both bf16)
    bad = torch.as_strided(st, cs.shape, (st.stride(0), cs.shape[2], 1), st.storage_offset())
    with pytest.raises(ValueError, match="state: shares memory with conv_state"):
        case.call(impl, conv_state=bad)
    with pytest.raises(ValueError, match="state: shares memory with x"):
        case.call(impl, x=st.reshape(-1)[:case.kwargs["x"].numel()].view(case.kwargs["x"].shape))
    assert unchanged(case, snap)


def test_in_place_reads_are_rejected(impl):
    """Inputs read from a cache the call writes (output_gate over out, state_indices over conv_state)."""
    case = make_case(B=2, H=2, K=32, W=4, device=DEVICE, seed=3)
    snap = snapshot(case)
    with pytest.raises(ValueError, match="out: shares memory with output_gate"):
        case.call(impl, output_gate=case.kwargs["out"])
    cs_bytes = case.storage["conv_state"].view(torch.uint8).reshape(-1)
    with pytest.raises(ValueError, match="conv_state: shares memory with state_indices"):
        case.call(impl, state_indices=cs_bytes[:8].view(torch.int32))
    assert unchanged(case, snap)


def test_conv_and_state_side_by_side_in_one_page_are_accepted(impl):
    """vLLM's mamba pages: a slot's conv state and recurrent state share one page (interleaved
    extents, disjoint bytes): accepted, and the result equals separate buffers."""
    case = make_case(B=3, H=2, K=32, W=4, conv_layout="width", device=DEVICE, seed=4)
    twin = clone_caches(case)
    st, cs = case.kwargs["state"], case.kwargs["conv_state"]
    slots, C = st.shape[0], cs.shape[1]
    conv_bytes, state_bytes = 3 * C * 2, st[0].numel() * 4
    page = torch.zeros(slots, conv_bytes + state_bytes + 64, dtype=torch.uint8, device=DEVICE)
    pc = page[:, :conv_bytes].view(torch.bfloat16).view(slots, 3, C)
    ps = page[:, conv_bytes:conv_bytes + state_bytes].view(torch.float32).view(st.shape)
    pc.copy_(cs.transpose(1, 2))
    ps.copy_(st)
    got = case.call(impl, conv_state=pc.transpose(1, 2), state=ps)
    want = twin.call(impl)
    assert torch.equal(got, want)
    assert torch.equal(ps, twin.kwargs["state"]) and torch.equal(pc.transpose(1, 2), twin.kwargs["conv_state"])


def test_meta_tensors_raise_value_error():
    case = make_case(B=2, H=1, K=32, W=4, device="meta")
    with pytest.raises(ValueError, match="x: expected a tensor with data, got one on the meta device"):
        kda_backend.kda_decode(**case.kwargs, backend="torch")


def test_sglang_packed_decode_converts_bf16_gate_parameters():
    """SGLang models may keep A_log / dt_bias in bf16: the adapter converts them (as on the K3
    paths) instead of failing the op's fp32 check; the result equals fp32 parameters that hold the
    same values."""
    from kda_backend.sglang import _packed_decode

    case = make_case(B=3, H=2, K=32, W=4, conv=False, norm=False, device=DEVICE, seed=6)
    twin = clone_caches(case)
    kw = case.kwargs
    A16, dt16 = kw["A_log"].bfloat16(), kw["dt_bias"].bfloat16()
    args = dict(scale=32 ** -0.5, state_indices=kw["state_indices"], num_v_heads=2, head_v_dim=32, backend="torch")
    got = _packed_decode(kw["x"], kw["a"], kw["b"], A_log=A16, dt_bias=dt16, ssm_states=kw["state"], **args)
    tk = twin.kwargs
    want = _packed_decode(tk["x"], tk["a"], tk["b"], A_log=A16.float(), dt_bias=dt16.float(),
                          ssm_states=tk["state"], **args)
    assert torch.equal(got, want)


def test_sglang_conv_weight_cache_follows_the_tensors():
    """The fused-decode path's [C, W] conv weight is built once per weight set, rebuilt after an
    in-place reload or with other tensors, and freed with the layer's tensor (no address keys:
    a new tensor at a reused address must not get a stale weight)."""
    import gc

    from kda_backend import sglang as ks

    q, k, v = torch.ones(4, 3), torch.ones(4, 2), torch.ones(4, 3)
    w = ks._cuda_conv_weight(q, k, v)
    assert w.shape == (8, 4) and ks._cuda_conv_weight(q, k, v) is w
    q.add_(1)  # weights reloaded in place
    w2 = ks._cuda_conv_weight(q, k, v)
    assert w2 is not w and (w2[:3] == 2).all()
    assert (ks._cuda_conv_weight(q, torch.zeros(4, 2), v)[3:5] == 0).all()
    n = len(ks._cuda_conv_weight_cache)
    del q
    gc.collect()
    assert len(ks._cuda_conv_weight_cache) == n - 1


def test_b_head_offsets_past_int32(impl):
    """``b`` is taken with any strides: a head stride of 2^30 elements puts head 2 at 2^31, which the Triton
    kernel's int32 head term wrapped to 4 GiB before ``b`` (it read a stray beta there and updated the state
    with it). The buffer behind ``b`` is 8 GiB of virtual memory, a few pages touched."""
    case = make_case(B=1, H=3, K=32, W=4, device=DEVICE, seed=7)
    b = case.kwargs["b"]
    base = torch.empty(2**32 + 16, dtype=b.dtype, device=DEVICE)
    base[:16] = 10.0  # where the wrapped offset of head 2 lands
    wide = base[2**31:].as_strided(tuple(b.shape), (int(b.shape[-1]) if b.dim() > 1 else 1,) * (b.dim() - 1)
                                   + (2**30,))
    wide.copy_(b)
    twin = clone_caches(case)
    got = case.call(impl, b=wide)
    want = twin.call(impl, b=b.clone())
    assert torch.equal(got, want)
    for k in case.storage:
        assert torch.equal(case.storage[k].view(torch.uint8), twin.storage[k].view(torch.uint8)), k


def test_flydsl_declines_byte_spans_past_int32():
    """The own FlyDSL kernel's buffer accesses take 32-bit byte offsets from each base: a layout the contract
    accepts (its spans are bounded in elements) but whose fp32 conv_weight spans more than 2^31 bytes is
    declined with the reason, so ``auto`` serves it elsewhere and ``backend="flydsl"`` raises before any launch.
    Runs without FlyDSL or a GPU (coverage only); the kernel itself has never run here (no AMD GPU)."""
    from kda_backend import contract
    from kda_backend.flydsl import kernel

    case = make_case(B=1, H=3, K=128, W=4, device=DEVICE, seed=3)
    kw = dict(case.kwargs)
    kw.setdefault("a", None)
    assert kernel.supports(contract.prepare(**kw, with_f_b=False)) == (True, "ok")
    cw = kw["conv_weight"]
    C, W = cw.shape
    step = 2**29 // (C - 1) + 1  # span (C - 1) * step + W elements: < 2^31, but x 4 bytes > 2^31
    base = torch.empty((C - 1) * step + W, dtype=cw.dtype, device=DEVICE)  # virtual, C rows touched
    wide = base.as_strided((C, W), (step, 1))
    wide.copy_(cw)
    ok, why = kernel.supports(contract.prepare(**dict(kw, conv_weight=wide), with_f_b=False))
    assert not ok and why.startswith("conv_weight: the tensor spans ") and "32-bit byte offsets" in why, why
