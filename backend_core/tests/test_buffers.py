"""backend_core.buffers.DeviceBuffers: one grow-only behaviour for every workspace and index buffer."""

import pytest
import torch

from backend_core import buffers
from backend_core.buffers import DeviceBuffers


def test_grows_keeps_outgrown_sets_alive_and_zeroes_zeroed_parts():
    b = DeviceBuffers("test", [(torch.int32, True), (torch.float32, False)])
    cnt, data = b.get("cpu", (4, 10), minimum=(8, 0))
    assert cnt.numel() == 8 and data.numel() == 10 and (cnt == 0).all()
    assert b.get("cpu", (8, 10))[0] is cnt  # fits: the same tensors, no allocation
    cnt2, data2 = b.get("cpu", (8, 11))
    assert data2.numel() == 20 and cnt2.numel() == 16 and (cnt2 == 0).all()  # doubled, zeroed again
    assert b.retired == [(cnt, data)]  # outgrown, kept alive for graphs captured with it
    assert b.nbytes("cpu") == 16 * 4 + 20 * 4


def test_growth_during_capture_raises_for_zeroed_parts_and_warns_otherwise(monkeypatch, caplog):
    monkeypatch.setattr(buffers, "_capturing", lambda device: True)
    zeroed = DeviceBuffers("counters", [(torch.int32, True)])
    with pytest.raises(ValueError, match="counters: the buffers must grow during CUDA-graph capture"):
        zeroed.get("cpu", (4,))
    plain = DeviceBuffers("scratch", [(torch.float32, False)])
    with caplog.at_level("WARNING", logger="flydsl_backends"):
        (t,) = plain.get("cpu", (4,))
    assert t.numel() == 4 and "scratch: buffers grew during CUDA-graph capture" in caplog.text


def test_buffers_are_normal_tensors_under_inference_mode():
    b = DeviceBuffers("idx", [(torch.int32, False)])
    with torch.inference_mode():
        (t,) = b.get("cpu", (3,))
    assert not t.is_inference()
    t.fill_(1)  # writable outside inference mode too


def test_wrong_number_of_sizes_is_a_value_error():
    with pytest.raises(ValueError, match="expected 2 sizes, got 1"):
        DeviceBuffers("x", [(torch.int32, False), (torch.bool, False)]).get("cpu", (3,))


def test_a_bare_cuda_device_is_keyed_as_the_current_gpu(monkeypatch):
    """reserve(device="cuda") kept its buffers under "cuda", while the kernels' calls look up "cuda:N":
    the reserved set was never used and the first call inside a graph capture had to grow it."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(buffers, "_capturing", lambda device: False)  # no CUDA runtime here
    assert buffers.indexed("cuda") == torch.device("cuda", 1)
    assert buffers.indexed(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert buffers.indexed("cpu") == torch.device("cpu")
    b = DeviceBuffers("ws", [(torch.float32, False)])
    made = []

    real_empty = torch.empty

    def fake_empty(*size, dtype=None, device=None, **kw):
        made.append(device)
        return real_empty(*size, dtype=dtype, **kw)  # no GPU here: the tensor lives on the CPU

    monkeypatch.setattr(torch, "empty", fake_empty)
    (t,) = b.get("cuda", (4,))
    assert made == [torch.device("cuda", 1)]
    assert b.get(torch.device("cuda", 1), (4,))[0] is t  # the kernels' key finds the reserved set
    assert b.nbytes("cuda") == b.nbytes("cuda:1") == 16
