"""``kda_verify`` (slot form) against vLLM 0.33.0's own spec-decode path on the same inputs: its
``causal_conv1d_update`` with ``num_accepted_tokens`` over a conv state of width W-1+num_spec, then
``fused_recurrent_kda`` over the per-step state slots ``[B, T]`` (the two launches of
``kimi_gdn_linear_attn.py``'s spec branch). Both run on CPU here: ours on the reference and on the Triton
interpreter, vLLM's Triton kernels on the interpreter too.

vLLM rounds the conv output to bf16 between its two launches and keeps a BF16 state in FP32 across the
tokens of one request; the fused op does neither (its contract is k decode steps), so states and outputs
agree to bf16 precision, the conv caches bit for bit. Slot 0 is vLLM's null block: the test uses
slots from 1 (the adapter maps 0 to padding).

Run: VLLM_TARGET_DEVICE=cpu FLYDSL_BACKENDS_KDA=torch /tmp/venvs/vllm/bin/python -m pytest -q \\
     integration_tests/vllm/test_kda_verify.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available() and "vllm" not in sys.modules:
    # vLLM enables its Triton kernels only with one active GPU driver, or none in a "distributed" setup
    # (CUDA_VISIBLE_DEVICES empty): the latter lets them run on Triton's interpreter here. When vLLM was
    # imported earlier in the session without it, each test reruns itself in a process of its own.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _triton_conv_update():
    """vLLM's Triton ``causal_conv1d_update``: on a CPU platform the module rebinds the name to its CPU
    implementation at import, so the module is re-executed once with the platform reporting no CPU, and
    once more afterwards to restore it."""
    import importlib

    from vllm.platforms import current_platform

    mod = importlib.import_module("vllm.model_executor.layers.mamba.ops.causal_conv1d")
    if not current_platform.is_cpu():
        return mod.causal_conv1d_update
    is_cpu = current_platform.is_cpu
    try:
        current_platform.is_cpu = lambda: False
        fn = importlib.reload(mod).causal_conv1d_update
    finally:
        current_platform.is_cpu = is_cpu
        importlib.reload(mod)
    return fn


try:
    from vllm.triton_utils import HAS_TRITON as VLLM_TRITON

    if VLLM_TRITON:
        causal_conv1d_update = _triton_conv_update()
        from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm 0.33.0 is not importable here ({type(exc).__name__}: {exc})", allow_module_level=True)

from kda_backend import VERIFY_REGISTRY, kda_verify  # noqa: E402

IMPLS = [n for n in ("torch", "triton") if VERIFY_REGISTRY.get(n).is_available()[0]]


def _inputs(B, T, H, K, W, lengths, accepted, state_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    C = 3 * H * K
    slots = 1 + B * T + 2
    N = sum(lengths)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    idx = (1 + torch.randperm(slots - 1, generator=g)[:B * T]).view(B, T).to(torch.int32)
    state = torch.full((slots, H, K, K), 1e30).to(state_dtype)
    L = W - 1 + T - 1
    conv_buf = torch.full((slots, L, C), 1e30, dtype=torch.bfloat16)  # vLLM's "SD" layout
    for n in range(B):
        state[int(idx[n, accepted[n] - 1])] = rnd(H, K, K, scale=0.5).to(state_dtype)
        conv_buf[int(idx[n, 0])] = rnd(L, C).to(torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return dict(
        x=rnd(N, C).to(torch.bfloat16), conv_weight=rnd(C, W, scale=0.5), conv_bias=rnd(C, scale=0.1),
        conv_buf=conv_buf, a=rnd(N, H * K).to(torch.bfloat16), b=rnd(N, H).to(torch.bfloat16),
        A_log=rnd(H, scale=0.5), dt_bias=rnd(H * K, scale=0.5), state=state, idx=idx, qsl=qsl,
        acc=torch.tensor(accepted, dtype=torch.int32))


@pytest.fixture(autouse=True)
def _interpretable(monkeypatch):
    """vLLM's recurrent kernel calls module aliases of ``tl.exp`` / ``tl.log``, bound at import to the
    compiler's builtins, which Triton's interpreter does not replace: look them up at call time instead."""
    import triton.language as tl
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent as fr

    if VLLM_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setattr(fr, "exp", lambda x: tl.exp(x), raising=False)
        monkeypatch.setattr(fr, "log", lambda x: tl.log(x), raising=False)


def _vllm(inp, H, K, T, lower_bound):
    conv_buf, state = inp["conv_buf"].clone(), inp["state"].clone()
    x = inp["x"]
    N = x.shape[0]
    conv_out = torch.empty_like(x)
    y = causal_conv1d_update(x, conv_buf.transpose(-1, -2), inp["conv_weight"], inp["conv_bias"], activation="silu",
                             conv_state_indices=inp["idx"][:, 0], num_accepted_tokens=inp["acc"],
                             query_start_loc=inp["qsl"], max_query_len=T, validate_data=False, out=conv_out)
    q, k, v = (t.reshape(1, N, H, K) for t in y.split(H * K, dim=-1))
    o, _ = fused_recurrent_kda(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                               raw_g=inp["a"].view(1, N, H, K), raw_beta=inp["b"].view(1, N, H), A_log=inp["A_log"],
                               dt_bias=inp["dt_bias"], lower_bound=lower_bound, initial_state=state,
                               cu_seqlens=inp["qsl"], ssm_state_indices=inp["idx"], num_accepted_tokens=inp["acc"])
    return o[0], state, conv_buf


def _ours(inp, impl, lower_bound):
    conv_buf, state = inp["conv_buf"].clone(), inp["state"].clone()
    out = kda_verify(inp["x"], inp["conv_weight"], conv_buf.transpose(-1, -2), inp["a"], inp["b"], inp["A_log"],
                     inp["dt_bias"], state, inp["idx"], None, None, query_start_loc=inp["qsl"],
                     num_accepted_tokens=inp["acc"], conv_bias=inp["conv_bias"], lower_bound=lower_bound,
                     backend=impl)
    return out, state, conv_buf


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [
    dict(B=3, T=4, lengths=[4, 4, 4], accepted=[1, 3, 4], state_dtype=torch.float32, lower_bound=None),
    dict(B=3, T=3, lengths=[3, 1, 2], accepted=[2, 1, 3], state_dtype=torch.bfloat16, lower_bound=-5.0),
])
def test_verify_matches_vllm_spec_path(impl, case, request):
    if not VLLM_TRITON:
        if torch.cuda.is_available() or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            pytest.skip("vLLM disabled its Triton kernels in this process")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return
    B, T, H, K, W = case["B"], case["T"], 2, 32, 4
    inp = _inputs(B, T, H, K, W, case["lengths"], case["accepted"], case["state_dtype"], seed=3)
    o_v, s_v, c_v = _vllm(inp, H, K, T, case["lower_bound"])
    o_o, s_o, c_o = _ours(inp, impl, case["lower_bound"])
    assert torch.equal(c_o, c_v), "conv caches differ"
    assert _rel(o_o, o_v) < 2e-2
    qsl = inp["qsl"].tolist()
    for n in range(B):
        for t in range(qsl[n + 1] - qsl[n]):
            s = int(inp["idx"][n, t])
            assert _rel(s_o[s], s_v[s]) < 2e-2, (n, t)
    # the slots no step wrote are untouched by both
    used = {int(inp["idx"][n, t]) for n in range(B) for t in range(qsl[n + 1] - qsl[n])}
    for s in range(inp["state"].shape[0]):
        if s not in used:
            assert torch.equal(s_o[s].view(torch.int16 if s_o.dtype == torch.bfloat16 else torch.int32),
                               s_v[s].view(torch.int16 if s_v.dtype == torch.bfloat16 else torch.int32)), s
