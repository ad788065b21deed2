"""Session set-up of the SGLang suites: the parallel-state override the harness enters for its
runners is undone at the end of the session (it would otherwise outlive the tests that needed it)."""

import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def _undo_parallel_override():
    yield
    harness = sys.modules.get("integration_tests.sglang.harness")
    if harness is not None:  # only when a test used it (SGLang importable here)
        harness.exit_parallel_override()
