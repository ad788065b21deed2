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


def test_signature_of_tells_alignment_apart():
    """Coverage memos (the KDA adapters) are keyed on signature_of: FlyDSL takes 16-byte aligned tensors
    only, so a misaligned call with the same shapes must not reuse an aligned call's choice."""
    from backend_core.validation import signature_of

    buf = torch.zeros(64)
    a, b = buf[0:16], buf[4:20]  # same shape, strides, dtype, device; 0 and 16 bytes in
    c = buf[1:17]  # 4 bytes in
    assert signature_of(a) == signature_of(b)
    assert signature_of(a) != signature_of(c)
    assert signature_of(None, a) == (None,) + signature_of(a)
    hash(signature_of(a.to_sparse()))  # a sparse tensor: a hashable key (its call is refused in full)
