"""Edge inputs of the KDA decode: a softplus gate of tiny values, caches that are inference tensors or
require grad (the reference writes them as the kernels do), numbers past the float range, sparse tensors."""

import pytest
import torch

from kda_backend.cases import clone_caches, make_case, rel_err

from .conftest import DEVICE, IMPLS


@pytest.mark.parametrize("impl", [p for p in IMPLS if p != "torch"])
def test_softplus_gate_of_tiny_values_matches_the_reference(impl):
    """log(1 + exp(z)) in fp32 is 0 for z < -16 where softplus (log1p) is ~exp(z): with a large
    exp(A_log) the reference decays the state fully, a kernel using log(1 + e) not at all."""
    case = make_case(B=2, H=1, K=32, W=4, conv=False, norm=False, device=DEVICE, seed=1)
    case.kwargs["A_log"].fill_(20.0)
    case.kwargs["dt_bias"].zero_()
    case.kwargs["a"].fill_(-17.0)
    twin = clone_caches(case)
    case.call(impl)
    twin.call("torch")
    ls = case.live_slots
    assert rel_err(case.kwargs["state"][ls], twin.kwargs["state"][ls]) < 1e-4


@pytest.mark.parametrize("kind", ["inference", "requires_grad"])
def test_reference_writes_caches_the_kernels_write(kind):
    """The reference updates the caches in place like the kernels whatever their autograd state:
    before, an inference-mode state (used outside inference mode) or a state that requires grad
    raised RuntimeError after the first live row's conv window had already been shifted."""
    case = make_case(B=2, H=1, K=32, W=4, conv_layout="channel", device=DEVICE, seed=1)
    twin = clone_caches(case)
    st = case.kwargs["state"]
    if kind == "inference":
        with torch.inference_mode():
            st = st.clone()
    else:
        st = st.clone().requires_grad_(True)
    out = case.call("torch", state=st)
    want = twin.call("torch")
    assert torch.equal(out, want)
    assert torch.equal(st.detach(), twin.kwargs["state"])
    assert torch.equal(case.kwargs["conv_state"], twin.kwargs["conv_state"])


@pytest.mark.parametrize("name", ["lower_bound", "scale", "norm_eps"])
def test_float_arguments_past_the_float_range_raise_value_error(name):
    case = make_case(B=2, H=1, K=32, W=4, device=DEVICE, seed=1)
    with pytest.raises(ValueError, match=f"{name}: expected a finite number"):
        case.call("torch", **{name: 10 ** 400})


@pytest.mark.parametrize("name", ["x", "state", "conv_state", "state_indices", "out"])
def test_sparse_tensors_raise_value_error_naming_the_argument(name):
    case = make_case(B=2, H=1, K=32, W=4, device=DEVICE, seed=1)
    with pytest.raises(ValueError, match=f"{name}: expected a dense"):
        case.call("torch", **{name: case.kwargs[name].to_sparse()})
