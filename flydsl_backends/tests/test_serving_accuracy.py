"""The serving-accuracy command's rules and usage errors, without a framework (the engines' runs are in
integration_tests/e2e/test_{vllm,sglang}_real_models.py)."""

from __future__ import annotations

import math

import pytest
import torch

from flydsl_backends import cli
from flydsl_backends import serving_accuracy as sa


def _gen(ids, tops):
    return sa.Generation(list(ids), [dict(t) for t in tops])


def test_logprobs_rule_passes_identical_and_top_k_swaps_and_fails_outside():
    top = {1: -0.1, 2: -2.0, 3: -3.0}
    a = _gen([1, 1, 1], [top] * 3)
    assert sa.first_divergence(a, a) == (True, None, "")
    # diverges at position 1, each token in the other's top-5: passes, nothing after is compared
    b = _gen([1, 2, 9], [top, {2: -0.1, 1: -0.5}, {9: 0.0}])
    ok, at, _ = sa.first_divergence(a, b)
    assert ok and at == 1
    # the other run's token is not in this run's top: fails at that position
    c = _gen([1, 7, 1], [top, {7: -0.1, 8: -0.2}, top])
    ok, at, msg = sa.first_divergence(a, c)
    assert not ok and at == 1 and "position 1" in msg
    # top_k counts: token 3 is third, so top-2 excludes it
    d = _gen([3, 1, 1], [{3: -0.1, 1: -0.2}] + [top] * 2)
    assert sa.first_divergence(a, d, top_k=3)[0]
    assert not sa.first_divergence(a, d, top_k=2)[0]


def test_compare_counts_teacher_forced_agreement_over_generated_positions_only():
    prompts = [[5, 6, 7]]
    gens = [_gen([8, 9], [{8: 0.0}, {9: 0.0}])]
    # scores cover positions 1..4 of prompt + gen (4 predictions); the generated tokens are predicted at
    # indices len(prompt) - 1 = 2 and 3
    forced = [sa.Scores([0.0] * 4, [0, 0, 8, 1])]
    row = sa.compare("x", gens, 10.0, "ref", gens, 10.0, forced, prompts)
    assert row.positions == 2 and row.top1 == 0.5
    assert row.prompts_passed == 1 and row.identical == 1 and not row.ok  # 50% top-1 fails
    forced = [sa.Scores([0.0] * 4, [1, 1, 8, 9])]  # prompt positions do not count
    row = sa.compare("x", gens, 10.2, "ref", gens, 10.0, forced, prompts)
    assert row.top1 == 1.0 and row.ok and math.isclose(row.ppl_delta, 0.02)
    row = sa.compare("x", gens, 10.3, "ref", gens, 10.0, forced, prompts)
    assert not row.ok  # 3% perplexity
    assert "FAIL" in sa.format_table([row], "m", "vllm")
    info = sa.compare("y", gens, 10.3, "ref", gens, 10.0, forced, prompts, checked=False)
    assert "outside (info)" in sa.format_table([info], "m", "vllm")


def test_perplexity_and_the_shipped_text():
    assert math.isclose(sa.perplexity([math.log(0.5)] * 4), 2.0)
    text = sa.perplexity_text()
    assert text.lstrip().startswith("Apache License") and len(text.split()) > 1000


def test_fp8_round_saturates_and_matches_the_e4m3_grid():
    x = torch.tensor([0.0, 1.0, 1.1, -3.3, 500.0, -1e4, 0.0011])
    y = sa.fp8_round(x)
    assert y.dtype == torch.float32
    assert y[0] == 0 and y[1] == 1 and y[2] == 1.125 and y[3] == -3.25
    assert y[4] == 448 and y[5] == -448  # saturates, as the cache writers do
    assert float(sa.fp8_round(x, scale=2.0)[4]) == 512.0  # 250 -> 256 on the grid (step 16), x2


def test_engine_args_parse_json_values_and_refuse_bad_items():
    assert sa._parse_engine_args(["max_model_len=4096", "enforce-eager=true", "name=abc"]) == {
        "max_model_len": 4096, "enforce_eager": True, "name": "abc"}
    with pytest.raises(ValueError, match="--engine-arg"):
        sa._parse_engine_args(["novalue"])


@pytest.mark.parametrize("argv, message", [
    (["--engine-arg", "x"], "--engine-arg"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--kv-scale", "0"], "--kv-scale"),
    (["--kv-scale", "nan"], "--kv-scale"),
])
def test_cli_usage_errors_exit_2_naming_the_flag(argv, message, capsys):
    rc = cli.main(["serving-accuracy", "--framework", "vllm", "--model", "/nonexistent", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_framework_that_is_not_installed(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real(n, *a))
    assert cli.main(["serving-accuracy", "--framework", "sglang", "--model", "/nonexistent"]) == 2
    assert "not installed" in capsys.readouterr().err
