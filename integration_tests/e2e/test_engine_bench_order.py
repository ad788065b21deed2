"""The engine benchmark's run order and its ratio table (no engine is built): throughput-only pairs run in
both orders by default, and the ratio of a point comes from every timed run of each backend."""

import pytest

from integration_tests.e2e import engine_bench as eb


def test_pairs_run_in_both_orders():
    engines = [("FLYDSL", "eager", 1024, True), ("TRITON_ATTN", "eager", 1024, True),
               ("FLYDSL", "graphs", 1024, False), ("TRITON_ATTN", "graphs", 1024, False),
               ("FLYDSL", "graphs", 131072, False), ("TRITON_ATTN", "graphs", 131072, False),
               ("FLYDSL", "compiled", 1024, True)]
    out = eb.in_both_orders(engines)
    assert out == engines[:2] + [("TRITON_ATTN", "eager", 1024, False), ("FLYDSL", "eager", 1024, False),
                                 engines[2], engines[3], engines[3], engines[2],
                                 engines[4], engines[5], engines[5], engines[4]] + engines[6:]
    assert eb.in_both_orders(engines, "once") == engines
    with pytest.raises(ValueError, match="ENGINE_BENCH_ORDER"):
        eb.in_both_orders(engines, "twice")


def test_vllm_settings_take_the_order_from_the_environment(monkeypatch):
    monkeypatch.delenv("ENGINE_BENCH_ENGINES", raising=False)
    monkeypatch.delenv("ENGINE_BENCH_ORDER", raising=False)
    both = [e[:3] for e in eb.settings(cpu=False).engines if e[1] == "graphs"]
    assert both[:4] == [("FLYDSL", "graphs", 1024), ("TRITON_ATTN", "graphs", 1024),
                        ("TRITON_ATTN", "graphs", 1024), ("FLYDSL", "graphs", 1024)]
    monkeypatch.setenv("ENGINE_BENCH_ORDER", "once")
    assert len([e for e in eb.settings(cpu=False).engines if e[1] == "graphs"]) == 4


def test_kimi_graph_pair_runs_again_in_the_other_order(monkeypatch):
    monkeypatch.delenv("ENGINE_BENCH_ENGINES", raising=False)
    monkeypatch.delenv("ENGINE_BENCH_ORDER", raising=False)
    graphs = [e for e in eb.kimi_settings().engines if e[1] == "graphs"]
    assert graphs == [("KDA:vllm", "graphs", 2048, True), ("KDA:flydsl", "graphs", 2048, True),
                      ("KDA:flydsl", "graphs", 2048, False), ("KDA:vllm", "graphs", 2048, False)]
    eager = [e for e in eb.kimi_settings().engines if e[1] == "eager"]
    assert eager == [("KDA:vllm", "eager", 2048, True), ("KDA:flydsl", "eager", 2048, True),
                     ("KDA:flydsl", "eager", 2048, False), ("KDA:vllm", "eager", 2048, False)]
    monkeypatch.setenv("ENGINE_BENCH_ORDER", "once")
    assert len([e for e in eb.kimi_settings().engines if e[1] == "graphs"]) == 2
    monkeypatch.setenv("ENGINE_BENCH_ORDER", "twice")
    with pytest.raises(ValueError, match="ENGINE_BENCH_ORDER"):
        eb.kimi_settings()


def _row(backend, mode, length, batch, seconds):
    return {"backend": backend, "mode": mode, "max_model_len": length, "batch": batch,
            "seconds": f"{seconds:.4f}" if seconds else ""}


def test_speed_ratio_uses_every_engine_of_each_backend():
    rows = [_row("FLYDSL", "graphs", 1024, 64, 0.56), _row("TRITON_ATTN", "graphs", 1024, 64, 0.37),
            _row("TRITON_ATTN", "graphs", 1024, 64, 0.55), _row("FLYDSL", "graphs", 1024, 64, 0.38),
            _row("FLYDSL", "graphs", 1024, 16, 0.40), _row("TRITON_ATTN", "graphs", 1024, 16, 0.0),  # a failed row
            _row("FLYDSL", "eager", 1024, 16, 0.90), _row("TRITON_ATTN", "eager", 1024, 16, 0.99)]
    got = {(q["mode"], q["batch"]): q for q in eb.speed_ratios(rows, "FLYDSL")}
    assert set(got) == {("graphs", 64), ("eager", 16)}  # a point without both backends is left out
    assert got[("graphs", 64)]["ratio"] == pytest.approx(((0.37 + 0.55) / 2) / ((0.56 + 0.38) / 2))
    assert got[("graphs", 64)]["engines"] == (2, 2)
    assert got[("eager", 16)]["ratio"] == pytest.approx(0.99 / 0.90)
    assert got[("eager", 16)]["base"] == "TRITON_ATTN"
    # two engines of each backend that disagree by ~1.5x leave the point unsettled; one engine each never settles
    assert got[("graphs", 64)]["spread"] == pytest.approx({"FLYDSL": 0.56 / 0.38, "TRITON_ATTN": 0.55 / 0.37})
    assert not got[("graphs", 64)]["settled"] and not got[("eager", 16)]["settled"]
    close = [_row("FLYDSL", "graphs", 1024, 64, 0.50), _row("TRITON_ATTN", "graphs", 1024, 64, 0.52),
             _row("TRITON_ATTN", "graphs", 1024, 64, 0.53), _row("FLYDSL", "graphs", 1024, 64, 0.51)]
    assert eb.speed_ratios(close, "FLYDSL")[0]["settled"]


def test_summary_holds_the_ratio_table(tmp_path):
    b = eb.Bench(out=tmp_path, s=eb.settings(cpu=True), model_dir=tmp_path, device="cpu", commit="abc")
    for backend, secs in (("FLYDSL", 0.5), ("TRITON_ATTN", 0.4), ("TRITON_ATTN", 0.6), ("FLYDSL", 0.5)):
        b.row(backend, "graphs", 1024, 64, 8192, secs)
    b.report(final=False)
    md = (tmp_path / "summary.md").read_text()
    assert "| graphs | 1024 | 64 | 1.000x (vs TRITON_ATTN) | 2 / 2 | 1.000x / 1.500x | no |" in md, md


def test_runs_note_lists_every_run_and_its_full_collections():
    assert eb.runs_note([0.5], [0]) == ""
    note = eb.runs_note([0.39, 0.62, 0.4], [0, 1, 0])
    assert note == "; median of 3 runs (0.3900-0.6200 s); runs 0.3900 0.6200 0.4000; full GCs 0 1 0"
    assert eb.runs_note([0.39, 0.62], None) == "; median of 2 runs (0.3900-0.6200 s); runs 0.3900 0.6200"


def test_kimi_accuracy_pairs_take_the_accuracy_engines_only(tmp_path, monkeypatch):
    monkeypatch.delenv("ENGINE_BENCH_ENGINES", raising=False)
    monkeypatch.delenv("ENGINE_BENCH_ORDER", raising=False)
    b = eb.KimiBench(out=tmp_path, s=eb.kimi_settings(), model_dir=tmp_path, device="cpu", commit="abc")
    for label in ("KDA:vllm eager 2048", "KDA:flydsl eager 2048", "KDA:vllm graphs 2048", "KDA:flydsl graphs 2048"):
        b.accuracy[label] = {"tokens": [[1, 2]], "logprobs": [[{1: (1, -0.1)}, {2: (1, -0.1)}]]}
    # the reversed graph pair (throughput only) adds no second accuracy pair
    assert b.accuracy_pairs() == [("KDA:vllm eager 2048", "KDA:flydsl eager 2048"),
                                  ("KDA:vllm graphs 2048", "KDA:flydsl graphs 2048")]


def test_same_tokens_compare_every_engine_of_each_backend(tmp_path):
    b = eb.Bench(out=tmp_path, s=eb.settings(cpu=True), model_dir=tmp_path, device="cpu", commit="abc")
    good, bad = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    for backend, toks in (("FLYDSL", good), ("TRITON_ATTN", good), ("TRITON_ATTN", good), ("FLYDSL", bad)):
        b.generated.setdefault(("graphs", 1024, 2), {}).setdefault(backend, []).append(toks)
    _, graphs = b.compare()
    # the last FLYDSL engine differs in one sequence: found though the first engines agree
    assert graphs == [{"mode": "graphs", "max_model_len": 1024, "batch": 2, "a": "FLYDSL", "b": "TRITON_ATTN",
                       "identical_sequences": 1, "sequences": 2, "engines": (2, 2)}]


def test_runs_note_gives_each_runs_engine_steps():
    note = eb.runs_note([0.39, 0.62], [0, 0], [129, 193])
    assert note.endswith("; full GCs 0 0; steps 129 193")
    assert "steps" not in eb.runs_note([0.39, 0.62], None, None)


def test_counting_steps_counts_scheduled_steps_and_restores_the_scheduler(monkeypatch):
    sched = pytest.importorskip("vllm.v1.core.sched.scheduler")

    class Out:
        def __init__(self, n):
            self.total_num_scheduled_tokens = n

    plan = iter([3, 0, 64, 1])
    monkeypatch.setattr(sched.Scheduler, "schedule", lambda self, *a, **k: Out(next(plan)))
    fake = sched.Scheduler.__dict__["schedule"]
    with eb.counting_steps() as count:
        outs = [sched.Scheduler.schedule(None) for _ in range(4)]
    assert count == [3]  # the step that scheduled nothing is not one
    assert [o.total_num_scheduled_tokens for o in outs] == [3, 0, 64, 1]
    assert sched.Scheduler.__dict__["schedule"] is fake
    with eb.counting_steps(False) as count:
        assert count is None


def test_accuracy_pairs_run_again_in_the_other_order_for_throughput_only():
    engines = [("flydsl", "eager", 1024, True), ("triton", "eager", 1024, True),
               ("flydsl", "graphs", 1024, False), ("triton", "graphs", 1024, False),
               ("flydsl", "eager", 1024, True)]  # no partner: as listed
    out = eb.in_both_orders(engines)
    assert out == [engines[0], engines[1], ("triton", "eager", 1024, False), ("flydsl", "eager", 1024, False),
                   engines[2], engines[3], engines[3], engines[2], engines[4]]
    # an accuracy engine next to a throughput-only one of the other backend is not a pair
    mixed = [("flydsl", "eager", 1024, True), ("triton", "eager", 1024, False)]
    assert eb.in_both_orders(mixed) == mixed


def test_sglang_settings_run_every_pair_in_both_orders(monkeypatch):
    from integration_tests.e2e import sglang_engine_bench as sb
    monkeypatch.delenv("SGLANG_BENCH_ENGINES", raising=False)
    monkeypatch.delenv("ENGINE_BENCH_ORDER", raising=False)
    engines = sb.settings(cpu=False).engines
    assert len(engines) == 16
    assert engines[:4] == [("flydsl", "eager", 1024, True), ("triton", "eager", 1024, True),
                           ("triton", "eager", 1024, False), ("flydsl", "eager", 1024, False)]
    assert sum(e[3] for e in engines) == 2  # accuracy once per backend
    monkeypatch.setenv("ENGINE_BENCH_ORDER", "once")
    assert len(sb.settings(cpu=False).engines) == 8
