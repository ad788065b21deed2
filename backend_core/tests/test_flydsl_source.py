import pytest

from backend_core import flydsl_source
from backend_core.tests.testing import install_fake_aiter


@pytest.fixture(autouse=True)
def fresh():
    flydsl_source.clear_cache()
    yield
    flydsl_source.clear_cache()


def test_requested_source(monkeypatch):
    monkeypatch.delenv("FLYDSL_BACKENDS_SOURCE", raising=False)
    assert flydsl_source.requested_source() == "auto"
    monkeypatch.setenv("FLYDSL_BACKENDS_SOURCE", " AITER ")
    assert flydsl_source.requested_source() == "aiter"
    monkeypatch.setenv("FLYDSL_BACKENDS_SOURCE", "hip")
    with pytest.raises(ValueError, match="FLYDSL_BACKENDS_SOURCE='hip': expected one of auto, aiter, own"):
        flydsl_source.requested_source()


@pytest.mark.parametrize("env,aiter,own,want", [
    ("auto", True, True, "aiter"), ("auto", False, True, "own"), ("auto", False, False, None),
    ("aiter", True, True, "aiter"), ("aiter", False, True, None), ("own", True, True, "own"),
    ("own", True, False, None),
])
def test_choose(monkeypatch, env, aiter, own, want):
    monkeypatch.setenv("FLYDSL_BACKENDS_SOURCE", env)
    src, why = flydsl_source.choose((aiter, "A-why"), (own, "O-why"))
    assert src == want
    if want is None:
        assert ("A-why" in why) or ("O-why" in why)
    if env == "auto" and want == "own":
        assert "AITER passed over: A-why" in why


def test_discovery_without_aiter(monkeypatch):
    from backend_core import platform

    real = platform.module_available
    monkeypatch.setattr(platform, "module_available", lambda n: False if n == "aiter" else real(n))
    assert flydsl_source.find_aiter({"pa_decode": ()}) == (None, "AITER is not installed")


def test_discovery_checks_entry_points_and_signatures(monkeypatch):
    def pa_decode(output, query, *, sliding_window=0):
        pass

    install_fake_aiter(monkeypatch, {"pa_decode": pa_decode})
    fns, why = flydsl_source.find_aiter({"pa_decode": ("output", "query")})
    assert fns == {"pa_decode": pa_decode} and "has pa_decode" in why
    fns, why = flydsl_source.find_aiter({"pa_decode": ("output", "sinks")})
    assert fns is None and "lacks sinks" in why
    fns, why = flydsl_source.find_aiter({"flydsl_kda_decode": ()})
    assert fns is None and "has no flydsl_kda_decode" in why


def test_discovery_is_memoized_and_import_failure_is_a_reason(monkeypatch):
    import sys

    install_fake_aiter(monkeypatch, {"f": lambda **kw: None})
    calls = []
    real_import = __import__("importlib").import_module

    def counting(name, *a):
        calls.append(name)
        return real_import(name, *a)

    monkeypatch.setattr(flydsl_source.importlib, "import_module", counting)
    for _ in range(3):
        assert flydsl_source.find_aiter({"f": ("x",)})[0] is not None
    assert calls.count("aiter.ops.flydsl") == 1
    flydsl_source.clear_cache()
    monkeypatch.setitem(sys.modules, "aiter.ops.flydsl", None)  # import raises ImportError
    fns, why = flydsl_source.find_aiter({"f": ()})
    assert fns is None and "import aiter.ops.flydsl failed" in why
