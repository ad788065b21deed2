import pytest
import torch

from backend_core import platform
from backend_core.tests.testing import amd_props as amd
from backend_core.tests.testing import clear_device_memos, nvidia_props
from backend_core.tests.testing import fake_gpus as _fake_gpus


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend torch sees GPUs with the given properties (no GPU needed)."""
    yield lambda props, hip: _fake_gpus(monkeypatch, props, hip)
    clear_device_memos()


def test_cpu():
    info = platform.device_info("cpu")
    assert info.type == "cpu" and info.arch == "cpu" and not info.is_amd


def test_gfx950_and_gfx942(fake_gpus):
    fake_gpus([amd("gfx950:sramecc+:xnack-"), amd("gfx942:sramecc+:xnack-")], hip=True)
    assert platform.device_info(0).arch == "gfx950"
    assert platform.device_info("cuda:1").arch == "gfx942"
    assert platform.device_info(1).is_amd


def test_nvidia(fake_gpus):
    fake_gpus([nvidia_props()], hip=False)
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


@pytest.fixture
def no_arch_env(monkeypatch):
    for k in ("FLYDSL_GPU_ARCH", "ARCH", "HSA_OVERRIDE_GFX_VERSION"):
        monkeypatch.delenv(k, raising=False)


def test_flydsl_gating_follows_each_devices_arch(fake_gpus, no_arch_env, monkeypatch):
    fake_gpus([amd("gfx950:sramecc+:xnack-"), amd("gfx942:sramecc+:xnack-"), amd("gfx90a")], hip=True)
    # no override: FlyDSL builds for the first GPU, so only devices of that arch qualify
    assert platform.flydsl_device_ok(0) == (True, "cuda:0 is gfx950, FlyDSL builds for gfx950")
    ok, why = platform.flydsl_device_ok("cuda:1")
    assert not ok and "builds for gfx950" in why and "FLYDSL_GPU_ARCH=gfx942" in why
    ok, why = platform.flydsl_device_ok(torch.device("cuda", 2))
    assert not ok and "gfx90a" in why
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx942")
    monkeypatch.setenv("ARCH", "gfx942")
    assert platform.flydsl_device_ok(1)[0] and not platform.flydsl_device_ok(0)[0]


def test_flydsl_gating_rejects_mismatched_build_env(fake_gpus, no_arch_env, monkeypatch):
    fake_gpus([amd("gfx950")], hip=True)
    monkeypatch.setenv("ARCH", "gfx942")
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx950")
    ok, why = platform.flydsl_device_ok(0)
    assert not ok and "disagree" in why
    monkeypatch.setenv("ARCH", "gfx950")
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "")
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "9.5.0")
    assert platform.flydsl_build_target() == ("gfx950", "HSA_OVERRIDE_GFX_VERSION")
    assert platform.flydsl_device_ok(0)[0]


def test_flydsl_gating_nvidia_cpu_and_missing_index(fake_gpus, no_arch_env):
    assert platform.flydsl_device_ok("cpu") == (False, "FlyDSL kernels need an AMD GPU (the tensors are on the CPU)")
    fake_gpus([nvidia_props()], hip=False)
    ok, why = platform.flydsl_device_ok(0)
    assert not ok and "NVIDIA H200" in why and "AMD" in why
    ok, why = platform.flydsl_device_ok(5)
    assert not ok and "no GPU with index 5" in why


def test_flydsl_gating_is_memoized_per_device(fake_gpus, no_arch_env, monkeypatch):
    calls = []
    props = [amd("gfx950"), amd("gfx950")]
    fake_gpus(props, hip=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: calls.append(i) or props[i])
    for _ in range(3):
        assert platform.flydsl_device_ok(0)[0] and platform.flydsl_device_ok(1)[0]
    assert sorted(set(calls)) == [0, 1] and len(calls) == 2


def test_sm_version_from_the_arch():
    from backend_core import platform
    from backend_core.platform import DeviceInfo

    def info(vendor, arch):
        return DeviceInfo(type="cuda", index=0, name="x", vendor=vendor, arch=arch, multiprocessors=1, total_memory=1)

    assert info("nvidia", "sm_90").sm_version == 90 and info("nvidia", "sm_89").sm_version == 89
    assert info("nvidia", "sm_100").sm_version == 100
    assert info("amd", "gfx950").sm_version == 0 and platform.device_info("cpu").sm_version == 0


def test_resident_programs_from_a_kernels_registers_and_shared_memory(fake_gpus):
    """The queue launches one wave of resident programs; on a GPU their count comes from the compiled kernel
    (run only there before): registers are allocated per warp in units of 256, a block reserves 1 KB of
    shared memory, and a CPU device or a kernel without its facts gets the estimate."""
    from types import SimpleNamespace

    props = nvidia_props("NVIDIA H100 80GB HBM3")
    props.regs_per_multiprocessor, props.max_threads_per_multi_processor = 65536, 2048
    props.shared_memory_per_multiprocessor = 233472  # 228 KB (sm_90)
    fake_gpus([props], hip=False)

    def kernel(regs, shared=0):
        return SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=shared))

    dev = "cuda:0"
    assert platform.resident_programs(dev, 1, kernel(168)) == 12  # 21 x 256 registers a warp
    assert platform.resident_programs(dev, 1, kernel(207)) == 9   # 26 x 256
    assert platform.resident_programs(dev, 4, kernel(96)) == 5    # 12 x 256 a warp, 4 warps a program
    assert platform.resident_programs(dev, 1, kernel(168, 20 * 1024)) == 10  # 228 KB / (20 + 1) KB
    assert platform.resident_programs(dev, 1, kernel(32)) == 32  # the per-SM block limit
    assert platform.resident_programs(dev, 1) == 12 and platform.resident_programs(dev, 4) == 3  # estimates
    assert platform.resident_programs("cpu", 1, kernel(32)) == 1
