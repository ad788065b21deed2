from types import SimpleNamespace

import pytest
import torch

from backend_core import platform


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend torch sees GPUs with the given properties (no GPU needed)."""

    def install(props, hip):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
        monkeypatch.setattr(torch.version, "hip", "6.4" if hip else None, raising=False)
        platform._cuda_device_info.cache_clear()

    yield install
    platform._cuda_device_info.cache_clear()


def amd(arch):
    return SimpleNamespace(name="AMD Instinct", gcnArchName=arch, major=9, minor=4, multi_processor_count=256,
                           total_memory=288 << 30)


def test_cpu():
    info = platform.device_info("cpu")
    assert info.type == "cpu" and info.arch == "cpu" and not info.is_amd


def test_gfx950_and_gfx942(fake_gpus):
    fake_gpus([amd("gfx950:sramecc+:xnack-"), amd("gfx942:sramecc+:xnack-")], hip=True)
    assert platform.device_info(0).arch == "gfx950"
    assert platform.device_info("cuda:1").arch == "gfx942"
    assert platform.device_info(1).is_amd


def test_nvidia(fake_gpus):
    fake_gpus([SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                               total_memory=141 << 30)], hip=False)
    info = platform.device_info(None)
    assert info.arch == "sm_90" and info.is_nvidia and info.multiprocessors == 132


def test_out_of_range_index(fake_gpus):
    fake_gpus([amd("gfx950")], hip=True)
    with pytest.raises(ValueError, match="no GPU with index 3"):
        platform.device_info(3)


def test_memoized_per_index(fake_gpus, monkeypatch):
    calls = []
    props = [amd("gfx950"), amd("gfx942")]
    fake_gpus(props, hip=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: calls.append(i) or props[i])
    for _ in range(3):
        platform.device_info(0)
        platform.device_info(1)
    assert calls == [0, 1]


def test_probes_do_not_import():
    import sys

    platform.triton_available()
    platform.flydsl_available()
    assert "flydsl" not in sys.modules
