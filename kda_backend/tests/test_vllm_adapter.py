"""CPU unit tests of kda_backend.vllm's framework-free parts (no vllm needed)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import kda_backend.vllm as kv


@pytest.mark.parametrize("value,on", [(True, True), (False, False), (1, True), (0, False), (None, False),
                                      ("true", True), ("ON", True), ("1", True), ("false", False), ("off", False),
                                      ("", False)])
def test_flydsl_kda_enabled_values(value, on):
    assert kv.flydsl_kda_enabled(SimpleNamespace(additional_config={"flydsl_kda": value})) is on


def test_flydsl_kda_enabled_missing():
    assert kv.flydsl_kda_enabled(SimpleNamespace(additional_config={})) is False
    assert kv.flydsl_kda_enabled(SimpleNamespace(additional_config=None)) is False
    assert kv.flydsl_kda_enabled(SimpleNamespace()) is False
    assert kv.flydsl_kda_enabled(None) is False


@pytest.mark.parametrize("value", ["maybe", 1.5, [True]])
def test_flydsl_kda_enabled_rejects(value):
    with pytest.raises(ValueError, match="flydsl_kda"):
        kv.flydsl_kda_enabled(SimpleNamespace(additional_config={"flydsl_kda": value}))


def test_map_state_indices_null_block_and_short_tensor():
    idx = torch.tensor([5, 0, 9, -1, 2], dtype=torch.int32)
    out = kv.map_state_indices(idx, 7)
    assert out.dtype == torch.int32 and out.tolist() == [5, -1, 9, -1, 2, -1, -1]
    assert idx.tolist() == [5, 0, 9, -1, 2]  # input untouched
    assert kv.map_state_indices(idx.long(), 3).tolist() == [5, -1, 9]


def test_map_state_indices_int64_past_int32_is_padding():
    """Copied into the int32 buffer, 2**32 + 3 would wrap onto live slot 3 and 2**31 to a negative id."""
    idx = torch.tensor([5, 0, -1, 2**32 + 3, 2**31, 2**31 - 1], dtype=torch.int64)
    assert kv.map_state_indices(idx, 7).tolist() == [5, -1, -1, -1, -1, 2**31 - 1, -1]


def test_map_state_indices_buffer_usable_in_and_out_of_inference_mode():
    """vLLM runs under inference_mode; a buffer first allocated there must stay writable outside."""
    dev = torch.device("meta")  # a device no other test used: the buffer is allocated here
    with torch.inference_mode():
        a = kv.map_state_indices(torch.tensor([3, 0], dtype=torch.int32, device=dev), 2)
    b = kv.map_state_indices(torch.tensor([4, 0], dtype=torch.int32, device=dev), 2)
    assert a.data_ptr() == b.data_ptr() and not b.is_inference()


def test_map_state_indices_reuses_its_buffer():
    a = kv.map_state_indices(torch.tensor([3, 0], dtype=torch.int32), 2, hint=64)
    b = kv.map_state_indices(torch.tensor([4, 4, 0], dtype=torch.int32), 3)
    assert a.data_ptr() == b.data_ptr()


@pytest.mark.parametrize("bad,exc,match", [([1, 2], TypeError, "non_spec_state_indices_tensor"),
                                           (torch.zeros(2, 2, dtype=torch.int32), ValueError, "1-D"),
                                           (torch.zeros(2), ValueError, "int32")])
def test_map_state_indices_rejects(bad, exc, match):
    with pytest.raises(exc, match=match):
        kv.map_state_indices(bad, 2)


def test_module_imports_no_vllm_and_no_sibling_packages():
    code = ("import sys, kda_backend.vllm; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vllm', 'pa_backend', 'flydsl_backends')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
