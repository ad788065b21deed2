"""The Triton paged-attention decode kernel against the float64 reference (interpreter on CPU)."""

import dataclasses

import pytest
import torch

from pa_backend import REGISTRY
from pa_backend.contract import prepare_attention
from pa_backend.reference import run_attention
from pa_backend.testing import make_pa_case
from pa_backend.verify import OUT_TOL

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
pytestmark = pytest.mark.skipif(not REGISTRY.get("triton").is_available()[0], reason="triton not usable here")


def check(params, seed=0, **call):
    case = make_pa_case(**params, device=DEVICE, seed=seed)
    kw = dict(case.kwargs)
    kw.pop("out")
    ref = torch.empty(kw["query"].shape, dtype=torch.float64, device=DEVICE)
    run_attention(dataclasses.replace(prepare_attention(**kw), out=ref), compute_dtype=torch.float64)
    out = case.call("triton", **call)
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= OUT_TOL, (case.desc, err)
    return out


@pytest.mark.parametrize("v_layout", ["4d", "5d"])
@pytest.mark.parametrize("scales", ["tensor", "token"])
@pytest.mark.parametrize("ql", [1, 3])
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_grid(v_layout, scales, ql, gqa):
    check(dict(context_lengths=[3, 35, 17], query_length=ql, Hq=2 * gqa, Hkv=2, D=64, block_size=16,
               v_layout=v_layout, scales=scales), seed=ql * 10 + gqa)


@pytest.mark.parametrize("extra", [dict(sliding_window=9), dict(sinks=True), dict(sinks=True, sliding_window=5),
                                   dict(block_size=64, context_lengths=[70, 1]), dict(D=128),
                                   dict(block_size=128, context_lengths=[200, 3]), dict(D=256, block_size=64),
                                   dict(fp8_dtype=torch.float8_e4m3fnuz)],
                         ids=["window", "sinks", "sinks+window", "bs64", "D128", "bs128-subtiles", "D256", "fnuz"])
def test_decode_features(extra):
    params = dict(context_lengths=[40, 6], query_length=2, Hq=4, Hkv=1, D=64)
    params.update(extra)
    if params.get("fp8_dtype") == torch.float8_e4m3fnuz and not (DEVICE.type == "cuda" and torch.version.hip):
        case = make_pa_case(**params, device=DEVICE)
        with pytest.raises(ValueError, match="float8_e4m3fnuz caches need an AMD GPU"):
            case.call("triton")
        return
    check(params)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_explicit_partitions_and_padded_sequence(parts):
    out = check(dict(context_lengths=[0, 50, 1], query_length=1, Hq=4, Hkv=2, D=64, sinks=True), num_partitions=parts)
    assert (out[0] == 0).all()  # a padded sequence (context 0) gives zeros


def test_planner_is_shape_only_and_bounded():
    from pa_backend.triton import plan_partitions

    P, nbp = plan_partitions(81, 1, 8192, 16, 132)
    assert P * nbp * 16 >= 8192 and nbp & (nbp - 1) == 0 and 81 * P >= 132
    assert plan_partitions(81, 1, 8192, 16, 132) == (P, nbp)
    assert plan_partitions(1, 1, 16, 16, 132) == (1, 1)
    assert plan_partitions(4, 1, 4096, 16, 132, requested=4)[0] == 4


def test_prefill_and_write_fall_back_to_the_reference():
    case = make_pa_case([8, 3], query_lengths=[2, 3], device=DEVICE)
    with pytest.raises(ValueError, match="only pa_decode has a Triton kernel"):
        case.call("triton")
    case.call("auto")  # the reference serves it
