"""``gsm8k_compare`` (docs/serving-accuracy.md's pass rule) on synthetic lm-eval results files: the
layout lm-eval 0.4.13 writes under ``--output_path`` (``<model>/results_<timestamp>.json`` with
``results``, ``n-samples``, ``n-shot``). Pure CPU, no server, no lm-eval needed."""

from __future__ import annotations

import json
import os
import time

import pytest

from integration_tests.e2e import gsm8k_compare as gc


def _results(dirpath, value, n=1319, shots=5, task="gsm8k", stderr=0.011, stamp="2026-12-03T10-00-00.0"):
    d = dirpath / "__models__Llama-3.1-8B"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"results_{stamp}.json"
    path.write_text(json.dumps({
        "results": {task: {"alias": task, "exact_match,strict-match": value,
                           "exact_match_stderr,strict-match": stderr,
                           "exact_match,flexible-extract": value + 0.02,
                           "exact_match_stderr,flexible-extract": stderr}},
        "n-shot": {task: shots}, "n-samples": {task: {"original": 1319, "effective": n}},
        "lm_eval_version": "0.4.13"}))
    return path


@pytest.mark.parametrize("fly,ref,status", [
    (0.800, 0.800, 0), (0.795, 0.800, 0), (0.810, 0.800, 0),  # equal, within a point either way
    (0.789, 0.800, 1), (0.812, 0.800, 1),  # more than a point lower / higher
    (0.150, 0.895, 1),  # a broken cache
])
def test_pass_rule(tmp_path, capsys, fly, ref, status):
    a, b = _results(tmp_path / "flydsl", fly), _results(tmp_path / "default", ref)
    assert gc.main([str(a), str(b)]) == status
    out = capsys.readouterr().out
    assert f"flydsl   {fly:.4f}" in out and f"default  {ref:.4f}" in out
    assert out.strip().splitlines()[-1] == ("PASS" if status == 0 else "FAIL")


def test_directories_pick_the_newest_results(tmp_path, capsys):
    old = _results(tmp_path / "flydsl", 0.10, stamp="2026-12-01T00-00-00.0")
    _results(tmp_path / "flydsl", 0.80, stamp="2026-12-02T00-00-00.0")
    past = time.time() - 3600
    os.utime(old, (past, past))
    _results(tmp_path / "default", 0.80)
    assert gc.main([str(tmp_path / "flydsl"), str(tmp_path / "default")]) == 0
    assert "PASS" in capsys.readouterr().out


def test_filter_and_tolerance_options(tmp_path):
    a, b = _results(tmp_path / "f", 0.70), _results(tmp_path / "d", 0.73)
    assert gc.main([str(a), str(b)]) == 1
    assert gc.main([str(a), str(b), "--tolerance", "0.05"]) == 0
    assert gc.read_score(a, filter_name="flexible-extract").value == pytest.approx(0.72)


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf", "x"])
def test_tolerance_must_be_a_finite_number_at_least_0(tmp_path, capsys, tolerance):
    """-1 failed identical runs, nan failed every run and inf passed every run."""
    a, b = _results(tmp_path / "f", 0.8), _results(tmp_path / "d", 0.8)
    with pytest.raises(SystemExit) as ei:
        gc.main([str(a), str(b), "--tolerance", tolerance])
    assert ei.value.code == 2 and "--tolerance" in capsys.readouterr().err


def test_a_nan_score_cannot_be_compared(tmp_path, capsys):
    a, b = _results(tmp_path / "f", float("nan")), _results(tmp_path / "d", 0.8)
    assert gc.main([str(a), str(b)]) == 2
    assert "not a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "not_json", "no_results", "other_task", "n_differs", "shots_differ",
                                  "empty_dir"])
def test_incomparable_inputs_exit_2(tmp_path, capsys, case):
    good = _results(tmp_path / "default", 0.8)
    fly = tmp_path / "flydsl.json"
    if case == "missing":
        fly = tmp_path / "nope.json"
    elif case == "not_json":
        fly.write_text("{not json")
    elif case == "no_results":
        fly.write_text(json.dumps({"config": {}}))
    elif case == "other_task":
        fly = _results(tmp_path / "f", 0.8, task="gsm8k_cot")
    elif case == "n_differs":
        fly = _results(tmp_path / "f", 0.8, n=200)
    elif case == "shots_differ":
        fly = _results(tmp_path / "f", 0.8, shots=8)
    elif case == "empty_dir":
        fly = tmp_path / "empty"
        fly.mkdir()
    assert gc.main([str(fly), str(good)]) == 2
    assert capsys.readouterr().err.startswith("ERROR: ")
