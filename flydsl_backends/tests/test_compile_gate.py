"""The FlyDSL compile gate: budget matching and the pass/fail rules (always), and a real
compile-only build that fails once a budget is lowered (when flydsl and the toolchain packages
are installed, as in .ci/run)."""

import importlib.util
import json

import pytest

from backend_core.flydsl_compile import vgpr_budget
from flydsl_backends import compile_gate as gate

OK_ROW = dict(kernel="kda_decode_h12_fp32", arch="gfx950", vgpr=120, agpr=0, sgpr=40, lds=2048, scratch=0,
              vgpr_spill=0, sgpr_spill=0)


def test_budget_matching_exact_then_longest_prefix_then_star():
    budgets = {"*": 256, "kda_decode": 160, "kda_decode_h32": 200, "kda_decode_h12_fp32": 128}
    assert vgpr_budget("kda_decode_h12_fp32", budgets) == 128
    assert vgpr_budget("kda_decode_h32_bf16", budgets) == 200
    assert vgpr_budget("kda_decode_h3_bf16", budgets) == 160
    assert vgpr_budget("other", budgets) == 256
    assert vgpr_budget("other", {"kda": 1}) is None


@pytest.mark.parametrize("change,reason", [
    (dict(), None),
    (dict(vgpr=129), "VGPR 129 > budget 128"),
    (dict(vgpr_spill=3), "spills (vgpr 3, sgpr 0)"),
    (dict(sgpr_spill=1), "spills (vgpr 0, sgpr 1)"),
    (dict(scratch=16), "scratch 16 B"),
    (dict(lds=65537, arch="gfx942"), "LDS 65537 B > 65536 B"),
    (dict(error="DSLCompileError: boom"), "compile error: DSLCompileError: boom"),
])
def test_verdict_rules(change, reason):
    row = {**OK_ROW, **change}
    lds = 65536 if row["arch"] == "gfx942" else 163840
    why = gate.verdict(row, {"*": 128}, lds)
    assert (why == []) if reason is None else (reason in "; ".join(why))


def test_missing_budget_fails():
    assert gate.verdict(OK_ROW, {"pa_": 100}, 163840) == ["no VGPR budget for this kernel in budgets.json"]


def test_shipped_budget_file_is_valid():
    budgets = gate.load_budgets()
    assert budgets and all(v > 0 for v in budgets.values())


def test_table_has_the_issue_columns():
    text = gate.format_table([{**OK_ROW, "waves": 4, "compile_s": 0.5, "verdict": "ok"}])
    head = text.splitlines()[0].split()
    assert head == ["kernel", "arch", "vgpr", "agpr", "sgpr", "lds", "scratch", "waves", "compile_s", "verdict"]


HAVE_TOOLCHAIN = all(importlib.util.find_spec(m) for m in ("flydsl", "ziglang", "triton"))


@pytest.mark.skipif(not HAVE_TOOLCHAIN,
                    reason="flydsl / ziglang not installed (pip install '.[flydsl-compile]'; .ci/run does)")
def test_gate_compiles_one_specialization_and_fails_on_a_lowered_budget(tmp_path, capsys):
    from kda_backend.flydsl import shipped as kernel

    name = kernel.kernel_name(kernel.SHIPPED_SPECS[0])
    out = tmp_path / "rows.json"
    assert gate.main(["--arch", "gfx942", "--only", name, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == [name] and rows[0]["vgpr"] > 0 and rows[0]["verdict"] == "ok"
    assert gate.main(["--arch", "gfx942", "--only", name, "--vgpr-budget", str(rows[0]["vgpr"] - 1)]) == 1
    assert f"FAIL {name} [gfx942]: VGPR {rows[0]['vgpr']} > budget {rows[0]['vgpr'] - 1}" in capsys.readouterr().out
