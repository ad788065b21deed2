"""backend_core.import_hooks: a callback run when a module is first imported."""


def test_after_import_runs_once_the_module_is_imported(tmp_path, monkeypatch, caplog):
    """A callback waits for the framework's own first import of a module (nothing imports it from
    here), runs once on the executed module, and its error is logged, not raised into the import; a
    module already imported gets its callback at once."""
    import importlib
    import importlib.util
    import logging
    import sys

    from backend_core.import_hooks import after_import

    for name in ("fb_after_a", "fb_after_b"):
        (tmp_path / f"{name}.py").write_text("VALUE = 41 + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("fb_after_a", lambda m: seen.append(("first", m.__name__, m.VALUE)))
    after_import("fb_after_a", lambda m: seen.append(("second", m.VALUE)))
    assert "fb_after_a" not in sys.modules and seen == []

    def broken(m):
        raise RuntimeError("hook failed")

    after_import("fb_after_b", broken)
    try:
        assert importlib.util.find_spec("fb_after_a") is not None and seen == []  # a probe, not an import
        assert "fb_after_a" not in sys.modules
        mod = importlib.import_module("fb_after_a")
        assert seen == [("first", "fb_after_a", 42), ("second", 42)]
        assert mod.__loader__.get_source("fb_after_a") == "VALUE = 41 + 1\n"  # the module's own loader underneath
        with caplog.at_level(logging.WARNING, logger="flydsl_backends"):
            assert importlib.import_module("fb_after_b").VALUE == 42
        assert "hook failed" in caplog.text
        importlib.reload(mod)  # not again
        after_import("fb_after_a", lambda m: seen.append(("late", m.VALUE)))  # already imported: at once
        assert seen == [("first", "fb_after_a", 42), ("second", 42), ("late", 42)]
    finally:
        for name in ("fb_after_a", "fb_after_b"):
            sys.modules.pop(name, None)
