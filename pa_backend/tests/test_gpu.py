"""GPU grid of the Triton paged-attention decode kernel (issue 3's H200 grid) and graph replay.

Passed on an NVIDIA H200 at commit 658defc (99 cases). The (block, D) and (GQA, query length)
pairs cover each value of the issue's grid without the full product. The CPU tests in
test_triton.py also run on the GPU when one is visible (write_kv bytes, safety cases).
"""


import pytest
import torch

from pa_backend.cases import make_pa_case

from .test_triton import check

pytestmark = pytest.mark.gpu

CONTEXTS = [1, 54, 97, 1027, 8192, 65536]


@pytest.mark.parametrize("B", [1, 7, 81, 256])
@pytest.mark.parametrize("bs,D", [(16, 128), (64, 64), (128, 256)])
@pytest.mark.parametrize("gqa,ql", [(1, 1), (4, 2), (8, 3), (16, 4)])
@pytest.mark.parametrize("v_layout,scales", [("4d", "tensor"), ("5d", "token")])
def test_decode_grid_gpu(B, bs, D, gqa, ql, v_layout, scales):
    ctx = [max(ql, CONTEXTS[(i * 7 + B) % len(CONTEXTS)]) for i in range(B)]
    if sum(ctx) > 4_000_000:  # keep one case's cache to a few GB
        ctx = [min(c, 8192) for c in ctx]
    check(dict(context_lengths=ctx, query_length=ql, Hq=gqa, Hkv=1, D=D, block_size=bs, v_layout=v_layout,
               scales=scales), seed=B + bs + D)


def assert_replay_matches_eager(case, lengths):
    """Capture ``case``'s call in a CUDA graph, then for each context-length list: refill the lengths, NaN-fill the
    output, replay; the replay's output must equal an eager call's bit for bit (stale pages may hold NaN)."""
    kw = dict(case.kwargs)
    case.call("triton")  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        case.call("triton")
    for lens in lengths:
        kw["context_lengths"].copy_(torch.tensor(lens, dtype=torch.int32))
        kw["out"].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        graphed = kw["out"].clone()
        eager = case.call("triton", out=torch.full_like(kw["out"], float("nan")))
        assert torch.equal(graphed.view(torch.int16), eager.view(torch.int16)), lens


def test_cuda_graph_replay_with_new_context_lengths():
    case = make_pa_case([100, 2000, 37], query_length=1, Hq=8, Hkv=1, D=128, extra_table=200, device="cuda")
    assert_replay_matches_eager(case, ([100, 2000, 37], [5, 3000, 1], [2100, 1, 64]))


@pytest.mark.parametrize("D,bs", [(128, 16), (64, 128)])
def test_prefill_gpu(D, bs):
    check(dict(context_lengths=[1027, 54, 8192, 0], query_lengths=[300, 54, 7, 0], Hq=8, Hkv=2, D=D, block_size=bs,
               sliding_window=512, sinks=True), seed=D + bs)
