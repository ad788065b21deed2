"""GPU tests of the Triton kernel: real shapes against the reference, caches > 4 GiB, CUDA graphs."""

import itertools

import pytest
import torch

import kda_backend
from kda_backend.cases import clone_caches, compare_runs, make_case
from kda_backend.reference import run_reference
from kda_backend.verify import tolerances

pytestmark = pytest.mark.gpu

BATCHES = [1, 2, 3, 8, 33, 64, 128, 256]
HEADS = [3, 6, 12, 32]


def _check(params, seed):
    case = make_case(**params, device="cuda", seed=seed)
    ref = clone_caches(case)
    run_reference(ref.problem(), compute_dtype=torch.float64)  # float64 row loop on the GPU
    test = clone_caches(case)
    test.call("triton")
    torch.cuda.synchronize()
    res = compare_runs(test, ref, case, **tolerances(params.get("state_dtype", torch.float32)))
    assert res["ok"], (params, res)


@pytest.mark.parametrize("B,H", list(itertools.product(BATCHES, HEADS)))
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout,with_f_b", [("width", False), ("channel", True), ("width", True), ("channel", False)],
                         ids=["width", "channel-fb", "width-fb", "channel"])
def test_grid(B, H, state_dtype, layout, with_f_b):
    padding = [0] if B >= 3 else []
    oor = [B - 1] if B >= 2 else []
    _check(dict(B=B, H=H, K=128, W=4, slots=B + 4, state_dtype=state_dtype, conv_layout=layout, with_f_b=with_f_b,
                padding=padding, out_of_range=oor, lower_bound=-5.0 if with_f_b and B % 2 else None,
                page_pad=32 if B in (33, 64) else 0, out_layout="heads" if B == 8 else "batch"),
           seed=B * 100 + H)


@pytest.mark.parametrize("variant", [dict(conv=False, norm=False), dict(conv=False), dict(norm=False),
                                     dict(conv_bias=True), dict(K=64, W=3), dict(K=32, W=2, H=64)],
                         ids=["packed-raw", "packed-norm", "raw", "bias", "K64W3", "K32H64"])
def test_variants(variant):
    params = dict(B=33, H=12, K=128, W=4, padding=[5])
    params.update(variant)
    _check(params, seed=9)


def test_state_pool_over_4_gib():
    H, K = 12, 128
    slot_bytes = H * K * K * 4
    slots = (5 << 30) // slot_bytes + 1  # > 4 GiB of FP32 state
    state = torch.empty((slots, H, K, K), dtype=torch.float32, device="cuda")
    case = make_case(B=4, H=H, K=K, W=4, slots=8, device="cuda", seed=1, padding=[1])
    kw = dict(case.kwargs)
    far = [slots - 1, slots - 2, slots - 3, slots - 4]
    idx = case.kwargs["state_indices"].clone()
    for n in case.live_rows:
        state[far[n]].copy_(kw["state"][idx[n]])
        idx[n] = far[n]
    state[0].fill_(1e30)
    kw["state"] = state
    kw["state_indices"] = idx
    kw["conv_state"] = None
    kw["conv_weight"] = None
    small = dict(case.kwargs, conv_state=None, conv_weight=None)
    ref_state = case.kwargs["state"].clone()
    ref_out = kda_backend.kda_decode(**dict(small, state=ref_state, out=None), backend="torch")
    out = kda_backend.kda_decode(**kw, backend="triton")
    torch.cuda.synchronize()
    for n in case.live_rows:
        s_small = int(case.kwargs["state_indices"][n])
        assert torch.allclose(state[far[n]], ref_state[s_small], rtol=1e-4, atol=1e-5)
    assert torch.allclose(out.float(), ref_out.float(), atol=3e-2)
    assert (state[0] == 1e30).all()  # a wrapped 32-bit offset would land near the start


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_f_b", [False, True], ids=["a", "f_b"])
def test_cuda_graph_replay_bit_exact(state_dtype, with_f_b):
    """Capture one step, rewrite inputs in place, replay 3 steps: equal to eager bit for bit."""
    params = dict(B=8, H=12, K=128, W=4, state_dtype=state_dtype, with_f_b=with_f_b, padding=[2], out_of_range=[5],
                  lower_bound=-5.0 if with_f_b else None)
    case = make_case(**params, device="cuda", seed=3)
    eager, graphed = clone_caches(case), clone_caches(case)
    g = torch.Generator(device="cpu").manual_seed(0)
    step_inputs = []
    for _ in range(3):
        step = {}
        for name in ("x", "a", "f_a", "b", "output_gate"):
            if case.kwargs.get(name) is not None:
                t = case.kwargs[name]
                step[name] = torch.randn(t.shape, generator=g).to(t.dtype).cuda()
        step_inputs.append(step)

    # warm up (compile) on a throwaway copy so the graphed caches see exactly 3 steps
    clone_caches(case).call("triton")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    capture_copy = clone_caches(graphed)  # capture must not advance the real caches
    kw_capture = dict(graphed.kwargs)
    with torch.cuda.graph(graph, stream=stream):
        kda_backend.kda_decode_with_f_b(**kw_capture, backend="triton") if with_f_b else \
            kda_backend.kda_decode(**kw_capture, backend="triton")
    # capture recorded but did not run the kernel: caches unchanged
    for name in graphed.storage:
        assert torch.equal(graphed.storage[name].view(torch.uint8), capture_copy.storage[name].view(torch.uint8))
    for step in step_inputs:
        for name, val in step.items():
            eager.kwargs[name].copy_(val)
            graphed.kwargs[name].copy_(val)
        eager.call("triton")
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(eager.kwargs["out"], graphed.kwargs["out"])
        for name in eager.storage:
            assert torch.equal(eager.storage[name].view(torch.uint8), graphed.storage[name].view(torch.uint8)), name


def test_compiled_kernels_do_not_grow_with_scalars():
    from kda_backend.triton.kda_decode import kda_decode_kernel

    case = make_case(B=2, H=12, K=128, W=4, device="cuda", seed=1)
    clone_caches(case).call("triton", norm_eps=1e-5)
    clone_caches(case).call("triton", lower_bound=-5.0)

    def n_compiled():
        caches = getattr(kda_decode_kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton version does not expose device_caches")
        return sum(len(c[0]) for c in caches.values())

    before = n_compiled()
    for i in range(10):
        clone_caches(case).call("triton", norm_eps=1e-6 * (i + 1))
        clone_caches(case).call("triton", lower_bound=-1.0 - 0.3 * i)
    assert n_compiled() == before


@pytest.mark.parametrize("bv", [8, 16, 32])
def test_v_split_conv_window_race(monkeypatch, bv):
    """Many V-blocks per (row, head) read the same q/k conv window; only the last may shift it.
    A premature shift changes later blocks' q/k, so state, out and conv_state would all disagree."""
    from kda_backend import triton as ktriton

    monkeypatch.setenv("FLYDSL_BACKENDS_KDA_TRITON_BV", str(bv))
    ktriton.launch_config.cache_clear()
    try:
        case = make_case(B=128, H=12, K=128, W=4, slots=140, padding=[7], device="cuda", seed=5)
        ref, test = clone_caches(case), clone_caches(case)
        for step in range(3):
            run_reference(ref.problem(), compute_dtype=torch.float64)
            test.call("triton")
            torch.cuda.synchronize()
            res = compare_runs(test, ref, case, **tolerances(torch.float32))
            assert res["conv_exact"] and res["state_err"] < 1e-4 and res["out_err"] < 1e-2, (step, res)
    finally:
        monkeypatch.delenv("FLYDSL_BACKENDS_KDA_TRITON_BV")
        ktriton.launch_config.cache_clear()
