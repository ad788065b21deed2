"""backend_core.lazy: framework subclasses built once, on first use."""

import pytest


def test_lazy_classes_build_once_and_name_the_module():
    from backend_core.lazy import LazyClasses

    calls = []

    def build():
        calls.append(1)
        return type("Tmp", (), {})

    lazy = LazyClasses("some.module", {"Thing": build})
    a, b = lazy.get("Thing"), lazy.module_getattr("Thing")
    assert a is b and calls == [1]
    assert (a.__module__, a.__qualname__) == ("some.module", "Thing")
    with pytest.raises(AttributeError, match="Other"):
        lazy.module_getattr("Other")
