"""A real vLLM 0.33 engine serving the run-time model (``tiny_model``) with this project's backend
(``attention_backend="FLYDSL"``) and with vLLM's own ``TRITON_ATTN``, both on an FP8 KV cache:
accuracy and throughput (issue 16). A benchmark script, not a test:

    python -m integration_tests.e2e.engine_bench --out DIR          (GPU: vllm_gpu.prepare())
    python -m integration_tests.e2e.engine_bench --out DIR --cpu    (CPU smoke: vllm_cpu.prepare())

Engines (one per backend, mode and max_model_len, built once, used for every batch, then freed):
* eager, max_model_len 1024: accuracy (16 prompts x 64 greedy tokens, logprobs=5) and eager throughput;
* CUDA graphs (FULL_DECODE_ONLY, no torch.compile), max_model_len 1024 and 131072: throughput;
* compiled (torch.compile, FULL_AND_PIECEWISE graphs), max_model_len 1024: accuracy and throughput.
``ENGINE_BENCH_ENGINES="BACKEND:MODE:MAX_LEN,..."`` runs a subset. Every pair runs in both orders
(FLYDSL, TRITON_ATTN, TRITON_ATTN, FLYDSL: the tiny model's engine is host-bound, and one run per backend in
a fixed order left 0.66x-1.0x swings unexplained); the second engine of each backend is throughput only
(an accuracy pair is compared once); ``ENGINE_BENCH_ORDER=once`` runs each once. summary.md's
ratio table takes every timed run of each backend and marks a point settled only where each backend ran more
than one engine and their medians agree within ``SETTLED_SPREAD`` (with ``once`` no point reads settled);
the CSV note lists every run.
Accuracy: FLYDSL against TRITON_ATTN with vLLM's ``check_logprobs_close`` rule (at the first position
where two greedy sequences differ, each chosen token must be in the other run's top-5), the number of
identical sequences, the copy rule of the model (``tiny_model.copy_rule_agreement``) and the argmax
agreement of HF transformers teacher-forced on each engine's tokens. Throughput: batch 16 and 64, 128
output tokens (ignore_eos), ``llm.generate`` timed after a warm-up ``generate`` of the same batch, the
median of 5 timed calls (GPU); the graph-mode tokens of the two backends are compared too.

Writes into --out: ``engine_bench.csv`` (date, commit from $FLYDSL_BACKENDS_COMMIT, device, backend, mode,
max_model_len, batch, tokens, seconds, tok_s, notes; rewritten after every row), ``accuracy.json`` and
``summary.md`` (rewritten after every engine: a run killed at the call's time limit still leaves them).
Each engine and each measurement runs in its own try/except: an error is recorded (CSV notes, summary)
and the rest still run; ``--budget`` seconds (default 480, $ENGINE_BENCH_BUDGET) stops starting new
engines. Exit status 0 only when nothing failed and every accuracy pair passed.

``--model kimi`` (GPU): the tiny Kimi-Linear (``tiny_kimi``: 3 KDA layers + 1 MLA layer, bf16, MLA on
TRITON_MLA, ``vllm_kimi.prepare_gpu()``) with this project's KDA decode hook off (``KDA:vllm``, vLLM's
own Triton recurrent decode) and on (``KDA:flydsl``, ``additional_config={"flydsl_kda": true}``), eager and
CUDA graphs (FULL_DECODE_ONLY), max_model_len 2048. Accuracy: 16 prompts x 64-94 greedy tokens (prompt i
gets 64 + 2i), submitted 8 at a time then 8 more after 6 engine steps, at most 16 running, so the engine
runs batched prefill, pure decode batches (the hook's path; in graph mode padded to a captured size as
sequences finish) and mixed prefill+decode batches (handed back to vLLM); pair rule per mode: hook on
against hook off (check_logprobs_close, identical sequences, max |logprob difference| of the chosen
token before the first divergence), and the on-run must have called ``kda_decode`` (calls and rows are
recorded). Throughput: batch 16 and 64 as above, tokens compared between the two. With ENGINE_BENCH_ORDER=both
(the default) each pair runs again in the other order, throughput only (hook on, then off).

``--cpu``: the same code path on vLLM's CPU worker (FLYDSL on the torch reference; TRITON_ATTN does not
run there): eager only, batch 2, 8 tokens, max_model_len 1024 and 131072; the accuracy pair is FLYDSL at
1024 against FLYDSL at 131072 (server-width block tables).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from integration_tests.e2e import tiny_model as tm

TOP_N = 5
CSV_FIELDS = ("date", "commit", "device", "backend", "mode", "max_model_len", "batch", "tokens", "seconds",
              "tok_s", "notes")


@dataclass
class Settings:
    cpu: bool
    acc_prompts: int
    acc_tokens: int
    batches: tuple
    out_tokens: int
    engines: list  # [(backend, mode, max_model_len, accuracy)]
    kv_bytes: int
    capture_sizes: tuple = ()
    repeats: int = 1  # timed generate calls per throughput point (the median is reported)
    # GPU: the KV size is kv_bytes; the utilization only sets the free memory a new engine demands at start
    # (an engine not fully freed by the previous one must not fail the next)
    extra: dict = field(default_factory=dict)


def settings(cpu: bool) -> Settings:
    if cpu:
        return Settings(cpu=True, acc_prompts=4, acc_tokens=16, batches=(2,), out_tokens=8, kv_bytes=512 << 20,
                        engines=[("FLYDSL", "eager", 1024, True), ("FLYDSL", "eager", 131072, True)])
    engines = [(b, "eager", 1024, True) for b in ("FLYDSL", "TRITON_ATTN")]
    engines += [(b, "graphs", n, False) for n in (1024, 131072) for b in ("FLYDSL", "TRITON_ATTN")]
    engines += [(b, "compiled", 1024, True) for b in ("FLYDSL", "TRITON_ATTN")]
    # a subset, e.g. "FLYDSL:compiled:1024,TRITON_ATTN:compiled:1024" (accuracy only for eager / compiled)
    engines = engines_from_env("ENGINE_BENCH_ENGINES", engines, lambda mode, length: mode != "graphs")
    engines = in_both_orders(engines, bench_order("both"))
    return Settings(cpu=False, acc_prompts=16, acc_tokens=64, batches=(16, 64), out_tokens=128, kv_bytes=4 << 30,
                    engines=engines, capture_sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64), repeats=5,
                    extra={"gpu_memory_utilization": 0.5})


def engines_from_env(var: str, default: list, accuracy) -> list:
    """The engines named in ``$var`` ("BACKEND:MODE:LENGTH,...", a backend name may itself hold ':'), each
    with ``accuracy(mode, length)``; ``default`` when it is unset."""
    pick = os.environ.get(var, "").strip()
    if not pick:
        return default
    return [(b, m, int(n), accuracy(m, int(n))) for b, m, n in (item.rsplit(":", 2) for item in pick.split(","))]


def bench_order(default: str) -> str:
    """$ENGINE_BENCH_ORDER ("both" or "once"), ``default`` when unset."""
    return _checked_order(os.environ.get("ENGINE_BENCH_ORDER", default))


def _checked_order(order: str) -> str:
    if order not in ("both", "once"):
        raise ValueError(f"ENGINE_BENCH_ORDER={order!r}: expected 'both' or 'once'")
    return order


def in_both_orders(engines: list, order: str = "both") -> list:
    """``order`` "both": each pair of engines of one mode and length with two backends (consecutive, as the
    settings list them) runs again in the other order right after it (A, B, B, A), so neither backend always
    gets the first or the later engine of a pair on a host-bound tiny model. The repeated pair is throughput
    only (an accuracy pair is compared once); "once": as listed."""
    if _checked_order(order) == "once":
        return list(engines)
    out, i = [], 0
    while i < len(engines):
        a = engines[i]
        b = engines[i + 1] if i + 1 < len(engines) else None
        if b is not None and a[3] == b[3] and a[1:3] == b[1:3] and a[0] != b[0]:
            out += [a, b, (*b[:3], False), (*a[:3], False)]
            i += 2
        else:
            out.append(a)
            i += 1
    return out


# the largest ratio between the medians of two engines of one backend at one point for the point's ratio to
# count as settled: on the H100 hosts the batch-64 graph runs of either backend take ~0.37 s or ~0.58 s for the
# same work, by engine and sometimes within one engine's runs (twentieth session), so one engine per backend can
# put the ratio anywhere from 0.66x to 1.5x
SETTLED_SPREAD = 1.10


def speed_ratios(rows: list, ours: str) -> list:
    """Per (mode, length, batch): ``ours``'s throughput over the other backend's, from the medians of every timed
    row of each (both engines of each backend when the pairs ran in both orders). Rows without a time are left
    out; a point needs both backends. ``spread``: per backend, its slowest engine's time over its fastest;
    ``settled``: every backend ran more than one engine there and none spread past ``SETTLED_SPREAD``."""
    by: dict = {}
    for r in rows:
        if r["seconds"]:
            by.setdefault((r["mode"], r["max_model_len"], r["batch"]), {}).setdefault(r["backend"], []).append(
                float(r["seconds"]))
    out = []
    for (mode, length, batch), per in by.items():
        other = [b for b in per if b != ours]
        if ours not in per or len(other) != 1:
            continue
        mine, theirs = statistics.median(per[ours]), statistics.median(per[other[0]])
        spread = {b: max(per[b]) / min(per[b]) for b in (ours, other[0])}
        out.append({"mode": mode, "max_model_len": length, "batch": batch, "base": other[0],
                    "engines": (len(per[ours]), len(per[other[0]])), "ratio": theirs / mine, "spread": spread,
                    "settled": all(len(per[b]) > 1 and spread[b] <= SETTLED_SPREAD for b in spread)})
    return out


def runs_note(times: list, full_gcs=None, steps=None) -> str:
    """The CSV note's part on the timed runs of one point: their range and every run in order, with the full
    (oldest-generation) garbage collections during each and the engine steps each took, where the engine
    runs in this process (``full_gcs`` / ``steps``; None: not counted). The batch-64 graph runs take ~0.37 s
    or ~0.58 s, and one engine's runs can switch (twentieth session): the steps tell a run that took more
    steps (the scheduler) from one whose steps were slower. Empty for a single run."""
    if len(times) < 2:
        return ""
    note = f"; median of {len(times)} runs ({min(times):.4f}-{max(times):.4f} s); runs " + " ".join(
        f"{t:.4f}" for t in times)
    note += ("; full GCs " + " ".join(str(g) for g in full_gcs)) if full_gcs is not None else ""
    return note + ("; steps " + " ".join(str(n) for n in steps) if steps is not None else "")


@contextlib.contextmanager
def counting_steps(enabled: bool = True):
    """Counts the steps of an in-process vLLM engine while active: calls of its scheduler's ``schedule``
    (the class's, so every engine built in this process) that scheduled at least one token. Yields a
    one-element list holding the count, or None when not ``enabled`` (an engine in another process)."""
    if not enabled:
        yield None
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    count = [0]
    schedule = Scheduler.__dict__["schedule"]

    def counted(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if getattr(out, "total_num_scheduled_tokens", 0) > 0:
            count[0] += 1
        return out

    Scheduler.schedule = counted
    try:
        yield count
    finally:
        Scheduler.schedule = schedule


def log(msg: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def first_divergence_ok(tok_a, lp_a, tok_b, lp_b, top_n=TOP_N):
    """vLLM's check_logprobs_close rule for one pair of greedy sequences: walk both; at the first
    position where the tokens differ, each chosen token must be among the other run's top-``top_n``
    logprobs there, and nothing after it is compared. ``lp_x[i]``: {token: (rank, logprob)} at
    position i (rank 1 = best; None = unranked, counted as in the top). Returns (ok, first differing
    position or None)."""
    for i, (a, b) in enumerate(zip(tok_a, tok_b)):
        if a == b:
            continue
        top_a = {t for t, (rank, _) in lp_a[i].items() if rank is None or rank <= top_n}
        top_b = {t for t, (rank, _) in lp_b[i].items() if rank is None or rank <= top_n}
        return (a in top_b and b in top_a), i
    return True, None


def _tokens_and_logprobs(outs):
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[{t: (lp.rank, lp.logprob) for t, lp in pos.items()} for pos in (o.outputs[0].logprobs or [])]
             for o in outs])


def _generate(llm, prompts, n, logprobs=None):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@dataclass
class Bench:
    """One benchmark run: engines built one at a time (``build``), greedy batches (``generate``), the
    accuracy pairs and the CSV / accuracy.json / summary.md. The vLLM engine here; a subclass serves
    another framework (``sglang_engine_bench``) by overriding ``build``, ``generate`` and ``close``."""

    out: Path
    s: Settings
    model_dir: Path
    device: str
    commit: str
    rows: list = field(default_factory=list)
    accuracy: dict = field(default_factory=dict)  # label -> {tokens, logprobs, ...}
    generated: dict = field(default_factory=dict)  # (mode, max_model_len, batch) -> {backend: [tokens per engine]}
    errors: list = field(default_factory=list)
    framework = "vLLM"
    title = "tiny Llama, FLYDSL vs TRITON_ATTN"
    ours = "FLYDSL"  # the backend whose speed the ratio table gives relative to the other
    length_name = "max_model_len"  # the framework's name for the context length (tables, logs)
    accuracy_setup = "FP8 KV cache, block 16, eager"

    @property
    def engine_in_process(self) -> bool:
        """Whether the engine core runs in this process (vllm_gpu's setting), so its GCs are this process's."""
        return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def row(self, backend, mode, max_len, batch, tokens, seconds, notes=""):
        self.rows.append({"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
                          "commit": self.commit, "device": self.device, "backend": backend, "mode": mode,
                          "max_model_len": max_len, "batch": batch, "tokens": tokens,
                          "seconds": f"{seconds:.4f}" if seconds else "",
                          "tok_s": f"{tokens / seconds:.1f}" if seconds else "", "notes": notes})
        with open(self.out / "engine_bench.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            w.writeheader()
            w.writerows(self.rows)

    def build(self, backend, mode, max_len):
        from vllm import LLM

        from integration_tests.e2e import vllm_gpu

        kw = vllm_gpu.engine_kwargs(mode, capture_sizes=self.s.capture_sizes)
        return LLM(model=str(self.model_dir), skip_tokenizer_init=True, attention_backend=backend,
                   kv_cache_dtype="fp8", block_size=16, dtype="bfloat16", seed=0, max_model_len=max_len,
                   max_num_seqs=max(self.s.batches + (self.s.acc_prompts,)), enable_prefix_caching=False,
                   kv_cache_memory_bytes=self.s.kv_bytes, **self.s.extra, **kw)

    def prompts(self, n, seed):
        return tm.prompts(n, seed=seed)

    def generate(self, llm, prompts, n, logprobs=None):
        """Greedy tokens of ``prompts`` (one batch, ``n`` tokens each, ignore_eos) and, with
        ``logprobs``, per position {token: (rank, logprob)} of the top ``logprobs`` tokens."""
        return _tokens_and_logprobs(_generate(llm, prompts, n, logprobs=logprobs))

    def close(self, llm):
        """Free the engine (the next one must find its memory)."""
        del llm
        free()

    def run_accuracy(self, llm, label):
        prompts = self.prompts(self.s.acc_prompts, seed=11)
        t0 = time.perf_counter()
        toks, lps = self.generate(llm, prompts, self.s.acc_tokens, logprobs=TOP_N)
        dt = time.perf_counter() - t0
        copy = sum(tm.copy_rule_agreement(p, g) for p, g in zip(prompts, toks)) / len(prompts)
        rec = {"tokens": toks, "logprobs": lps, "copy_rule": copy, "seconds": dt}
        try:
            rec["hf_argmax_agreement"] = tm.hf_argmax_agreement(self.model_dir, prompts, toks)
        except Exception as e:  # the reference is a separate check: keep the engine's result
            rec["hf_error"] = f"{type(e).__name__}: {e}"
        self.accuracy[label] = rec
        log(f"accuracy {label}: copy rule {copy:.4f}, HF argmax agreement "
            f"{rec.get('hf_argmax_agreement', rec.get('hf_error'))} ({dt:.1f} s)")

    def run_throughput(self, llm, backend, mode, max_len):
        for batch in self.s.batches:
            prompts = self.prompts(batch, seed=100 + batch)
            tokens = batch * self.s.out_tokens
            try:
                self.generate(llm, prompts, self.s.out_tokens)  # warm-up: same shapes, JIT and autotuning done
                sync()
                inproc = self.engine_in_process  # the engine's GCs and steps are this process's
                times, full_gcs, steps = [], [], []
                for _ in range(self.s.repeats):  # the engine is host-bound: single runs vary 5-25%
                    gc0 = gc.get_stats()[-1]["collections"]
                    with counting_steps(inproc) as counted:
                        t0 = time.perf_counter()
                        toks, _ = self.generate(llm, prompts, self.s.out_tokens)
                        sync()
                        times.append(time.perf_counter() - t0)
                    full_gcs.append(gc.get_stats()[-1]["collections"] - gc0)
                    if counted is not None:
                        steps.append(counted[0])
                dt = statistics.median(times)
                n = sum(len(t) for t in toks)
                note = self.throughput_note(prompts, toks) + runs_note(times, full_gcs if inproc else None,
                                                                        steps if inproc else None)
                self.generated.setdefault((mode, max_len, batch), {}).setdefault(backend, []).append(toks)
                self.row(backend, mode, max_len, batch, n, dt, note)
                log(f"{backend} {mode} {self.length_name}={max_len} batch={batch}: {n} tokens in {dt:.3f} s = "
                    f"{n / dt:.1f} tok/s, {note}")
            except Exception as e:
                self.row(backend, mode, max_len, batch, tokens, 0, f"error: {_short(e)}")
                self.errors.append(f"{backend} {mode} {max_len} batch {batch}: {traceback.format_exc()}")
                log(f"{backend} {mode} {self.length_name}={max_len} batch={batch}: FAILED {_short(e)}")

    def throughput_note(self, prompts, toks):
        copy = sum(tm.copy_rule_agreement(p, g) for p, g in zip(prompts, toks)) / len(prompts)
        return f"copy_rule={copy:.4f}"

    def run(self, budget: float):
        start = time.monotonic()
        for backend, mode, max_len, acc in self.s.engines:
            label = f"{backend} {mode} {max_len}"
            if time.monotonic() - start > budget:
                log(f"{label}: skipped (time budget {budget:.0f} s spent)")
                for batch in self.s.batches:
                    self.row(backend, mode, max_len, batch, batch * self.s.out_tokens, 0, "skipped: time budget")
                continue
            log(f"{label}: building the engine")
            with self.engine_scope(label):
                self.run_engine(label, backend, mode, max_len, acc)
            self.report(final=False)  # what a killed run leaves behind is still readable
        self.report()

    def engine_scope(self, label):
        """Context around one engine's life (a subclass may redirect its processes' logs)."""
        return contextlib.nullcontext()

    def run_engine(self, label, backend, mode, max_len, acc):
        llm = None
        try:
            t0 = time.perf_counter()
            llm = self.build(backend, mode, max_len)
            log(f"{label}: engine ready in {time.perf_counter() - t0:.1f} s")
            if acc:
                try:
                    self.run_accuracy(llm, label)
                except Exception as e:
                    self.errors.append(f"{label} accuracy: {traceback.format_exc()}")
                    self.accuracy[label] = {"error": _short(e)}
                    log(f"{label}: accuracy FAILED {_short(e)}")
            self.run_throughput(llm, backend, mode, max_len)
        except BaseException as e:  # KeyboardInterrupt / a watchdog's exception too: record, then go on
            self.errors.append(f"{label} engine: {traceback.format_exc()}")
            log(f"{label}: engine FAILED {_short(e)}")
            for batch in self.s.batches:
                self.row(backend, mode, max_len, batch, batch * self.s.out_tokens, 0,
                         f"engine error: {_short(e)}")
            if not isinstance(e, Exception) and not getattr(e, "benchmark_watchdog", False):
                raise
        finally:
            try:
                self.close(llm)
            except Exception:
                self.errors.append(f"{label} close: {traceback.format_exc()}")

    def compare(self):
        """Accuracy pairs (the first eager engine against each other one) and graph-mode token equality."""
        pairs = []
        for name_a, name_b in self.accuracy_pairs():
            a, b = self.accuracy[name_a], self.accuracy[name_b]
            fails, identical, first, max_diff = [], 0, [], 0.0
            for i, (ta, la, tb, lb) in enumerate(zip(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"])):
                ok, pos = first_divergence_ok(ta, la, tb, lb)
                for j in range(len(ta) if pos is None else pos):
                    max_diff = max(max_diff, abs(la[j][ta[j]][1] - lb[j][tb[j]][1]))
                identical += pos is None
                if pos is not None:
                    first.append(pos)
                if not ok:
                    fails.append(i)
            pairs.append({"a": name_a, "b": name_b, "check_logprobs_close": not fails, "failing_prompts": fails,
                          "identical_sequences": identical, "sequences": len(a["tokens"]),
                          "first_divergence_positions": first, "max_abs_logprob_diff": round(max_diff, 5)})
        graphs = []
        for (mode, max_len, batch), by in sorted(self.generated.items(), key=lambda kv: str(kv[0])):
            names = sorted(by)
            if len(names) < 2:
                continue
            # every engine of one backend against every engine of the other: the fewest identical sequences
            same = [sum(p == q for p, q in zip(x, y)) for x in by[names[0]] for y in by[names[1]]]
            graphs.append({"mode": mode, "max_model_len": max_len, "batch": batch, "a": names[0], "b": names[1],
                           "identical_sequences": min(same), "sequences": len(by[names[0]][0]),
                           "engines": (len(by[names[0]]), len(by[names[1]]))})
        return pairs, graphs

    def accuracy_pairs(self):
        """(a, b) labels of the accuracy pairs: the first engine with tokens against each other one."""
        labels = [k for k in self.accuracy if "tokens" in self.accuracy[k]]
        return [(labels[0], other) for other in labels[1:]]

    def report(self, final=True):
        pairs, graphs = self.compare()
        per_engine = {k: {m: v[m] for m in ("copy_rule", "hf_argmax_agreement", "hf_error", "error", "seconds",
                                            "kda_decode_calls", "kda_decode_rows", "kda_decode_calls_at_build")
                          if m in v} for k, v in self.accuracy.items()}
        summary = {"commit": self.commit, "device": self.device, "cpu_smoke": self.s.cpu,
                   "prompts": self.s.acc_prompts, "tokens": self.s.acc_tokens, "top_n": TOP_N,
                   "engines": per_engine, "pairs": pairs, "same_tokens_across_backends": graphs,
                   "errors": self.errors}
        (self.out / "accuracy.json").write_text(json.dumps(summary, indent=1))
        kda = any("kda_decode_calls" in v for v in per_engine.values())
        md = [f"# {self.framework} engine end to end, {self.title} ({self.device}, commit {self.commit or '?'})", "",
              f"Accuracy: {self.s.acc_prompts} prompts x {self.s.acc_tokens} greedy tokens, logprobs={TOP_N}, "
              f"{self.accuracy_setup}.", "",
              "| engine | copy rule | HF argmax agreement |" + (" kda_decode calls (rows); at build |" if kda else ""),
              "|---|---|---|" + ("---|" if kda else "")]
        for k, v in per_engine.items():
            md.append(f"| {k} | {v.get('copy_rule', v.get('error', '-'))} | "
                      f"{v.get('hf_argmax_agreement', v.get('hf_error', '-'))} |"
                      + (f" {v.get('kda_decode_calls', '-')} ({v.get('kda_decode_rows', '-')}); "
                         f"{v.get('kda_decode_calls_at_build', '-')} |" if kda else ""))
        md += ["", "| a | b | check_logprobs_close | identical sequences | max abs logprob diff |",
               "|---|---|---|---|---|"]
        for p in pairs:
            md.append(f"| {p['a']} | {p['b']} | {'pass' if p['check_logprobs_close'] else 'FAIL'} | "
                      f"{p['identical_sequences']}/{p['sequences']} | {p['max_abs_logprob_diff']} |")
        if graphs:
            md += ["", "Same greedy tokens across backends in the throughput runs (each engine of one backend against "
                   "each of the other; the fewest identical sequences of those comparisons):", "",
                   f"| mode | {self.length_name} | batch | identical sequences | engines |", "|---|---|---|---|---|"]
            md += [f"| {g['mode']} | {g['max_model_len']} | {g['batch']} | "
                   f"{g['identical_sequences']}/{g['sequences']} | {g['engines'][0]} / {g['engines'][1]} |"
                   for g in graphs]
        ratios = speed_ratios(self.rows, self.ours)
        if ratios:
            md += ["", f"Throughput of {self.ours} over the other backend (medians of every timed run of each). "
                   f"Engines: per backend. Spread: per backend, its slowest engine's median over its fastest's; a "
                   f"point is settled where each backend ran more than one engine, none spread past "
                   f"{SETTLED_SPREAD:.2f}x (a switch within one engine's runs shows in its row's runs):", "",
                   f"| mode | {self.length_name} | batch | ratio | engines | spread | settled |",
                   "|---|---|---|---|---|---|---|"]
            md += [f"| {q['mode']} | {q['max_model_len']} | {q['batch']} | {q['ratio']:.3f}x (vs {q['base']}) | "
                   f"{q['engines'][0]} / {q['engines'][1]} | "
                   f"{q['spread'][self.ours]:.3f}x / {q['spread'][q['base']]:.3f}x | "
                   f"{'yes' if q['settled'] else 'no'} |" for q in ratios]
        md += ["", f"| backend | mode | {self.length_name} | batch | tokens | seconds | tok/s | notes |",
               "|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['backend']} | {r['mode']} | {r['max_model_len']} | {r['batch']} | {r['tokens']} | "
               f"{r['seconds']} | {r['tok_s']} | {r['notes']} |" for r in self.rows]
        if self.errors:
            md += ["", f"{len(self.errors)} error(s): see accuracy.json"]
        (self.out / "summary.md").write_text("\n".join(md) + "\n")
        if not final:
            return
        for p in pairs:
            log(f"check_logprobs_close {p['a']} vs {p['b']}: {'pass' if p['check_logprobs_close'] else 'FAIL'}, "
                f"{p['identical_sequences']}/{p['sequences']} identical")
        for g in graphs:
            log(f"same tokens {g['a']} vs {g['b']} {g['mode']} {g['max_model_len']} batch {g['batch']}: "
                f"{g['identical_sequences']}/{g['sequences']}")
        log(f"wrote {self.out}/engine_bench.csv, accuracy.json, summary.md ({len(self.errors)} error(s))")


class KimiBench(Bench):
    """The tiny Kimi-Linear with the KDA decode hook off ("KDA:vllm") and on ("KDA:flydsl"): see the module
    docstring (``--model kimi``)."""

    title = "tiny Kimi-Linear, KDA decode hook on vs off"
    ours = "KDA:flydsl"
    accuracy_setup = "bf16, MLA on TRITON_MLA, staggered arrivals (mixed prefill+decode batches)"
    calls: list = None  # rows of each kda_decode call of the engine running now
    build_calls = 0  # of which made while the engine was built (graph capture)

    def prompts(self, n, seed):
        from integration_tests.e2e import tiny_kimi

        return tiny_kimi.prompts(n, seed=seed)

    def throughput_note(self, prompts, toks):
        return f"kda_decode calls since build={len(self.calls) - self.build_calls}"

    def build(self, backend, mode, max_len):
        from vllm import LLM

        from integration_tests.e2e import vllm_kimi

        if self.calls is None:  # the first engine: start counting
            self.count_calls()
        self.calls = []
        kw = vllm_kimi.engine_kwargs_gpu(mode, capture_sizes=self.s.capture_sizes)
        llm = LLM(model=str(self.model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  max_model_len=max_len, max_num_seqs=max(self.s.batches + (self.s.acc_prompts,)),
                  max_num_batched_tokens=max_len, kv_cache_memory_bytes=self.s.kv_bytes,
                  additional_config={"flydsl_kda": backend == "KDA:flydsl"}, **self.s.extra, **kw)
        # graph mode: the decode graphs are captured here, with our op inside them when the hook is on;
        # their replays run it without calling Python (no counted calls during the runs)
        self.build_calls = len(self.calls)
        return llm

    def run_accuracy(self, llm, label):
        from vllm import SamplingParams

        prompts = self.prompts(self.s.acc_prompts, seed=11)
        engine = llm.llm_engine
        t0 = time.perf_counter()
        n0 = len(self.calls)
        done, steps, next_i = {}, 0, 0
        while next_i < len(prompts) or engine.has_unfinished_requests():
            if next_i < len(prompts) and (next_i == 0 or steps >= 6):  # 8 now, 8 after 6 steps
                for i in range(next_i, min(next_i + len(prompts) // 2, len(prompts))):
                    engine.add_request(str(i), {"prompt_token_ids": prompts[i]},
                                       SamplingParams(max_tokens=self.s.acc_tokens + 2 * i, temperature=0.0,
                                                      ignore_eos=True, logprobs=TOP_N))
                next_i = min(next_i + len(prompts) // 2, len(prompts))
            for o in engine.step():
                if o.finished:
                    done[int(o.request_id)] = o
            steps += 1
        outs = [done[i] for i in range(len(prompts))]
        toks, lps = _tokens_and_logprobs(outs)
        calls = self.calls[n0:]
        rec = {"tokens": toks, "logprobs": lps, "seconds": time.perf_counter() - t0, "kda_decode_calls": len(calls),
               "kda_decode_rows": sorted(set(calls)), "kda_decode_calls_at_build": self.build_calls}
        self.accuracy[label] = rec
        log(f"accuracy {label}: {sum(map(len, toks))} tokens in {steps} steps, kda_decode calls {len(calls)} "
            f"(rows {rec['kda_decode_rows']})")

    def accuracy_pairs(self):
        """Hook on against hook off, per mode."""
        pairs = []
        for backend, mode, max_len, acc in self.s.engines:
            off, on = f"KDA:vllm {mode} {max_len}", f"KDA:flydsl {mode} {max_len}"
            if acc and backend == "KDA:flydsl" and all("tokens" in self.accuracy.get(k, {}) for k in (off, on)):
                pairs.append((off, on))
        return pairs

    def count_calls(self):
        """Count this project's kda_decode calls (``kda_backend.vllm`` looks ``api.kda_decode`` up per call)."""
        import kda_backend.api as api

        original = api.kda_decode

        def counted(*args, **kwargs):
            if self.calls is not None:
                self.calls.append(int(kwargs["x"].shape[0]) if "x" in kwargs else -1)
            return original(*args, **kwargs)

        api.kda_decode = counted


def kimi_settings(cpu: bool = False) -> Settings:
    engines = [(b, m, 2048, True) for m in ("eager", "graphs") for b in ("KDA:vllm", "KDA:flydsl")]
    engines = engines_from_env("ENGINE_BENCH_ENGINES", engines, lambda mode, length: True)
    # each pair again, throughput only, in the other order (ENGINE_BENCH_ORDER=both, the default; the
    # nineteenth session's single graph pair read 0.89x at batch 16 with spreads of 0.33-0.46 s)
    engines = in_both_orders(engines, bench_order("both"))
    return Settings(cpu=False, acc_prompts=16, acc_tokens=64, batches=(16, 64), out_tokens=128, kv_bytes=2 << 30,
                    engines=engines, capture_sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64), repeats=5,
                    extra={"gpu_memory_utilization": 0.5})


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free():
    import torch

    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:
        log(f"cleanup_dist_env_and_memory: {_short(e)}")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_main(bench_cls, settings_fn, prepare, argv=None, description="", build_model=None, options=None) -> int:
    """The command line shared by the engine benchmarks: ``prepare(cpu)`` readies the framework in
    this process (before its engine is imported), ``settings_fn(cpu)`` picks the engines,
    ``build_model(dir)`` writes the model (default: ``tiny_model.build``). ``options``: extra
    arguments (name -> argparse keywords) read by the caller before (``parse_known_args``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True, help="directory for engine_bench.csv, accuracy.json, summary.md")
    ap.add_argument("--cpu", action="store_true", help="CPU smoke run (the framework's CPU path, flydsl only, "
                                                     "tiny sizes)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("ENGINE_BENCH_BUDGET", 480)),
                    help="seconds after which no new engine is started (default 480)")
    for name, kw in (options or {}).items():
        ap.add_argument(name, **kw)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        log("no CUDA device: use --cpu for the CPU smoke run")
        return 2
    try:
        prepare(args.cpu)
    except ModuleNotFoundError as exc:  # the framework itself (or a dependency of it) is not installed
        log(f"{exc.name} is not installed in this environment: the engine bench drives the framework's real "
            "engine (docs/serving.md, \"End to end\")")
        return 2
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    s = settings_fn(args.cpu)
    with tempfile.TemporaryDirectory(prefix="tiny_model_") as d:
        model_dir = (build_model or tm.build)(d)
        log(f"model built in {model_dir}; device {device}; engines {len(s.engines)}")
        bench = bench_cls(out=out, s=s, model_dir=model_dir, device=device,
                          commit=os.environ.get("FLYDSL_BACKENDS_COMMIT", ""))
        bench.run(args.budget)
    pairs, _ = bench.compare()
    ok = not bench.errors and all(p["check_logprobs_close"] for p in pairs) and bool(pairs)
    return 0 if ok else 1


def _prepare_vllm(cpu: bool) -> None:
    if cpu:
        from integration_tests.e2e import vllm_cpu

        vllm_cpu.prepare()
    else:
        from integration_tests.e2e import vllm_gpu

        vllm_gpu.prepare()


def _prepare_kimi(cpu: bool) -> None:
    if cpu:
        raise SystemExit("--model kimi runs on the GPU (the CPU engine case is "
                         "integration_tests/e2e/test_vllm_kimi_engine.py)")
    from integration_tests.e2e import vllm_kimi

    vllm_kimi.prepare_gpu()


def _build_kimi(d):
    from integration_tests.e2e import tiny_kimi

    return tiny_kimi.build(d)


def main(argv=None) -> int:
    model = {"--model": dict(choices=("llama", "kimi"), default="llama",
                             help="llama: FLYDSL vs TRITON_ATTN (default); kimi: the KDA decode hook on vs off (GPU)")}
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", choices=("llama", "kimi"), default="llama")
    known, _ = pre.parse_known_args(argv)
    doc = __doc__.split("\n\n")[0]
    if known.model == "kimi":
        return run_main(KimiBench, kimi_settings, _prepare_kimi, argv, description=doc, build_model=_build_kimi,
                        options=model)
    return run_main(Bench, settings, _prepare_vllm, argv, description=doc, options=model)


if __name__ == "__main__":
    sys.exit(main())
