"""The docs document what the code reads: every environment variable the package reads appears in
docs/environment.md's table; the README's examples run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("backend_core", "kda_backend", "pa_backend", "flydsl_backends")
# a literal variable name passed to a reader, or bound to a *_ENV constant
READS = re.compile(r"""(?:environ\.get|environ\[|getenv|_env_int|env_positive_int|_env_arch)"""
                   r"""\(?\s*["']([A-Z][A-Z0-9_]+)["']"""
                   r"""|\b[A-Z_]*ENV\s*=\s*["']([A-Z][A-Z0-9_]+)["']""")


def variables_read():
    names = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "tests" in path.parts:
                continue
            for m in READS.finditer(path.read_text()):
                names.add(m.group(1) or m.group(2))
    return names


def env_table():
    text = (ROOT / "docs" / "environment.md").read_text()
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)[=`]", text))


def test_every_variable_read_is_in_the_environment_table():
    read = variables_read()
    # registry overrides are built from each op family's name
    read |= {"FLYDSL_BACKENDS_KDA", "FLYDSL_BACKENDS_PA"}
    assert len(read) > 15, sorted(read)  # the scan itself still finds the readers
    missing = sorted(read - env_table())
    assert not missing, f"read by the code but not in docs/environment.md's table: {missing}"


def test_registry_override_names_match_the_op_families():
    import kda_backend
    import pa_backend

    assert {kda_backend.REGISTRY.env_var, pa_backend.REGISTRY.env_var} == {"FLYDSL_BACKENDS_KDA", "FLYDSL_BACKENDS_PA"}


OUTSIDE = "DESIGN" + " §"  # spelled in two pieces so this file does not match itself


def _sources():
    for pkg in PACKAGES + ("integration_tests", "benchmarks"):
        for path in (ROOT / pkg).rglob("*"):
            if path.suffix in (".py", ".md", ".sh") and "results" not in path.parts:
                yield path
    yield ROOT / "README.md"
    yield from (ROOT / "docs").glob("*.md")


def test_design_references_point_into_the_repository():
    """Docstrings and the README cite docs/design.md by section; every cited section exists, and
    nothing cites the planning document outside the repository."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", design, flags=re.M))
    cited = set()
    for path in _sources():
        text = path.read_text(errors="replace")
        assert OUTSIDE not in text, f"{path.relative_to(ROOT)} cites the out-of-repo DESIGN.md"
        cited |= set(re.findall(r"docs/design\.md §(\d+(?:\.\d+)?)", text))
    assert cited, "no docstring cites docs/design.md any more: drop this test or the file"
    assert cited <= sections, f"cited sections missing from docs/design.md: {sorted(cited - sections)}"


@pytest.mark.parametrize("family, printed", [("pa", "max |out - ref| ="), ("kda", "torch.Size([3, 4, 64])")])
def test_readme_examples_run(family, printed):
    """The README's tensor-level examples run as written (CPU: the torch reference) and check their answers."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    marker = f"<!-- example: {family} "
    assert marker in text
    block = text.split(marker, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert printed in proc.stdout
