"""The flydsl KDA decode kernel and the Kimi-K3 fused-decode hooks against real SGLang 0.5.23
objects. CPU: our op runs with FLYDSL_BACKENDS_KDA=torch (the reference); SGLang's triton
causal_conv1d_update is replaced (module binding, monkeypatch) by a torch stand-in.

Run: PYTHONPATH=integration_tests/stubs:. FLYDSL_BACKENDS_KDA=torch /work/venv-sgl/bin/python -m pytest -q \
     integration_tests/sglang/test_kda.py
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

try:
    import sglang.srt.layers.attention.linear.kda_backend as sgl_kda  # noqa: F401
    import sglang.srt.mem_cache.memory_pool  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang 0.5.23 is not importable here ({type(exc).__name__}: {exc}); build an environment with "
                "`bash integration_tests/setup-cpu-env.sh sglang DIR` and run DIR/bin/python -m pytest with "
                "PYTHONPATH=integration_tests/stubs:. (docs/serving.md)", allow_module_level=True)

import kda_backend.sglang as ks  # noqa: E402
from integration_tests.sglang import kda_harness as KH  # noqa: E402
from kda_backend import kda_decode, kda_decode_with_f_b  # noqa: E402

ATOL, RTOL = 2e-2, 2e-2


def _close(a, b, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.fixture(autouse=True)
def _cpu_env(monkeypatch):
    monkeypatch.setenv("FLYDSL_BACKENDS_KDA", "torch")
    monkeypatch.setattr(sgl_kda, "causal_conv1d_update", KH.torch_causal_conv1d_update)
    ks._k3_logged.clear()
    ks._k3_cover_cache.clear()
    monkeypatch.setitem(ks._k3_state, "fallback_broken", False)
    yield


@pytest.fixture
def packed_calls(monkeypatch):
    calls = []
    real = ks._packed_decode

    def spy(*args, **kwargs):
        calls.append(kwargs.get("lower_bound"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ks, "_packed_decode", spy)
    return calls


def _check_caches(fx, before, after_ref, changed_slots):
    """Every layer: caches equal the reference's; slots not in changed_slots equal ``before``."""
    now = KH.snapshot(fx)
    for (c, s), (rc, rs), (bc, bs_) in zip(now, after_ref, before):
        _close(c, rc, atol=1e-2, rtol=1e-2)
        _close(s, rs)
        for slot in range(c.shape[0]):
            if slot not in changed_slots:
                assert torch.equal(c[slot], bc[slot]), f"conv slot {slot} changed"
                assert torch.equal(s[slot], bs_[slot]), f"ssm slot {slot} changed"


def test_dispatcher_picks_flydsl_kernel():
    fx = KH.build_kda_fixture()
    disp = fx.backend.kernel_dispatcher
    assert fx.runner.linear_attn_backends.decode.value == "custom"
    assert disp.decode_kernel.__class__.__name__ == "FlyDSLKDAKernel"
    assert disp.supports_packed_decode and disp.supports_packed_decode_safe_gate
    assert disp.extend_kernel.__class__.__name__ == "TritonKDAKernel"
    assert ks.user_selected_flydsl()


@pytest.mark.parametrize("form", ["packed", "unpacked"])
def test_decode_refuses_replay_ssm_buffers(form):
    """Neither form may run and leave SGLang's state-tracking buffers unwritten (the unpacked form used to
    drop its extra keyword arguments)."""
    kernel = ks.make_decode_kernel("torch")
    B, H, K = 1, 2, 32
    a, b = torch.zeros(B, H * K), torch.zeros(B, H)
    common = dict(A_log=torch.zeros(H), dt_bias=torch.zeros(H * K), ssm_states=torch.zeros(2, H, K, K),
                  cache_indices=torch.zeros(B, dtype=torch.int32), intermediate_states_buffer=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="intermediate_states_buffer"):
        if form == "packed":
            kernel.packed_decode(torch.zeros(B, 3 * H * K), a, b, scale=K ** -0.5, num_v_heads=H, head_v_dim=K,
                                 **common)
        else:
            q = torch.zeros(1, B, H, K)
            kernel.decode(q, q, q, a, b, query_start_loc=torch.tensor([0, 1], dtype=torch.int32), **common)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus_gate", "safe_gate"])
def test_eager_decode_matches_reference(lower_bound, packed_calls):
    fx = KH.build_kda_fixture(lower_bound=lower_bound, seed=3)
    rows, slots = [1, 2, 3], [3, 1, 5]
    KH.assign_requests(fx, rows, slots)
    fb = KH.decode_batch(fx, rows)
    inputs = KH.decode_inputs(fx, len(rows))
    before = KH.snapshot(fx)
    ref_out, ref_caches = KH.reference_step(fx, KH.snapshot(fx), inputs, slots)
    outs = KH.run_layers(fx, fb, inputs)
    assert fx.backend.forward_metadata.mamba_cache_indices.tolist() == slots
    assert packed_calls == [lower_bound] * len(fx.layers)  # the packed path, safe gate included
    for o, r in zip(outs, ref_out):
        assert o.shape == (1, len(rows), fx.H, fx.D) and o.dtype == torch.bfloat16
        _close(o, r)
    _check_caches(fx, before, ref_caches, set(slots))


def test_eager_padding_row_uses_live_slot0(packed_calls):
    """Eager/DP padding: req-pool row 0 maps to mamba slot 0, which is live (computed, written)."""
    fx = KH.build_kda_fixture(seed=4)
    KH.assign_requests(fx, [1, 2], [3, 1])
    rows = [1, 2, 0]
    fb = KH.decode_batch(fx, rows, seq_lens=[5, 7, 1])
    inputs = KH.decode_inputs(fx, 3, seed=5)
    before = KH.snapshot(fx)
    ref_out, ref_caches = KH.reference_step(fx, KH.snapshot(fx), inputs, [3, 1, 0])
    outs = KH.run_layers(fx, fb, inputs)
    assert fx.backend.forward_metadata.mamba_cache_indices.tolist() == [3, 1, 0]
    for o, r in zip(outs, ref_out):
        _close(o, r)
    _check_caches(fx, before, ref_caches, {3, 1, 0})


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus_gate", "safe_gate"])
def test_cuda_graph_capture_and_padded_replay(lower_bound, packed_calls):
    fx = KH.build_kda_fixture(lower_bound=lower_bound, seed=6)
    max_bs = 4
    fx.hybrid.init_cuda_graph_state(max_bs, max_bs)
    static = fx.backend.state_indices_list[max_bs - 1]

    # capture (and warmup): every row is req-pool row 0 -> slot 0
    cap = KH.decode_batch(fx, [0] * max_bs, seq_lens=[1] * max_bs)
    fx.hybrid.init_forward_metadata_out_graph(cap, in_capture=True)
    md = fx.backend.forward_metadata
    assert md.mamba_cache_indices.data_ptr() == static.data_ptr()
    assert md.mamba_cache_indices.tolist() == [0] * max_bs
    before = KH.snapshot(fx)
    KH.run_layers(fx, cap, KH.decode_inputs(fx, max_bs, seed=7), init="none")
    for (c, s), (bc, bs_) in zip(KH.snapshot(fx), before):  # capture writes slot 0 only
        assert torch.equal(c[1:], bc[1:]) and torch.equal(s[1:], bs_[1:])

    # replay: raw_bs = 2 padded to 4 (padded rows: row 0, seq_len 1; SGLang writes -1 for them)
    KH.assign_requests(fx, [1, 2], [3, 1])
    rep = KH.decode_batch(fx, [1, 2, 0, 0], seq_lens=[5, 9, 1, 1])
    fx.hybrid.init_forward_metadata_out_graph(KH.replay_view(rep, num_padding=2))
    md = fx.backend.forward_metadata
    assert md.mamba_cache_indices.data_ptr() == static.data_ptr()
    assert static.tolist() == [3, 1, -1, -1]
    assert md.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    inputs = KH.decode_inputs(fx, max_bs, seed=8)
    before = KH.snapshot(fx)
    live = tuple(t[:2] if t.dim() == 2 else t[:, :2] for t in inputs)
    ref_out, ref_caches = KH.reference_step(fx, KH.snapshot(fx), live, [3, 1])
    packed_calls.clear()
    outs = KH.run_layers(fx, rep, inputs, init="none")
    assert packed_calls == [lower_bound] * len(fx.layers)
    for o, r in zip(outs, ref_out):
        assert o.shape == (1, max_bs, fx.H, fx.D)
        _close(o[:, :2], r)
        assert torch.count_nonzero(o[:, 2:]) == 0
    _check_caches(fx, before, ref_caches, {3, 1})  # slot 0 untouched at replay


# --- Kimi-K3 fused decode hooks -------------------------------------------------------------------------

def _k3_ops():
    KH.apply_plugin_hooks()
    from sglang.kernels.ops.attention import kda_fused_decode_gfx950 as g950

    return g950


def _k3_inputs(B=3, H=12, D=128, R=128, W=4, slots=5, seed=11, idx=(3, 1, -1)):
    g = torch.Generator().manual_seed(seed)
    C = 3 * H * D
    bf = torch.bfloat16
    conv_pool = torch.randn(slots, W - 1, C, generator=g).to(bf)  # the pool's width-major layout
    return dict(
        f_a=torch.randn(B, R, generator=g).to(bf),
        f_b_weight=(torch.randn(H, D, R, generator=g) * R ** -0.5).to(bf),
        mixed_qkv=torch.randn(B, C, generator=g).to(bf),
        conv_weight=torch.randn(C, W, generator=g) * 0.5,
        conv_state=conv_pool.transpose(-1, -2),
        raw_beta=torch.randn(1, B, H, generator=g).to(bf),
        A_log=torch.randn(H, generator=g) * 0.5,
        dt_bias=torch.randn(H * D, generator=g) * 0.5,
        lower_bound=-5.0,
        state=torch.randn(slots, H, D, D, generator=g) * 0.1,
        state_indices=torch.tensor(idx, dtype=torch.int32),
        output_gate=torch.randn(B, H, D, generator=g).to(bf),
        norm_weight=(1 + 0.1 * torch.randn(D, generator=g)).to(bf),
        norm_eps=1e-5,
    )


COVER_ARGS = ("f_a", "f_b_weight", "mixed_qkv", "raw_beta", "conv_state", "state", "state_indices", "output_gate",
              "norm_weight")


def _clone_inputs(kw):
    out = {}
    for k, v in kw.items():
        if k == "conv_state":
            out[k] = v.transpose(-1, -2).clone().transpose(-1, -2)
        else:
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _ref_with_f_b(kw):
    return kda_decode_with_f_b(kw["f_a"], kw["f_b_weight"], kw["mixed_qkv"], kw["conv_weight"], kw["conv_state"],
                               kw["raw_beta"], kw["A_log"], kw["dt_bias"], kw["state"], kw["state_indices"],
                               kw["output_gate"], kw["norm_weight"], lower_bound=kw["lower_bound"],
                               norm_eps=kw["norm_eps"], backend="torch")


@pytest.fixture
def k3_on(monkeypatch):
    """Server args with flydsl selected + 'this is gfx95x' (the platform gate our hooks consult)."""
    KH.build_kda_fixture(num_layers=1, mamba_size=1, num_reqs=1)  # publishes the flydsl server args
    monkeypatch.setattr(ks, "_k3_platform_ok", lambda device=None: True)
    return _k3_ops()


def test_k3_hooked_ops_serve_with_kda_decode_with_f_b(k3_on):
    g950 = k3_on
    assert g950.available(torch.device("cpu"))
    kw = _k3_inputs()
    ref_kw = _clone_inputs(kw)
    assert g950.covered(*[kw[k] for k in COVER_ARGS])
    g950.warmup(f_b_weight=kw["f_b_weight"], conv_weight=kw["conv_weight"], A_log=kw["A_log"],
                dt_bias=kw["dt_bias"], lower_bound=-5.0, norm_weight=kw["norm_weight"], norm_eps=1e-5)
    assert ks._k3_state["fallback_broken"]  # SGLang's HIP extension cannot load on CPU: logged, not raised
    out = torch.full((1, 3, 12, 128), 7.0, dtype=torch.bfloat16)
    got = g950.run(out=out, **kw)
    assert got is out
    ref = _ref_with_f_b(ref_kw)
    _close(got[0, :2], ref[:2])
    assert torch.count_nonzero(got[0, 2]) == 0  # padding row
    _close(kw["state"], ref_kw["state"], atol=1e-4, rtol=1e-4)
    assert torch.equal(kw["conv_state"], ref_kw["conv_state"])
    for s in (0, 2, 4):  # untouched slots
        assert torch.equal(kw["state"][s], _k3_inputs()["state"][s])


class _TorchProxy:
    """``torch`` as seen by the gfx950 module only, claiming a gfx950 GPU (so SGLang's original
    available()/covered() run their real shape checks on CPU tensors)."""

    cuda = SimpleNamespace(is_available=lambda: True,
                           get_device_properties=lambda d=None: SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-"))

    def __getattr__(self, name):
        return getattr(torch, name)


def test_k3_uncovered_falls_back_to_sglang_once(k3_on, monkeypatch, caplog):
    g950 = k3_on
    calls = []

    def fake_kernel(*args):
        calls.append(args)
        args[12].fill_(1.0)  # out

    monkeypatch.setattr(g950, "is_hip", lambda: True)
    monkeypatch.setattr(g950, "torch", _TorchProxy())
    monkeypatch.setattr(g950, "get_kernel", lambda name, backend: fake_kernel)
    monkeypatch.setenv("FLYDSL_BACKENDS_KDA", "flydsl")  # our op cannot serve on CPU -> not covered
    kw = _k3_inputs(idx=(3, 1, 2))
    state0 = kw["state"].clone()
    with caplog.at_level(logging.INFO, logger="flydsl_backends.sglang"):
        for _ in range(2):
            assert g950.covered(*[kw[k] for k in COVER_ARGS])  # SGLang's own verdict
            out = g950.run(**kw)
    assert len(calls) == 2 and torch.all(out == 1)
    assert torch.equal(kw["state"], state0)  # ours did not run
    msgs = [r.getMessage() for r in caplog.records if "does not cover" in r.getMessage()]
    assert len(msgs) == 1, msgs
    # ... and when SGLang's kernel could not warm up, uncovered calls take the unfused chain
    monkeypatch.setitem(ks._k3_state, "fallback_broken", True)
    assert not g950.covered(*[kw[k] for k in COVER_ARGS])


def test_k3_hooks_pass_through_without_flydsl(monkeypatch):
    g950 = _k3_ops()
    monkeypatch.setattr(ks, "user_selected_flydsl", lambda: False)
    monkeypatch.setattr(ks, "_k3_platform_ok", lambda device=None: True)
    assert not g950.available(torch.device("cpu"))  # SGLang's answer (not HIP)
    kw = _k3_inputs()
    assert not g950.covered(*[kw[k] for k in COVER_ARGS])


def test_k3_prepare_fused_decode_and_backend_branch(k3_on, monkeypatch):
    """KimiK3DeltaAttention._prepare_fused_decode (real method, stand-in module with K3 TP8 shapes,
    _is_hip forced) stashes the fused args through our hooked available/warmup; then
    KDAAttnBackend.forward_decode's HIP fused branch (is_gfx95_supported forced) runs our op via
    the hooked covered/run, reached through RadixLinearAttention.forward."""
    from sglang.srt.models import kimi_k3

    monkeypatch.setattr(kimi_k3, "_is_hip", True)
    monkeypatch.setattr(sgl_kda, "is_gfx95_supported", lambda: True)
    H, D = 12, 128
    fx = KH.build_kda_fixture(num_heads=H, head_dim=D, num_layers=1, mamba_size=4, num_reqs=4, lower_bound=-5.0,
                              seed=12)
    layer = fx.layers[0]
    g = torch.Generator().manual_seed(13)
    f_b = (torch.randn(H * D, D, generator=g) * D ** -0.5).to(torch.bfloat16)
    fake = SimpleNamespace(attn=layer, f_b_proj=SimpleNamespace(weight=f_b),
                           o_norm=SimpleNamespace(weight=torch.nn.Parameter(1 + 0.1 * torch.randn(D, generator=g)),
                                                  eps=1e-6))
    kimi_k3.KimiK3DeltaAttention._prepare_fused_decode(fake)
    assert fake._kda_hip_fused_decode_ready
    assert layer._k3_hip_fused_decode_ops.__name__.endswith("kda_fused_decode_gfx950")
    f_b_w, norm_w, eps, a_log = layer._k3_hip_fused_decode_args
    assert f_b_w.shape == (H, D, D) and eps == 1e-6

    KH.assign_requests(fx, [1, 2], [3, 1])
    fb = KH.decode_batch(fx, [1, 2])
    x = torch.randn(2, 3 * H * D, generator=g).to(torch.bfloat16)
    f_a = torch.randn(2, D, generator=g).to(torch.bfloat16)
    beta = torch.randn(1, 2, H, generator=g).to(torch.bfloat16)
    gate = torch.randn(2, H * D, generator=g).to(torch.bfloat16)
    (conv0, ssm0), = KH.snapshot(fx)
    ref = kda_decode_with_f_b(f_a, f_b_w, x, layer.conv_weights, conv0.transpose(-1, -2), beta, a_log,
                              layer.dt_bias, ssm0, torch.tensor([3, 1], dtype=torch.int32), gate.view(2, H, D),
                              norm_w, lower_bound=-5.0, norm_eps=eps, backend="torch")
    # the model's decode handoff (KimiK3DeltaAttention.forward with defer_f_b)
    layer._k3_onorm_gate, layer._k3_onorm_consumed, layer._k3_deferred_f_b = gate, False, True
    outs = KH.run_layers(fx, fb, (x, f_a, beta))
    assert layer._k3_onorm_consumed
    _close(outs[0][0], ref)
    (conv1, ssm1), = KH.snapshot(fx)
    _close(ssm1, ssm0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(conv1, conv0)


def test_k3_cuda_fused_decode_hook():
    """NVIDIA K3 fused step (kda_fused_decode.kda_fused_decode, hooked): with flydsl selected our
    kda_decode runs conv + KDA + gated norm; compared with kda_decode(backend="torch")."""
    KH.build_kda_fixture(num_layers=1, mamba_size=1, num_reqs=1)
    KH.apply_plugin_hooks()
    from sglang.kernels.ops.attention import kda_fused_decode as cuda_ops

    H, D, W, B, slots = 3, 128, 4, 3, 5
    seg, C = H * D, 3 * H * D
    g = torch.Generator().manual_seed(21)
    bf = torch.bfloat16
    x = torch.randn(B, C, generator=g).to(bf)
    a = torch.randn(B, seg, generator=g).to(bf)
    b = torch.randn(B, H, generator=g).to(bf)
    conv = torch.randn(slots, W - 1, C, generator=g).to(bf)
    w = torch.randn(C, W, generator=g) * 0.5
    wt = w.t().contiguous()
    bias = torch.randn(C, generator=g) * 0.1
    A_log = torch.randn(H, generator=g) * 0.5
    dt_bias = torch.randn(seg, generator=g) * 0.5
    gate = torch.randn(B, seg, generator=g).to(bf)
    onorm_w = 1 + 0.1 * torch.randn(D, generator=g)
    ssm = torch.randn(slots, H, D, D, generator=g) * 0.1
    idx = torch.tensor([4, 0, -1], dtype=torch.int32)
    conv_r, ssm_r = conv.clone(), ssm.clone()
    ref = kda_decode(x, w, conv_r.transpose(-1, -2), a, b, A_log, dt_bias, ssm_r, idx, gate.view(B, H, D), onorm_w,
                     conv_bias=bias, norm_eps=1e-6, scale=D ** -0.5, backend="torch")
    assert cuda_ops.covered(x, a, b, conv, ssm, idx, gate)  # SGLang's gate before this call
    out = cuda_ops.kda_fused_decode(x, a, b, conv, wt[:, :seg].contiguous(), wt[:, seg:2 * seg].contiguous(),
                                    wt[:, 2 * seg:].contiguous(), bias, A_log, dt_bias, gate, onorm_w, ssm, idx,
                                    scale=D ** -0.5, onorm_eps=1e-6, lower_bound=None)
    assert out.shape == (1, B, H, D)
    _close(out[0], ref)
    assert torch.count_nonzero(out[0, 2]) == 0
    torch.testing.assert_close(conv, conv_r)
    _close(ssm, ssm_r, atol=1e-4, rtol=1e-4)


def test_import_is_lazy():
    import subprocess
    import sys

    code = ("import sys, kda_backend.sglang; "
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; assert not bad, bad")
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))
