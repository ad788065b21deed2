"""The op table drives the CLI and the compile gate: a stand-in op family added to the table (one
package, one line) shows up in ``info``, ``verify`` and ``bench``, and its kernels in the gate."""

import sys
import types

import pytest

from backend_core.ops import OpFamily
from backend_core.registry import Implementation, OpRegistry
from flydsl_backends import cli, compile_gate, ops


@pytest.fixture
def standin_op(monkeypatch):
    pkg = types.ModuleType("standin_backend")
    pkg.REGISTRY = OpRegistry("standin", env_var="FLYDSL_BACKENDS_STANDIN", preference={"cuda": ("torch",),
                                                                                       "cpu": ("torch",)})
    pkg.REGISTRY.register(Implementation("torch", lambda: (True, "always (stand-in)"), lambda p: (True, "ok"),
                                         lambda p: None, "reference"))
    calls = {}

    def run_verify(impls, device, small, progress=None):
        calls["verify"] = (tuple(impls), device.type, small)
        return [{"impl": "torch", "case": "stand-in case 1", "ok": True, "out_err": 0.0}]

    def add_bench_args(parser):
        parser.add_argument("--standin-knob", type=int, default=3, help="standin: a flag of its own")

    def bench_cli(args):
        calls["bench"] = args.standin_knob
        print("stand-in bench ran")
        return 0

    kernels = types.ModuleType("standin_backend.kernels")
    kernels.SHIPPED_SPECS = ["a", "b"]
    kernels.kernel_name = lambda spec: f"standin_{spec}"
    kernels.BUDGETS_PATH = "unused.json"
    for name, obj in (("run_verify", run_verify), ("add_bench_args", add_bench_args), ("bench_cli", bench_cli)):
        setattr(pkg, name, obj)
    monkeypatch.setitem(sys.modules, "standin_backend", pkg)
    monkeypatch.setitem(sys.modules, "standin_backend.kernels", kernels)
    line = OpFamily("standin", "standin_backend", verify="standin_backend:run_verify",
                    bench="standin_backend:bench_cli",
                    bench_args="standin_backend:add_bench_args", flydsl_kernels="standin_backend.kernels")
    monkeypatch.setattr(ops, "OPS", ops.OPS + (line,))
    return calls


def test_a_new_op_shows_up_in_info_verify_and_bench(standin_op, capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "standin: implementations" in out and "force with FLYDSL_BACKENDS_STANDIN=<name>" in out
    assert cli.main(["verify", "--op", "standin"]) == 0
    out = capsys.readouterr().out
    assert "stand-in case 1" in out and "1 passed, 0 failed" in out
    assert standin_op["verify"][0] == ("torch",)
    assert cli.main(["bench", "standin", "--host", "--standin-knob", "7"]) == 0  # --host: runs without a GPU
    assert "stand-in bench ran" in capsys.readouterr().out and standin_op["bench"] == 7


def test_the_compile_gate_takes_kernels_from_the_table(standin_op):
    mods = dict(compile_gate.kernel_modules())
    assert set(mods) == {"kda", "standin"}
    assert [mods["standin"].kernel_name(s) for s in mods["standin"].SHIPPED_SPECS] == ["standin_a", "standin_b"]


def test_unknown_op_is_a_value_error():
    with pytest.raises(ValueError, match="op: expected one of"):
        ops.get("nope")
