import os
import subprocess
import sys

import pytest
import torch

from backend_core.tests.testing import clear_device_memos, fake_gpus, nvidia_props
from flydsl_backends import cli


def test_info_runs(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kda: implementations" in out and "torch" in out and "flydsl" in out
    # each op's FlyDSL sources are listed under that op's registry with a flydsl implementation (the paged
    # ops: pa_decode, not the last of them), and write_kv's reference is described as a writer
    blocks = {b.split(":", 1)[0]: b for b in out.split("\n\n")}
    assert "flydsl sources" in blocks["kda"] and "flydsl sources" in blocks["pa_decode"]
    assert "flydsl sources" not in blocks["pa_prefill"] and "flydsl sources" not in blocks["write_kv"]
    assert "softmax" not in blocks["write_kv"]


def test_verify_passes_here(capsys):
    assert cli.main(["verify"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "PASS" in out


def test_verify_fails_on_a_wrong_implementation(monkeypatch, capsys):
    from kda_backend import REGISTRY

    impl = REGISTRY.get("torch")
    real = impl.run

    def wrong(p):
        out = real(p)
        out.add_(1.0)  # an implementation with a bug must turn the table red
        return out

    monkeypatch.setattr(impl, "run", wrong)
    assert cli.main(["verify", "--backend", "torch"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_says_when_what_was_asked_for_did_not_run(capsys, monkeypatch):
    """A typo, an implementation that cannot run here, or nothing run at all is exit status 2, never a
    pass with "0 passed, 0 failed"; --backend takes a comma list as well as repeats."""
    assert cli.main(["verify", "--backend", "tritn"]) == 2
    assert "unknown implementation(s) ['tritn']" in capsys.readouterr().err  # errors on stderr
    from kda_backend import REGISTRY

    monkeypatch.setattr(REGISTRY.get("torch"), "is_available", lambda: (False, "pretend"))
    assert cli.main(["verify", "--op", "kda", "--backend", "torch"]) == 2
    assert "not checked: kda/torch" in capsys.readouterr().out
    monkeypatch.undo()
    assert cli.main(["verify", "--op", "kda", "--backend", "torch,torch", "--small"]) == 0
    assert "kda   torch   PASS" in capsys.readouterr().out


def test_verify_is_not_a_pass_when_an_asked_for_implementation_declined_every_case(capsys, monkeypatch):
    """An implementation asked for with --backend that is available but skips every case (on AMD: FlyDSL's
    coverage) was counted as a pass next to another implementation's rows; an empty --backend is refused."""
    import kda_backend.verify as kv

    real = kv.run_verify

    def skipping(impls, device, small=False, **kw):
        rows = real(impls, device, small, **kw)
        return [dict(r, skipped="pretend: declined") if r["impl"] == "torch" else r for r in rows]

    monkeypatch.setattr(kv, "run_verify", skipping)
    assert cli.main(["verify", "--op", "kda", "--backend", "triton,torch"]) == 2
    assert "not checked: kda/torch (skipped on every case)" in capsys.readouterr().out
    assert cli.main(["verify", "--backend", ","]) == 2
    assert "--backend: no implementation named" in capsys.readouterr().err


def test_info_names_an_active_override(capsys, monkeypatch):
    """FLYDSL_BACKENDS_PA=flydsl where FlyDSL cannot run: every call raises, and ``info`` says so."""
    monkeypatch.setenv("FLYDSL_BACKENDS_PA", "flydsl")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "FLYDSL_BACKENDS_PA=flydsl is set" in out and "every pa_decode call will raise" in out


def test_help_works_with_a_malformed_environment(capsys, monkeypatch):
    monkeypatch.setenv("FLYDSL_BACKENDS_KDA", "bogus")
    with pytest.raises(SystemExit) as ei:
        cli.main(["--help"])
    assert ei.value.code == 0
    assert "FLYDSL_BACKENDS_KDA" in capsys.readouterr().err
    assert cli.main(["info"]) == 2


@pytest.fixture
def fake_nvidia(monkeypatch):
    """torch sees an NVIDIA GPU (no GPU needed): ``bench`` gets past its GPU check."""
    fake_gpus(monkeypatch, [nvidia_props()], hip=False)
    yield
    monkeypatch.undo()
    clear_device_memos()


def test_bench_out_is_checked_before_anything_is_timed(tmp_path, capsys, monkeypatch, fake_nvidia):
    """A folder, a file of another format, or a path under a file was found only after the whole run (a
    traceback, the timings lost), and a file of another format got rows appended under its header."""
    from backend_core.timing import RESULT_FIELDS, check_out

    other = tmp_path / "other.csv"
    other.write_text("date,commit,device,backend,mode\n")
    ours = tmp_path / "ours.csv"
    ours.write_text(",".join(RESULT_FIELDS) + "\n")
    notes = tmp_path / "README.md"
    notes.write_text("# notes\n")
    assert check_out(tmp_path / "new" / "x.csv") is None and check_out(ours) is None
    assert "folder" in check_out(tmp_path)
    assert "not a results CSV" in check_out(other) and "not a results CSV" in check_out(notes)
    assert "not a folder" in check_out(notes / "x.csv")
    ran = []
    import pa_backend.benchmark as pb

    monkeypatch.setattr(pb, "bench_cli", lambda args: ran.append(args) or [])
    for bad in (tmp_path, other, notes):
        assert cli.main(["bench", "pa", "--out", str(bad)]) == 2
        assert "--out: " in capsys.readouterr().err
    assert other.read_text() == "date,commit,device,backend,mode\n" and not ran


def test_bench_with_nothing_to_time_is_refused(capsys, fake_nvidia):
    assert cli.main(["bench", "pa", "--impl", "flydsl", "--out", os.devnull + ".csv"]) == 2
    assert "nothing to time" in capsys.readouterr().err


def test_accuracy_passes_here_and_fails_on_a_biased_state(monkeypatch, capsys):
    """``accuracy`` runs both families' long-horizon checks (a few steps here) and turns a state that drifts
    (a bias of 1e-3 per step: far below one step's tolerance in ``verify``) into a failure."""
    assert cli.main(["accuracy", "--steps", "6", "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "kda   torch   PASS" in out and "pa    torch   PASS" in out
    from kda_backend import REGISTRY

    impl = REGISTRY.get("torch")
    real = impl.run

    def biased(p):
        res = real(p)
        p.state.mul_(1.001)
        return res

    monkeypatch.setattr(impl, "run", biased)
    assert cli.main(["accuracy", "--op", "kda", "--steps", "20", "--backend", "torch"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bench_refuses_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("GPU present: bench would run")
    assert cli.main(["bench", "kda"]) == 2
    assert "bench needs a CUDA/ROCm GPU" in capsys.readouterr().err


def test_bench_kda_host_says_it_is_the_paged_ops_mode(capsys):
    """``--host`` belongs to ``bench pa``; ``bench kda --host`` ended in a RuntimeError traceback on CPU."""
    assert cli.main(["bench", "kda", "--host"]) == 2
    assert "bench pa --host" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["bench", "pa", "--host", "--trials", "0"], "--trials"),
    (["bench", "pa", "--host", "--trials", "-1"], "--trials"),
    (["bench", "pa", "--calls-per-graph", "0"], "--calls-per-graph"),
    (["bench", "pa", "--table-tokens", "-1"], "--table-tokens"),
    (["bench", "kda", "--batches", "a"], "--batches"),
    (["bench", "kda", "--batches", "1,0"], "--batches"),
    (["bench", "kda", "--heads", "0"], "--heads"),
    (["bench", "kda", "--state-dtypes", "fp16"], "--state-dtypes"),
    (["bench", "kda", "--f-b", "yes"], "--f-b"),
    (["accuracy", "--steps", "0"], "--steps"),
    (["bench", "kda", "--lower-bound", "nan"], "--lower-bound"),
    (["bench", "kda", "--lower-bound", "-inf"], "--lower-bound"),
])
def test_bad_flag_values_are_refused_by_name(argv, flag, capsys):
    """A bad value is one argparse error naming its flag (exit 2) before any work: no traceback after the
    GPU setup, no value silently replaced or ignored."""
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err, err


def test_bench_checks_impl_names_and_host_flags(capsys):
    """``--impl`` names are checked against the family's implementations before anything runs, also with
    ``--host``; ``--out`` with ``--host`` (which prints and writes no CSV) is refused, not ignored."""
    assert cli.main(["bench", "pa", "--host", "--impl", "nosuch", "--trials", "1"]) == 2
    assert "--impl: nosuch not an implementation of pa" in capsys.readouterr().err
    assert cli.main(["bench", "pa", "--host", "--trials", "1", "--out", "x.csv"]) == 2
    assert "--out" in capsys.readouterr().err
    assert cli.main(["bench", "pa", "--host", "--trials", "1"]) == 0
    assert "null: plan.run" in capsys.readouterr().out


@pytest.mark.parametrize("var, value", [("FLYDSL_BACKENDS_KDA", "trition"), ("FLYDSL_BACKENDS_PA", "nosuch"),
                                        ("FLYDSL_BACKENDS_SOURCE", "aitr"), ("FLYDSL_BACKENDS_TRITON_DIRECT", "yes"),
                                        # the Triton tuning variables: a bad value was a FAIL row of verify
                                        ("FLYDSL_BACKENDS_KDA_TRITON_BV", "abc"),
                                        ("FLYDSL_BACKENDS_PA_TRITON_BT", "-1"),
                                        ("FLYDSL_BACKENDS_PA_FP8_QK", "2")])
def test_malformed_environment_is_one_error_line(var, value):
    """``info`` (and every command) reports a misspelled setting as one line, exit 2, instead of passing and
    leaving the error to a server's first call (or, for FLYDSL_BACKENDS_TRITON_DIRECT, a traceback)."""
    env = dict(os.environ, **{var: value})  # a fresh process: some are read when the package is imported
    r = subprocess.run([sys.executable, "-m", "flydsl_backends", "info"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and var in r.stderr and value in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_package_imports_without_triton_or_frameworks():
    code = ("import sys; import flydsl_backends, kda_backend, backend_core, flydsl_backends.cli; "
            "bad = [m for m in ('triton', 'flydsl', 'sglang', 'vllm', 'aiter') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_console_script_entry_point():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="console_scripts") if e.name == "flydsl-backends"]
    if not eps:
        pytest.skip("package not installed (running from a source tree)")
    assert eps[0].value == "flydsl_backends.cli:main"
