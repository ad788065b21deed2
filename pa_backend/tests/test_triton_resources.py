"""The Triton paged-attention kernels (decode partition + reduce, write_kv) compile for sm_90 (no GPU needed) without
spills, but for the measured exceptions in ``SPILL_ALLOWED``; and for AMD gfx942 / gfx950 (the users' MI300X /
MI355X, where these kernels are the portable path) with the launcher's AMD tilings, without scratch (but for
``AMD_SCRATCH_ALLOWED``, empty today)."""

import os

import pytest

from backend_core import platform
from backend_core.tests.aot import run_report_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not platform.triton_available(), reason="triton not installed")

# two halves, one subprocess each (so parallel test workers share the compiles)
SCRIPTS = {"shipped": """
import json
from pa_backend.tests.triton_resources import SHIPPED_CONFIGS, ptxas_report
rows = [[list(c), ptxas_report(*c)] for c in SHIPPED_CONFIGS]
print(json.dumps(rows))
""", "variants": """
import json
from pa_backend.tests.triton_resources import ptxas_report
rows = [[["grid", D, v5], ptxas_report(D=D, v5d=v5, per_token=v5, queue=False)] for D in (64, 128) for v5 in (0, 1)]
rows += [[["direct", D, m, v5], ptxas_report(D=D, M=m, v5d=v5, per_token=v5, direct=True, sinks=True)]
         for D in (64, 128, 256) for m in (16, 64) for v5 in (0, 1)]
rows += [[["direct-prefill", D, m], ptxas_report(D=D, M=m, ragged=True, direct=True, sinks=True)]
         for D, m in ((128, 256), (256, 64), (64, 128))]
rows += [[["reduce", D, m], ptxas_report(D=D, M=m, kernel="reduce")] for D, m in ((256, 64), (128, 16), (64, 16))]
rows += [[["prefill", D, m], ptxas_report(D=D, M=m, ragged=True)] for D, m in ((128, 256), (256, 64), (64, 128))]
rows.append([["prefill-reduce"], ptxas_report(D=256, M=64, kernel="reduce", ragged=True)])
rows += [[["write", D, v5], ptxas_report(D=D, v5d=v5, per_token=v5, kernel="write")]
         for D in (64, 256) for v5 in (0, 1)]
print(json.dumps(rows))
"""}


@pytest.mark.parametrize("part", sorted(SCRIPTS))
def test_decode_kernels_compile_for_sm90_without_spills(part):
    proc, rows = run_report_script(SCRIPTS[part], ROOT)
    assert rows is not None, proc.stderr[-3000:]
    from pa_backend.tests.triton_resources import SPILL_ALLOWED

    for config, rep in rows:
        print(config, rep)
        assert rep["registers"] > 0, (config, rep)
        allowed = SPILL_ALLOWED.get(tuple(config), 0)
        assert rep["spill_stores"] <= allowed and rep["spill_loads"] <= 2 * allowed, (config, rep)
        # a decode program's allowed spills sit outside its tile loops (once per task, not per tile); the
        # prefill tile's are in its tile loop, measured faster than the spill-free tilings (SPILL_ALLOWED)
        assert rep["hot_spills"] >= 0, (config, rep)
        if config[0] not in ("prefill", "direct-prefill"):
            assert rep["hot_spills"] == 0, (config, rep)


def test_batch_dependent_scalars_are_not_specialized():
    """The scalars that change with the batch or the plan (item count, split, context bounds) do not
    specialize the compiled kernels (each value class would be a compile while serving); the strides do
    (their divisibility vectorizes the loads)."""
    script = ("import json\nfrom pa_backend.triton.pa_decode import pa_decode_partition_kernel as k, "
              "pa_decode_reduce_kernel as r\n"
              "print(json.dumps([[p.name for p in f.params if p.do_not_specialize] for f in (k, r)]))")
    proc, rows = run_report_script(script, ROOT, timeout=300)
    assert rows is not None, proc.stderr[-3000:]
    part, red = rows
    assert {"n_items", "P", "max_tokens", "num_blocks", "few_target", "min_pt", "long_pt", "short_target",
            "sliding_window"} <= set(part)
    assert {"P", "few_target", "min_pt", "long_pt", "short_target", "sliding_window"} <= set(red)
    assert not any(n.startswith("stride_") for n in part + red)


AMD_SCRIPT = """
import json, sys
from pa_backend.tests.triton_resources import amdgcn_report
rows = []
for arch in sys.argv[1:]:
    for D, bs, m, v5 in ((128, 16, 16, 0), (64, 16, 16, 1), (128, 16, 64, 0), (256, 64, 16, 1), (256, 16, 16, 1),
                         (128, 128, 64, 1)):
        rows.append([[arch, D, bs, m, v5],
                     amdgcn_report(arch, D=D, block_size=bs, M=m, v5d=bool(v5), per_token=bool(v5))])
    for D in (128, 256, 64):  # the AMD prefill tiling's rows
        rows.append([[arch, "prefill", D], amdgcn_report(arch, D=D, M=None, ragged=True)])
    for D, m in ((128, 16), (256, 64)):
        rows.append([[arch, "reduce", D, m], amdgcn_report(arch, D=D, M=m, kernel="reduce")])
    rows.append([[arch, "prefill-reduce", 128, 128], amdgcn_report(arch, D=128, M=128, kernel="reduce", ragged=True)])
    rows.append([[arch, "write", 128, 1], amdgcn_report(arch, D=128, v5d=True, per_token=True, kernel="write")])
print(json.dumps(rows))
"""


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_kernels_compile_for_amd_gfx942_and_gfx950(arch):
    """What the launcher builds on MI300X (gfx942: e4m3fnuz caches) and MI355X (gfx950): every kernel compiles to
    a code object within the register file (VGPRs + AGPRs) and LDS, without scratch (``AMD_SCRATCH_ALLOWED``
    lists exceptions; none today). Compiled here only; nothing ran on AMD hardware."""
    import triton.backends

    if "amd" not in triton.backends.backends:
        pytest.skip("this Triton has no AMD backend")
    proc, rows = run_report_script(AMD_SCRIPT, ROOT, args=[arch])
    assert rows is not None, proc.stderr[-3000:]
    from pa_backend.tests.triton_resources import AMD_SCRATCH_ALLOWED

    assert len(rows) == 13 and {r[0][0] for r in rows} == {arch}
    for config, rep in rows:
        print(config, rep)
        assert rep["hsaco_bytes"] > 0 and rep["vgprs"] > 0 and rep["vgprs"] + max(rep["agprs"], 0) <= 512, (config, rep)
        assert rep["lds"] <= 65536 and rep["occupancy"] >= 1, (config, rep)
        allowed = AMD_SCRATCH_ALLOWED.get(tuple(config[1:]), 0)
        assert 0 <= rep["scratch"] <= allowed, (config, rep)
