import pytest
import torch

from backend_core.validation import require_float, require_non_overlapping, span_elements


def test_non_overlapping_accepts_views():
    base = torch.zeros(4, 6, 3)
    require_non_overlapping(base, "t")
    require_non_overlapping(base.transpose(1, 2), "t")
    require_non_overlapping(base[:, ::2], "t")
    require_non_overlapping(torch.zeros(5, 10)[:, :3], "t")


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(1, 6).expand(4, 6),
    lambda: torch.as_strided(torch.zeros(20), (4, 6), (3, 1)),
    lambda: torch.as_strided(torch.zeros(20), (3, 3), (1, 1)),
])
def test_non_overlapping_rejects_aliasing(make):
    with pytest.raises(ValueError, match="t: elements overlap"):
        require_non_overlapping(make(), "t")


def test_span():
    assert span_elements(torch.zeros(4, 6)[:, :3]) == 3 * 6 + 3
    assert span_elements(torch.zeros(0, 3)) == 0


def test_require_float():
    assert require_float(2, "x") == 2.0
    with pytest.raises(TypeError, match="x: expected a Python float, got bool"):
        require_float(True, "x")
    with pytest.raises(ValueError, match="positive"):
        require_float(0.0, "x", positive=True)
