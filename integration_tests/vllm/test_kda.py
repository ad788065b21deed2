"""The KDA layer hook (``kda_backend.vllm``) against real vLLM 0.33.0 objects.

CPU: our op runs on the reference (FLYDSL_BACKENDS_KDA=torch). vLLM's own ``_forward`` cannot run
here (its Triton kernels are disabled on CPU), so where a test needs to see vLLM's path taken it
replaces the parent class's ``_forward`` by a recorder. Everything else (configs, the layer, its
cache spec and page-strided cache views, the metadata builder, the forward context) is vLLM's.
GPU (``-m gpu``, CUDA): the same decode on the Triton kernel under torch.cuda.CUDAGraph capture.

Run: VLLM_TARGET_DEVICE=cpu FLYDSL_BACKENDS_KDA=torch PYTHONPATH=. /work/venv-vllm/bin/python -m pytest -q \
     integration_tests/vllm/test_kda.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

try:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm 0.33.0 is not importable here ({type(exc).__name__}: {exc}); build an environment with "
                "`bash integration_tests/setup-cpu-env.sh vllm DIR` and run DIR/bin/python -m pytest with "
                "VLLM_TARGET_DEVICE=cpu (docs/serving.md)", allow_module_level=True)

import kda_backend.api as kapi  # noqa: E402
import kda_backend.vllm as kv  # noqa: E402
from integration_tests.vllm import kda_harness as KH  # noqa: E402

ATOL, RTOL = 2e-2, 2e-2
LIVE = [5, 9, 2]  # blocks of the live requests (block 0 is vLLM's null block)
NUM_BLOCKS = 12


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("FLYDSL_BACKENDS_KDA", "torch")
    kv._logged.clear()
    kv._cover_cache.clear()
    yield


@pytest.fixture
def hooked(monkeypatch):
    """The hook registered (idempotent; the registry entry is removed again afterwards)."""
    monkeypatch.delitem(op_registry_oot, kv.KIMI_LINEAR_LAYER, raising=False)
    assert kv.register_layer_hooks() is True
    yield
    op_registry_oot.pop(kv.KIMI_LINEAR_LAYER, None)


@pytest.fixture
def vllm_path(monkeypatch):
    """vLLM's ``_forward`` replaced by a recorder (its Triton kernels cannot run on CPU)."""
    calls = []

    def recorder(self, mixed_qkv, g1, g2, beta, core_attn_out):
        calls.append(dict(layer=self, rows=int(mixed_qkv.shape[0])))

    monkeypatch.setattr(KimiGatedDeltaNetAttention, "_forward", recorder)
    return calls


@pytest.fixture
def op_calls(monkeypatch):
    calls = []
    real = kapi.kda_decode

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(kapi, "kda_decode", spy)
    return calls


def _setup(additional=None, *, lower_bound=None, full_cudagraph=True, device="cpu", num_spec=0, prefix=KH.PREFIX,
           state_dtype=None):
    vc = KH.make_vllm_config({"flydsl_kda": True} if additional is None else additional, full_cudagraph=full_cudagraph)
    layer = KH.build_layer(vc, lower_bound=lower_bound, device=device, prefix=prefix)
    layer.num_spec = num_spec  # conv state width W-1+num_spec (what a speculative config gives)
    if state_dtype is not None:  # vLLM 0.33's Kimi-Linear always asks for FP32; other configs/layers may not
        conv_dtype = layer.get_state_dtype()[0]
        layer.get_state_dtype = lambda: (conv_dtype, state_dtype)
    cache = KH.bind_cache(layer, vc, num_blocks=NUM_BLOCKS, live_blocks=LIVE, device=device)
    builder = KH.metadata_builder(layer, vc, cache, device=device)
    return vc, layer, cache, builder


def _run(vc, layer, m, inp):
    with torch.inference_mode(), KH.forward_context(vc, {layer.prefix: m}):
        layer._forward(mixed_qkv=inp.mixed_qkv, g1=inp.g1, g2=inp.g2, beta=inp.beta, core_attn_out=inp.core_attn_out)


# --- registration ---------------------------------------------------------------------------------

def test_import_pulls_in_no_vllm():
    code = ("import sys, kda_backend.vllm as kv; bad = sorted(m for m in sys.modules if m == 'vllm' or "
            "m.startswith(('vllm.', 'pa_backend', 'flydsl_backends'))); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _fresh_process(code: str):
    """The JSON the last line of ``python -c code`` prints, in a fresh process (no layer module imported)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_plugin_registers_the_layer_when_vllm_imports_it():
    """The vLLM plugin imports no layer module at load (Kimi-Linear's pulls in FLA's utilities, which query
    the GPU: in vllm serve's parent that initialised CUDA there); the hook is in place as soon as
    vLLM imports the layer's module itself. A fresh process: the module is not imported yet."""
    code = ("import importlib, json, sys\n"
            "from flydsl_backends.plugins import register_vllm\n"
            "register_vllm()\n"
            "from vllm.model_executor.custom_op import op_registry_oot\n"
            "import kda_backend.vllm as kv\n"
            "before = [kv.KIMI_LINEAR_MODULE in sys.modules, 'vllm.third_party.flash_linear_attention.ops.utils' in "
            "sys.modules, kv.KIMI_LINEAR_LAYER in op_registry_oot]\n"
            "importlib.import_module(kv.KIMI_LINEAR_MODULE)\n"
            "print(json.dumps([before, op_registry_oot.get(kv.KIMI_LINEAR_LAYER) is kv.kimi_linear_layer_class()]))\n")
    assert _fresh_process(code) == [[False, False, False], True]


def test_register_after_install_imports_and_registers_once():
    """``register_layer_hooks`` after the plugin's ``install_layer_hooks``, before vLLM imported the layer:
    the import it makes runs the pending callback inside it, under the same lock (it hung on a
    non-reentrant lock); the layer ends up registered once."""
    code = ("import json\n"
            "import kda_backend.vllm as kv\n"
            "kv.install_layer_hooks()\n"
            "ok = kv.register_layer_hooks()\n"
            "from vllm.model_executor.custom_op import op_registry_oot\n"
            "print(json.dumps([ok, op_registry_oot.get(kv.KIMI_LINEAR_LAYER) is kv.kimi_linear_layer_class()]))\n")
    assert _fresh_process(code) == [True, True]  # a hang is the subprocess timeout


def test_layer_is_ours_only_when_hooked(monkeypatch):
    monkeypatch.delitem(op_registry_oot, kv.KIMI_LINEAR_LAYER, raising=False)
    vc = KH.make_vllm_config({"flydsl_kda": True})
    plain = KH.build_layer(vc, prefix="model.layers.10.self_attn")
    assert type(plain) is KimiGatedDeltaNetAttention

    assert kv.register_layer_hooks() is True
    assert kv.register_layer_hooks() is True  # idempotent
    cls = op_registry_oot[kv.KIMI_LINEAR_LAYER]
    assert cls is kv.kimi_linear_layer_class() and issubclass(cls, KimiGatedDeltaNetAttention)
    layer = KH.build_layer(vc, prefix="model.layers.11.self_attn")
    assert type(layer) is cls and layer._flydsl_kda is True
    # vLLM's own parameters and backend, unchanged
    assert layer.conv1d.weight.shape == (3 * 2 * 32, 1, 4) and layer.get_attn_backend().get_name() == "GDN_ATTN"
    op_registry_oot.pop(kv.KIMI_LINEAR_LAYER)


def test_foreign_registration_left_alone(monkeypatch, caplog):
    class Other(KimiGatedDeltaNetAttention):
        pass

    monkeypatch.setitem(op_registry_oot, kv.KIMI_LINEAR_LAYER, Other)
    with caplog.at_level(logging.WARNING, logger="flydsl_backends.vllm.kda"):
        assert kv.register_layer_hooks() is False
    assert op_registry_oot[kv.KIMI_LINEAR_LAYER] is Other
    assert "already replaced" in caplog.text


def test_k3_skipped_on_cpu(hooked, caplog):
    with caplog.at_level(logging.DEBUG, logger="flydsl_backends.vllm.kda"):
        kv.register_layer_hooks()
    assert kv.KIMI_K3_LAYER not in op_registry_oot
    assert "Kimi-K3" in caplog.text and "not registered" in caplog.text


def test_switch_read_at_construction(hooked):
    for extra, on in (({}, False), ({"flydsl_kda": False}, False), ({"flydsl_kda": "true"}, True),
                      ({"flydsl_kda": 1}, True)):
        vc = KH.make_vllm_config(extra)
        layer = KH.build_layer(vc, prefix="model.layers.3.self_attn")
        assert layer._flydsl_kda is on, extra
    with pytest.raises(ValueError, match="flydsl_kda"):
        KH.build_layer(KH.make_vllm_config({"flydsl_kda": "maybe"}), prefix="model.layers.3.self_attn")


# --- decode on our op -----------------------------------------------------------------------------

@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("full_cudagraph", [True, False], ids=["staged", "eager-meta"])
@pytest.mark.parametrize("pad_rows", [1, 3])
def test_padded_decode_matches_reference(hooked, vllm_path, op_calls, caplog, lower_bound, full_cudagraph, pad_rows):
    vc, layer, cache, builder = _setup(lower_bound=lower_bound, full_cudagraph=full_cudagraph)
    m = KH.decode_metadata(builder, LIVE, pad_rows)
    T = len(LIVE) + pad_rows
    assert m.num_prefills == 0 and m.num_decodes == T and m.spec_sequence_masks is None
    assert m.non_spec_state_indices_tensor.tolist() == LIVE + [0] * pad_rows  # vLLM's null block padding
    inp = KH.decode_inputs(layer, T)
    pages0, conv0, state0 = cache.pages.clone(), cache.conv_state.clone(), cache.state.clone()
    expected, new = KH.expected_decode(layer, inp, conv0, state0, LIVE + [0] * pad_rows)

    with caplog.at_level(logging.INFO, logger="flydsl_backends.vllm.kda"):
        _run(vc, layer, m, inp)
    assert vllm_path == [] and len(op_calls) == 1
    assert "flydsl-backends kda_decode ran" in caplog.text
    assert op_calls[0]["state_indices"].tolist() == LIVE + [-1] * pad_rows
    assert op_calls[0]["state"] is layer.kv_cache[1] and op_calls[0]["state"].stride(0) > 2 * 32 * 32  # page-strided

    out = inp.core_attn_out[0]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(out[len(LIVE):], torch.zeros_like(out[len(LIVE):]))
    for blk in range(NUM_BLOCKS):
        if blk in new:
            torch.testing.assert_close(cache.conv_state[blk].double(), new[blk][0], atol=0, rtol=0)
            torch.testing.assert_close(cache.state[blk].double(), new[blk][1], atol=1e-5, rtol=1e-5)
        else:  # null block 0 and unused blocks: bit-identical sentinel
            assert torch.equal(cache.conv_state[blk], conv0[blk]) and torch.equal(cache.state[blk], state0[blk]), blk
            assert (cache.state[blk] == KH.SENTINEL).all()
    page_end = int(cache.spec.page_size_bytes)
    assert torch.equal(cache.pages[:, page_end:], pages0[:, page_end:])  # page padding untouched
    assert torch.equal(m.non_spec_state_indices_tensor.cpu(), torch.tensor(LIVE + [0] * pad_rows, dtype=torch.int32))


def test_bf16_state_decode_matches_reference(hooked, vllm_path, op_calls):
    """A BF16 recurrent state in vLLM's page (Kimi-Linear in 0.33 always asks for FP32, so the layer's
    get_state_dtype is overridden here): our op widens it, updates in FP32 and rounds once on store."""
    vc, layer, cache, builder = _setup(state_dtype=torch.bfloat16)
    assert cache.state.dtype == torch.bfloat16
    m = KH.decode_metadata(builder, LIVE, 1)
    inp = KH.decode_inputs(layer, len(LIVE) + 1)
    conv0, state0 = cache.conv_state.clone(), cache.state.clone()
    expected, new = KH.expected_decode(layer, inp, conv0, state0, LIVE + [0])
    _run(vc, layer, m, inp)
    assert vllm_path == [] and len(op_calls) == 1
    torch.testing.assert_close(inp.core_attn_out[0].double(), expected, atol=ATOL, rtol=RTOL)
    for blk in range(NUM_BLOCKS):
        if blk in new:
            torch.testing.assert_close(cache.state[blk].double(), new[blk][1], atol=2e-2, rtol=1e-2)
        else:
            assert torch.equal(cache.state[blk], state0[blk]) and torch.equal(cache.conv_state[blk], conv0[blk])


def test_two_steps_and_log_once(hooked, caplog):
    vc, layer, cache, builder = _setup()
    m = KH.decode_metadata(builder, LIVE, 1)
    with caplog.at_level(logging.INFO, logger="flydsl_backends.vllm.kda"):
        for step in range(2):
            inp = KH.decode_inputs(layer, 4, seed=10 + step)
            expected, new = KH.expected_decode(layer, inp, cache.conv_state.clone(), cache.state.clone(), LIVE + [0])
            _run(vc, layer, m, inp)
            torch.testing.assert_close(inp.core_attn_out[0].double(), expected, atol=ATOL, rtol=RTOL)
    assert caplog.text.count("flydsl-backends kda_decode ran") == 1


def test_rows_past_the_index_tensor_are_padding(hooked):
    """num_actual_tokens larger than the per-request index tensor: the extra rows are padding."""
    vc, layer, cache, builder = _setup()
    m = dataclasses.replace(KH.decode_metadata(builder, LIVE, 0), num_actual_tokens=5)
    inp = KH.decode_inputs(layer, 5)
    state0 = cache.state.clone()
    expected, _ = KH.expected_decode(layer, inp, cache.conv_state.clone(), state0, LIVE + [0, 0])
    _run(vc, layer, m, inp)
    torch.testing.assert_close(inp.core_attn_out[0].double(), expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(cache.state[0], state0[0])


def test_core_attn_out_rows_past_num_actual_tokens_zeroed(hooked):
    vc, layer, cache, builder = _setup()
    m = KH.decode_metadata(builder, LIVE, 1)
    inp = KH.decode_inputs(layer, 6)  # the layer has 6 token rows, the batch 4
    expected, _ = KH.expected_decode(layer, inp, cache.conv_state.clone(), cache.state.clone(), LIVE + [0])
    _run(vc, layer, m, inp)
    torch.testing.assert_close(inp.core_attn_out[0, :4].double(), expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(inp.core_attn_out[0, 4:], torch.zeros_like(inp.core_attn_out[0, 4:]))


@pytest.fixture
def k3_hooked(monkeypatch):
    """Kimi-K3's ROCm layer registered as on ROCm. Its module imports on CPU once
    ``vllm.platforms.rocm`` is imported with a gfx942 device-properties stand-in (that module reads
    the arch at import); ``current_platform.is_rocm`` is faked only around ``register_layer_hooks``."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    with monkeypatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(gcnArchName="gfx942:sramecc+"))
        try:
            import vllm.models.kimi_k3.amd.kda  # noqa: F401
            import vllm.platforms.rocm  # noqa: F401  (K3's __init__ imports it: the arch is read then)
        except Exception as exc:  # pragma: no cover - depends on the environment
            pytest.skip(f"vllm.models.kimi_k3.amd.kda does not import here ({type(exc).__name__}: {exc})")
    for name in (kv.KIMI_LINEAR_LAYER, kv.KIMI_K3_LAYER):
        monkeypatch.delitem(op_registry_oot, name, raising=False)
    with monkeypatch.context() as mp:
        mp.setattr(current_platform, "is_rocm", lambda: True)
        assert kv.register_layer_hooks() is True
        assert kv.register_layer_hooks() is True
    assert op_registry_oot[kv.KIMI_K3_LAYER] is kv.kimi_k3_layer_class()
    yield
    for name in (kv.KIMI_LINEAR_LAYER, kv.KIMI_K3_LAYER):
        op_registry_oot.pop(name, None)


def test_k3_padded_decode_matches_reference(k3_hooked, monkeypatch, op_calls):
    from vllm.models.kimi_k3.amd.kda import KimiK3DeltaAttention

    k3_calls = []
    monkeypatch.setattr(KimiK3DeltaAttention, "_forward", lambda self, **kw: k3_calls.append(kw))
    vc = KH.make_vllm_config({"flydsl_kda": True}, full_cudagraph=True)
    layer = KH.build_layer(vc, lower_bound=-5.0, k3=True, prefix="model.layers.20.self_attn")
    assert type(layer) is kv.kimi_k3_layer_class() and isinstance(layer, KimiK3DeltaAttention)
    cache = KH.bind_cache(layer, vc, num_blocks=NUM_BLOCKS, live_blocks=LIVE)
    builder = KH.metadata_builder(layer, vc, cache)
    assert type(builder).__name__ == "KimiK3ROCmKDAMetadataBuilder"
    m = KH.decode_metadata(builder, LIVE, 1)
    inp = KH.decode_inputs(layer, 4)
    assert inp.g2.stride(0) > inp.g2.shape[1] * inp.g2.shape[2]  # row-strided output gate, as in K3's forward
    conv0, state0 = cache.conv_state.clone(), cache.state.clone()
    expected, new = KH.expected_decode(layer, inp, conv0, state0, LIVE + [0])
    _run(vc, layer, m, inp)
    assert k3_calls == [] and len(op_calls) == 1
    torch.testing.assert_close(inp.core_attn_out[0].double(), expected, atol=ATOL, rtol=RTOL)
    for blk in range(NUM_BLOCKS):
        if blk in new:
            torch.testing.assert_close(cache.state[blk].double(), new[blk][1], atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(cache.state[blk], state0[blk]) and torch.equal(cache.conv_state[blk], conv0[blk])
    # a mixed batch goes to K3's own _forward (built by the shared GDN builder: K3's builds its prefill
    # chunk metadata with a Triton kernel, which cannot run on CPU)
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    with set_current_vllm_config(vc):
        gdn = GDNAttentionMetadataBuilder(cache.spec, [layer.prefix], vc, torch.device("cpu"))
    mixed = gdn.build(0, KH.common_metadata([1, 3], [8, 3], [5, 9], is_prefilling=[False, True]))
    _run(vc, layer, mixed, KH.decode_inputs(layer, 4))
    assert len(k3_calls) == 1 and len(op_calls) == 1


# --- vLLM's path ----------------------------------------------------------------------------------

def _caches_unchanged(cache, pages0):
    return torch.equal(cache.pages, pages0)


def test_switch_off_runs_vllm_path(hooked, vllm_path, op_calls, caplog):
    with caplog.at_level(logging.INFO, logger="flydsl_backends.vllm.kda"):
        vc, layer, cache, builder = _setup({})
    assert "vLLM's path" in caplog.text and "flydsl_kda" in caplog.text
    m = KH.decode_metadata(builder, LIVE, 1)
    inp = KH.decode_inputs(layer, 4)
    pages0 = cache.pages.clone()
    _run(vc, layer, m, inp)
    assert len(vllm_path) == 1 and vllm_path[0]["layer"] is layer and op_calls == []
    assert _caches_unchanged(cache, pages0) and torch.isnan(inp.core_attn_out).all()


def test_mixed_and_prefill_batches_run_vllm_path(hooked, vllm_path, op_calls, caplog):
    vc, layer, cache, builder = _setup()
    # one decode request (block 5) and one new prefill of 3 tokens (block 9)
    cam = KH.common_metadata([1, 3], [8, 3], [5, 9], is_prefilling=[False, True])
    mixed = builder.build(0, cam)
    assert mixed.num_decodes == 1 and mixed.num_prefills == 1
    cam = KH.common_metadata([3, 2], [3, 2], [5, 9], is_prefilling=[True, True])
    prefill = builder.build(0, cam)
    assert prefill.num_decodes == 0 and prefill.num_prefills == 2
    pages0 = cache.pages.clone()
    with caplog.at_level(logging.INFO, logger="flydsl_backends.vllm.kda"):
        for m, T in ((mixed, 4), (prefill, 5)):
            _run(vc, layer, m, KH.decode_inputs(layer, T))
    assert [c["rows"] for c in vllm_path] == [4, 5] and op_calls == []
    assert _caches_unchanged(cache, pages0)
    assert caplog.text.count("prefill or mixed prefill/decode batch") == 1  # logged once


def test_spec_decode_batch_runs_vllm_path(hooked, vllm_path, op_calls):
    vc, layer, cache, builder = _setup()
    m = KH.decode_metadata(builder, LIVE, 1)
    # stand-in: a speculative batch's mask (building one needs a speculative config and drafts)
    m = dataclasses.replace(m, spec_sequence_masks=torch.ones(4, dtype=torch.bool), num_decodes=0, num_spec_decodes=4)
    _run(vc, layer, m, KH.decode_inputs(layer, 4))
    assert len(vllm_path) == 1 and op_calls == []


def test_no_metadata_runs_vllm_path(hooked, vllm_path, op_calls):
    vc, layer, cache, builder = _setup()
    with torch.inference_mode(), KH.forward_context(vc, {}):
        inp = KH.decode_inputs(layer, 2)
        layer._forward(mixed_qkv=inp.mixed_qkv, g1=inp.g1, g2=inp.g2, beta=inp.beta, core_attn_out=inp.core_attn_out)
    assert len(vllm_path) == 1 and op_calls == []


def test_uncovered_decode_runs_vllm_path(hooked, vllm_path, op_calls, caplog):
    """Speculative decoding configured: the conv state is W-1+num_spec wide; a plain decode batch
    then goes to vLLM's kernels (ours keeps exactly W-1), logged with the op's reason."""
    vc, layer, cache, builder = _setup(num_spec=2)
    assert cache.conv_state.shape[1] == 3 + 2
    m = KH.decode_metadata(builder, LIVE, 1)
    pages0 = cache.pages.clone()
    with caplog.at_level(logging.INFO, logger="flydsl_backends.vllm.kda"):
        _run(vc, layer, m, KH.decode_inputs(layer, 4))
    assert len(vllm_path) == 1 and op_calls == []
    assert "does not cover" in caplog.text and "conv_state" in caplog.text
    assert _caches_unchanged(cache, pages0)


# --- GPU: Triton kernel under CUDA-graph capture ------------------------------------------------------

@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(hooked, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.delenv("FLYDSL_BACKENDS_KDA", raising=False)  # auto: Triton on NVIDIA
    dev = "cuda"
    vc, layer, cache, builder = _setup(device=dev)
    m = KH.decode_metadata(builder, LIVE, 1, device=dev)
    assert m.non_spec_state_indices_tensor.data_ptr() == builder.non_spec_state_indices_tensor.data_ptr()
    T = 4
    steps = [KH.decode_inputs(layer, T, device=dev, seed=20 + s) for s in range(3)]
    pages0, conv0, state0 = cache.pages.clone(), cache.conv_state.clone(), cache.state.clone()

    eager = []
    for inp in steps:
        x = KH.decode_inputs(layer, T, device=dev, seed=0)
        for name in ("mixed_qkv", "g1", "g2", "beta"):
            getattr(x, name).copy_(getattr(inp, name))
        _run(vc, layer, m, x)
        eager.append((x.core_attn_out.clone(), cache.pages.clone()))
    ref_step0 = KH.expected_decode(layer, steps[0], conv0, state0, LIVE + [0])[0]
    torch.testing.assert_close(eager[0][0][0].double().cpu(), ref_step0, atol=ATOL, rtol=RTOL)

    static = KH.decode_inputs(layer, T, device=dev, seed=0)
    cache.pages.copy_(pages0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(vc, layer, m, static)  # warm-up (compiles), then restore the caches
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    cache.pages.copy_(pages0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(vc, layer, m, static)
    for inp, (out_e, pages_e) in zip(steps, eager):
        for name in ("mixed_qkv", "g1", "g2", "beta"):
            getattr(static, name).copy_(getattr(inp, name))
        static.core_attn_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static.core_attn_out, out_e)
        assert torch.equal(cache.pages, pages_e)

