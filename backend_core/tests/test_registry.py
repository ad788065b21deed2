import logging

import pytest

from backend_core.registry import Implementation, OpRegistry


def make(avail=True, supports=True, name="x", result=None):
    return Implementation(name, lambda: (avail, f"{name} availability"),
                          lambda call: (supports, f"{name} support verdict"), lambda call: result or name)


@pytest.fixture
def reg():
    r = OpRegistry("fam", env_var="TEST_FAM_BACKEND", preference={"cuda": ("fast", "slow"), "cpu": ("slow", "fast")})
    r.register(make(name="fast"))
    r.register(make(name="slow"))
    return r


def test_auto_follows_device_preference(reg):
    assert reg.select(None, "auto", "cuda").name == "fast"
    assert reg.select(None, "auto", "cpu").name == "slow"


def test_auto_skips_unavailable_and_unsupported(reg):
    r = OpRegistry("fam", env_var="TEST_FAM_BACKEND", preference={"cuda": ("a", "b", "c")})
    r.register(make(name="a", avail=False))
    r.register(make(name="b", supports=False))
    r.register(make(name="c"))
    assert r.select(None, "auto", "cuda").name == "c"


def test_auto_with_nothing_able_raises_with_reasons():
    r = OpRegistry("fam", env_var="TEST_FAM_BACKEND", preference={"cuda": ("a",)})
    r.register(make(name="a", supports=False))
    with pytest.raises(ValueError, match="no implementation of fam can serve.*a support verdict"):
        r.select(None, "auto", "cuda")


def test_explicit_backend_that_cannot_serve_raises_reason(reg):
    reg.register(make(name="broken", avail=False))
    with pytest.raises(ValueError, match="backend='broken' cannot serve.*not available: broken availability"):
        reg.select(None, "broken", "cuda")
    with pytest.raises(ValueError, match="'nope' is not an implementation"):
        reg.select(None, "nope", "cuda")
    with pytest.raises(TypeError, match="backend: expected a str"):
        reg.select(None, 3, "cuda")


def test_env_var_forces_choice_for_auto_only(reg, monkeypatch):
    monkeypatch.setenv("TEST_FAM_BACKEND", "slow")
    assert reg.select(None, "auto", "cuda").name == "slow"
    assert reg.select(None, "fast", "cuda").name == "fast"
    monkeypatch.setenv("TEST_FAM_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TEST_FAM_BACKEND='bogus'"):
        reg.select(None, "auto", "cuda")


def test_choice_logged_once_per_call_site(reg, caplog):
    caplog.set_level(logging.INFO, logger="flydsl_backends")

    def op():  # a public op that calls select() through one helper
        return _inner()

    def _inner():
        return reg.select(None, "auto", "cuda", site_depth=2)

    for _ in range(3):
        op()  # one call site, three calls
    op()  # a second call site
    hits = [r.getMessage() for r in caplog.records if "chose 'fast'" in r.getMessage()]
    assert len(hits) == 2
    assert all("test_registry.py" in h for h in hits)


def test_availability_probe_exception_is_a_reason():
    def boom():
        raise RuntimeError("driver exploded")

    impl = Implementation("z", boom, lambda c: (True, ""), lambda c: None)
    ok, why = impl.is_available()
    assert not ok and "driver exploded" in why


def test_duplicate_registration_rejected(reg):
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(make(name="fast"))


def test_gpu_runner_makes_the_calls_device_current(reg, monkeypatch):
    """Kernels launch on the current GPU: a call on cuda:1 while cuda:0 is current runs inside cuda:1's
    device context; a call on the current GPU, and a CPU call, run without switching."""
    import contextlib
    from types import SimpleNamespace

    import torch

    seen = []

    @contextlib.contextmanager
    def fake_device(dev):
        seen.append(("enter", dev.index))
        yield
        seen.append(("exit", dev.index))

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    reg.register(Implementation("rec", lambda: (True, ""), lambda call: (True, ""),
                                lambda call: seen.append(("run", call.device.index)) or "done"))
    on1 = SimpleNamespace(device=torch.device("cuda", 1))
    assert reg.select(on1, "rec", "cuda").run(on1) == "done"
    assert seen == [("enter", 1), ("run", 1), ("exit", 1)]
    seen.clear()
    on0 = SimpleNamespace(device=torch.device("cuda", 0))
    reg.select(on0, "rec", "cuda").run(on0)
    assert seen == [("run", 0)]
    seen.clear()
    cpu = SimpleNamespace(device=torch.device("cpu"))
    reg.select(cpu, "rec", "cpu").run(cpu)
    assert seen == [("run", None)]
