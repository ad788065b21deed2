"""The shipped Triton KDA configurations compile for sm_90 without register spills.

Runs on CPU: Triton compiles for an NVIDIA target without a GPU and its bundled ptxas reports
the resources (in a subprocess, since the test session runs Triton in interpreter mode).
"""

import os

import pytest

from backend_core import platform
from backend_core.tests.aot import run_report_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not platform.triton_available(), reason="triton not installed")

SCRIPT = """
import json
from kda_backend.tests.triton_resources import SHIPPED_CONFIGS, ptxas_report
rows = [[list(c), ptxas_report(c[0], c[1], c[2], c[3])] for c in SHIPPED_CONFIGS]
# a configuration that must spill (a 128x128 FP32 tile in one warp): proves the check can fail
rows.append([["fp32", False, 128, 1, "must-spill"], ptxas_report("fp32", False, 128, 1)])
print(json.dumps(rows))
"""


def test_shipped_configs_have_no_spills():
    proc, rows = run_report_script(SCRIPT, ROOT)
    if rows is None and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("this Triton wheel ships no ptxas")
    assert rows is not None, proc.stderr[-3000:]
    *shipped, (_, must_spill) = rows
    assert must_spill["spill_stores"] > 0, must_spill  # the report does see spills
    for config, rep in shipped:
        print(config, rep)
        assert rep["registers"] > 0, (config, rep)
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (config, rep)


AMD_SCRIPT = """
import json
from kda_backend.tests.triton_resources import SHIPPED_CONFIGS, amdgcn_report
rows = [[[arch] + list(c), amdgcn_report(arch, *c)] for arch in ("gfx942", "gfx950") for c in SHIPPED_CONFIGS]
print(json.dumps(rows))
"""


def test_shipped_configs_compile_for_amd_without_scratch():
    """The same configurations compiled for gfx942 (MI300X) and gfx950 (MI355X): a code object within the
    register file, no scratch. Compiled here only; nothing ran on AMD hardware."""
    import triton.backends

    if "amd" not in triton.backends.backends:
        pytest.skip("this Triton has no AMD backend")
    proc, rows = run_report_script(AMD_SCRIPT, ROOT)
    assert rows is not None, proc.stderr[-3000:]
    assert len(rows) == 2 * 10
    for config, rep in rows:
        print(config, rep)
        assert rep["hsaco_bytes"] > 0 and 0 < rep["vgprs"] <= 512 and rep["scratch"] == 0, (config, rep)


VERIFY_SCRIPT = """
import json
from kda_backend.tests.triton_resources import VERIFY_CONFIGS, verify_ptxas_report
rows = [[list(c), verify_ptxas_report(*c)] for c in VERIFY_CONFIGS]
# 8 warps replicate the [K] vectors twice as much: proves the bound can fail
rows.append([["fp32", True, False, True, 8, "over-bound"], verify_ptxas_report("fp32", True, False, True, 8)])
print(json.dumps(rows))
"""

VERIFY_SPILL_BOUND = 256  # bytes: the one-program-per-head verify kernel spills a little at K = 128 (kda_verify.py)


@pytest.mark.slow
def test_verify_kernel_spills_stay_small():
    """``kda_verify_kernel`` as launched (K = V = 128, 4 warps) compiles for sm_90 within a small spill bound,
    slot and buffer forms, tree, both state dtypes: a regression guard until the V split lands."""
    proc, rows = run_report_script(VERIFY_SCRIPT, ROOT)
    if rows is None and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("this Triton wheel ships no ptxas")
    assert rows is not None, proc.stderr[-3000:]
    *shipped, (_, over) = rows
    assert over["spill_stores"] > VERIFY_SPILL_BOUND, over
    for config, rep in shipped:
        print(config, rep)
        assert 0 < rep["registers"] and rep["spill_stores"] <= VERIFY_SPILL_BOUND, (config, rep)
