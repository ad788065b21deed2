"""Serving accuracy of a real model: a framework's engine with the flydsl backend against a reference.

``flydsl-backends serving-accuracy --framework vllm --model DIR`` serves ``DIR`` (a Hugging Face
checkpoint with its tokenizer) twice and prints one table:

* **flydsl**: the framework's engine (``vllm.LLM`` / ``sglang.Engine``) with this project's attention
  backend and an FP8 KV cache;
* **the reference**: on a GPU the framework's own Triton backend (vLLM ``TRITON_ATTN``, SGLang
  ``triton``) with the same KV format; with ``--reference hf`` (the default without a GPU) HF
  transformers whose K and V go through the same FP8 rounding and scale as the engine's cache
  (``fp8-ref``), plus plain HF at the model dtype (``hf-bf16``: what the FP8 cache costs).

Workload: 16 prompts (8 through the tokenizer's chat template, 8 raw text), greedy, 32 new tokens
with the top-5 logprobs; and the perplexity of a licence text (~700 tokens, longer than Gemma 3's
sliding window) through the engine's prompt logprobs. Checks, each candidate against the reference:

* vLLM's ``check_logprobs_close`` rule: at the first position where the two greedy sequences differ,
  each run's token is in the other's top-5 there (nothing after it is compared): every prompt passes;
* teacher-forced top-1 agreement: the reference scores prompt + the candidate's tokens, and its argmax
  is the candidate's token at >= 94% of the generated positions;
* perplexity within 2.5% of the reference's.

Exit status 1 when a flydsl row fails a check, 2 on a usage error. A 135M model dequantized from 4
bits flips greedy tokens between bf16 and fp32 on its own, so exact-match greedy is no criterion.

The framework and transformers are imported when a runner is built, so this module imports anywhere.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable, Optional, Sequence

TOP_K = 5
MAX_TOKENS = 32
PPL_TOKENS = 700
MIN_TOP1 = 0.94
MAX_PPL_DELTA = 0.025
FP8_MAX = 448.0  # e4m3fn: the largest finite value; the cache writers saturate there

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paper clip.",
    "How do I reverse a list in Python?",
    "What is 17 multiplied by 23?",
    "Give me a short tip for sleeping better.",
    "Translate 'good morning' into Spanish and German.",
)
RAW_PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest,",
    "The three primary colors are",
    "In mathematics, a prime number is",
    "Water boils at 100 degrees Celsius at sea level because",
    "The recipe calls for two cups of flour, one egg and",
    "Photosynthesis is the process by which plants",
)


@dataclass
class Generation:
    """One greedy sequence: the new token ids and, per position, the top logprobs {token: logprob}
    (the chosen token included)."""

    ids: list
    top: list


@dataclass
class Scores:
    """Teacher-forced scores of one sequence: for positions 1..n-1 the logprob of the given token and
    the runner's own top-1 token there."""

    logprobs: list
    argmax: list


@dataclass
class Row:
    name: str
    reference: str
    prompts_passed: int
    prompts: int
    failures: list
    top1: float
    positions: int
    ppl: float
    ppl_ref: float
    identical: int
    counted: dict = field(default_factory=dict)
    checked: bool = True  # a flydsl row: its checks set the exit status

    @property
    def ppl_delta(self) -> float:
        return self.ppl / self.ppl_ref - 1.0

    @property
    def ok(self) -> bool:
        return (self.prompts_passed == self.prompts and self.top1 >= MIN_TOP1
                and abs(self.ppl_delta) <= MAX_PPL_DELTA)


# --------------------------------------------------------------------------------------------- inputs


def tokenized_prompts(tokenizer, chat: Sequence[str] = CHAT_PROMPTS, raw: Sequence[str] = RAW_PROMPTS) -> list:
    """Token ids: ``chat`` through the tokenizer's chat template (with the generation prompt), ``raw`` as
    text (the tokenizer's own special tokens, e.g. Gemma's ``<bos>``). A tokenizer without a chat
    template gets every prompt as raw text."""
    out = []
    for text in chat:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
                ids = ids["input_ids"]
            out.append([int(t) for t in ids])
        else:
            out.append(list(tokenizer(text).input_ids))
    out += [list(tokenizer(text).input_ids) for text in raw]
    return out


def perplexity_text() -> str:
    """The text whose perplexity is measured: the Apache License 2.0 (shipped with this package)."""
    return resources.files("flydsl_backends").joinpath("data/apache-2.0.txt").read_text()


def perplexity_ids(tokenizer, tokens: int = PPL_TOKENS) -> list:
    ids = list(tokenizer(perplexity_text()).input_ids)
    if len(ids) < tokens:
        raise ValueError(f"the perplexity text has {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


# ------------------------------------------------------------------------------------------- checks


def first_divergence(a: Generation, b: Generation, top_k: int = TOP_K):
    """vLLM's ``check_logprobs_close`` rule for one prompt: (ok, first differing position or None, message)."""
    for i, (ta, tb) in enumerate(zip(a.ids, b.ids)):
        if ta == tb:
            continue
        top_a = sorted(a.top[i], key=a.top[i].get, reverse=True)[:top_k]
        top_b = sorted(b.top[i], key=b.top[i].get, reverse=True)[:top_k]
        ok = ta in top_b and tb in top_a
        return ok, i, f"position {i}: {ta} vs {tb} (top-{top_k} {top_a} / {top_b})"
    return True, None, ""


def compare(name: str, gens: list, ppl: float, ref_name: str, ref_gens: list, ref_ppl: float,
            forced: list, prompts: list, checked: bool = True) -> Row:
    """A row of the table: ``gens`` against ``ref_gens`` (the logprobs rule), ``forced`` (the reference's
    scores of prompt + ``gens``: top-1 agreement over the generated positions) and the perplexities."""
    passed, failures, identical = 0, [], 0
    for i, (a, b) in enumerate(zip(gens, ref_gens)):
        ok, at, msg = first_divergence(a, b)
        passed += ok
        identical += at is None
        if not ok:
            failures.append(f"prompt {i} {msg}")
    agree = total = 0
    for p, g, s in zip(prompts, gens, forced):
        # the score at position j predicts token j + 1: the generated tokens start at len(p)
        for j, t in enumerate(g.ids):
            total += 1
            agree += s.argmax[len(p) - 1 + j] == t
    return Row(name, ref_name, passed, len(gens), failures, agree / max(total, 1), total, ppl, ref_ppl, identical,
               checked=checked)


def format_table(rows: list, model: str, framework: str) -> str:
    lines = [f"serving accuracy: {model} on {framework} "
             f"(greedy {MAX_TOKENS} tokens, top-{TOP_K}; thresholds: every prompt passes the logprobs rule, "
             f"top-1 >= {MIN_TOP1:.0%}, |perplexity delta| <= {MAX_PPL_DELTA:.1%})", "",
             "| run | against | check_logprobs_close | identical | teacher-forced top-1 | perplexity | "
             "reference perplexity | delta | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = ("pass" if r.ok else "FAIL") if r.checked else ("within" if r.ok else "outside") + " (info)"
        lines.append(f"| {r.name} | {r.reference} | {r.prompts_passed}/{r.prompts} | {r.identical}/{r.prompts} | "
                     f"{r.top1:.2%} ({r.positions}) | {r.ppl:.4f} | {r.ppl_ref:.4f} | {r.ppl_delta:+.2%} | {verdict} |")
    for r in rows:
        for f in r.failures:
            lines.append(f"  {r.name}: {f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ runners


def fp8_round(x, scale: float = 1.0):
    """``x`` through the FP8 (e4m3fn) cache format at ``scale``, saturating at +-448, back in float32."""
    import torch

    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale)


_REGISTERED: dict = {}


def register_fp8_attention(scale: float = 1.0) -> str:
    """Register with transformers an attention function that reads K and V through the FP8 cache format
    at ``scale`` and attends in float32, and the matching mask (transformers hands a custom attention
    function no mask unless one is registered under the same name: it would attend non-causally).
    Returns the name to pass as ``attn_implementation``."""
    name = f"flydsl_fp8_kv_{scale:g}"
    if name in _REGISTERED:
        return name
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        k = fp8_round(key, scale).repeat_interleave(groups, dim=1)
        v = fp8_round(value, scale).repeat_interleave(groups, dim=1)
        scaling = module.head_dim ** -0.5 if scaling is None else scaling
        w = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
        if softcap is not None:
            w = torch.tanh(w / softcap) * softcap
        if attention_mask is not None:
            w = w + attention_mask[:, :, :, : k.shape[-2]].float()
        p = torch.softmax(w, dim=-1)
        o = torch.matmul(p, v).to(query.dtype)
        return o.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    _REGISTERED[name] = attention
    return name


class HFRunner:
    """HF transformers on the checkpoint, greedy with a KV cache; ``kv="fp8"`` rounds K and V through
    the cache format (``register_fp8_attention``), ``kv="model"`` attends eagerly at the model dtype."""

    def __init__(self, model_dir: str, kv: str = "fp8", kv_scale: float = 1.0, dtype: str = "bfloat16",
                 device: Optional[str] = None):
        import torch
        from transformers import AutoModelForCausalLM

        impl = register_fp8_attention(kv_scale) if kv == "fp8" else "eager"
        self.name = "fp8-ref" if kv == "fp8" else f"hf-{dtype.replace('bfloat16', 'bf16')}"
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                          attn_implementation=impl).to(self.device).eval()

    def generate(self, prompts: list, max_tokens: int = MAX_TOKENS, top_k: int = TOP_K) -> list:
        """Greedy, all prompts in one left-padded batch (the LM head is read once per step for all of
        them: a 262k-token vocabulary makes that most of a step's cost on a CPU)."""
        import torch

        n, width = len(prompts), max(len(p) for p in prompts)
        x = torch.zeros(n, width, dtype=torch.long, device=self.device)
        mask = torch.zeros(n, width, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            x[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, top = [[] for _ in prompts], [[] for _ in prompts]
        cache = None
        with torch.inference_mode():
            for _ in range(max_tokens):
                r = self.model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                               use_cache=True, logits_to_keep=1)
                cache = r.past_key_values
                vals, idx = torch.log_softmax(r.logits[:, -1].float(), dim=-1).topk(top_k)
                for i in range(n):
                    ids[i].append(int(idx[i, 0]))
                    top[i].append({int(t): float(v) for t, v in zip(idx[i], vals[i])})
                x = idx[:, :1]
                mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                pos = pos[:, -1:] + 1
        return [Generation(a, b) for a, b in zip(ids, top)]

    def score(self, seqs: list) -> list:
        import torch

        out = []
        with torch.inference_mode():
            for s in seqs:
                logits = self.model(input_ids=torch.tensor([s], device=self.device)).logits[0].float()
                lp = torch.log_softmax(logits[:-1], dim=-1)
                nxt = torch.tensor(s[1:], device=self.device)
                out.append(Scores(lp.gather(1, nxt[:, None])[:, 0].tolist(), lp.argmax(-1).tolist()))
        return out

    def close(self) -> None:
        del self.model
        gc.collect()


class VLLMRunner:
    """``vllm.LLM`` on the checkpoint with ``attention_backend`` and an FP8 KV cache."""

    def __init__(self, model_dir: str, attention_backend: str, kv_cache_dtype: str = "fp8", **engine_kwargs):
        import torch
        from vllm import LLM

        self.name = f"vllm {attention_backend}"
        self._threads = torch.get_num_threads()  # vLLM's CPU worker lowers it for the whole process
        kw = dict(dtype="bfloat16", seed=0, block_size=16, max_model_len=2048, max_num_seqs=16,
                  enable_prefix_caching=False)
        kw.update(engine_kwargs)
        self.llm = LLM(model=model_dir, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype, **kw)

    def generate(self, prompts: list, max_tokens: int = MAX_TOKENS, top_k: int = TOP_K) -> list:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=top_k)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [Generation(list(o.outputs[0].token_ids),
                           [{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in outs]

    def score(self, seqs: list) -> list:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
        res = []
        for s, o in zip(seqs, outs):
            pl = o.prompt_logprobs[1:]  # position 0 has none
            res.append(Scores([float(pos[t].logprob) for t, pos in zip(s[1:], pl)],
                              [next(int(k) for k, v in pos.items() if v.rank == 1) for pos in pl]))
        return res

    def close(self) -> None:
        import torch

        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch.set_num_threads(self._threads)


class SGLangRunner:
    """``sglang.Engine`` on the checkpoint with ``attention_backend`` and an FP8 KV cache (its scheduler in
    its own process: a script that builds it needs the ``if __name__ == "__main__"`` guard)."""

    def __init__(self, model_dir: str, attention_backend: str, kv_cache_dtype: str = "fp8_e4m3", **engine_kwargs):
        import sglang

        self.name = f"sglang {attention_backend}"
        kw = dict(dtype="bfloat16", random_seed=0, page_size=16, context_length=2048, max_running_requests=16,
                  skip_tokenizer_init=True, disable_radix_cache=True, log_level="warning")
        kw.update(engine_kwargs)
        self.engine = sglang.Engine(model_path=model_dir, attention_backend=attention_backend,
                                    kv_cache_dtype=kv_cache_dtype, **kw)

    def generate(self, prompts: list, max_tokens: int = MAX_TOKENS, top_k: int = TOP_K) -> list:
        outs = self.engine.generate(input_ids=[list(p) for p in prompts], return_logprob=True, top_logprobs_num=top_k,
                                    sampling_params={"max_new_tokens": max_tokens, "temperature": 0.0,
                                                     "ignore_eos": True})
        res = []
        for o in outs:
            m = o["meta_info"]
            top = [{int(t): float(lp) for lp, t, *_ in pos} for pos in m["output_top_logprobs"]]
            for d, (lp, t, *_) in zip(top, m["output_token_logprobs"]):
                d.setdefault(int(t), float(lp))
            res.append(Generation([int(t) for t in o["output_ids"]], top))
        return res

    def score(self, seqs: list) -> list:
        outs = self.engine.generate(input_ids=[list(s) for s in seqs], return_logprob=True, logprob_start_len=0,
                                    top_logprobs_num=1, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        res = []
        for o in outs:
            m = o["meta_info"]
            res.append(Scores([float(lp) for lp, *_ in m["input_token_logprobs"][1:]],
                              [int(pos[0][1]) for pos in m["input_top_logprobs"][1:]]))
        return res

    def close(self) -> None:
        self.engine.shutdown()
        gc.collect()


# ---------------------------------------------------------------------------------------------- run


@dataclass
class Result:
    rows: list
    prompts: list
    runs: dict  # runner name -> {"gens": [...], "ppl": float}
    seconds: dict

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows if r.checked)


def _log(msg: str) -> None:
    print(f"[serving-accuracy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(candidate: Callable, reference: Callable, prompts: list, ppl_ids: list, extra: Sequence[Callable] = (),
        max_tokens: int = MAX_TOKENS) -> Result:
    """Build and run each runner in turn (one alive at a time: engines hold the device's memory).

    ``candidate`` / ``reference`` / ``extra``: zero-argument factories of runners (``generate`` /
    ``score`` / ``close``). The reference also scores every other runner's tokens (teacher-forced), so
    it runs last."""
    runs, seconds = {}, {}
    for make in (candidate, *extra):
        t = time.perf_counter()
        r = make()
        _log(f"{r.name}: generating {len(prompts)} x {max_tokens} tokens, scoring {len(ppl_ids)} text tokens")
        try:
            runs[r.name] = {"gens": r.generate(prompts, max_tokens), "ppl": perplexity(r.score([ppl_ids])[0].logprobs)}
        finally:
            r.close()
        seconds[r.name] = time.perf_counter() - t
    t = time.perf_counter()
    ref = reference()
    _log(f"{ref.name} (reference): generating, scoring, and teacher-forcing the other runs' tokens")
    try:
        ref_gens = ref.generate(prompts, max_tokens)
        ref_ppl = perplexity(ref.score([ppl_ids])[0].logprobs)
        rows = []
        for i, (name, rr) in enumerate(runs.items()):
            forced = ref.score([p + g.ids for p, g in zip(prompts, rr["gens"])])
            rows.append(compare(name, rr["gens"], rr["ppl"], ref.name, ref_gens, ref_ppl, forced, prompts,
                                checked=i == 0))
    finally:
        ref.close()
    seconds[ref.name] = time.perf_counter() - t
    runs[ref.name] = {"gens": ref_gens, "ppl": ref_ppl}
    return Result(rows, prompts, runs, seconds)


def _parse_engine_args(items: Sequence[str]) -> dict:
    out = {}
    for item in items or ():
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg: expected KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(val)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = val
    return out


def add_args(p) -> None:
    p.add_argument("--framework", required=True, choices=("vllm", "sglang"))
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory (or hub id) with its tokenizer")
    p.add_argument("--reference", default="auto", choices=("auto", "framework", "hf"),
                   help="framework: the framework's Triton backend (TRITON_ATTN / triton) on the same KV format; "
                        "hf: HF transformers with K/V rounded through FP8 (and plain HF at the model dtype); "
                        "auto: framework on a GPU, hf without one")
    p.add_argument("--kv-scale", type=float, default=1.0,
                   help="the FP8 cache's K/V scale, for the hf reference (default 1.0: the engines' default)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="greedy tokens per prompt")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine argument for both engines (repeatable; VALUE parsed as JSON when it parses), "
                        "e.g. max_model_len=4096, tensor_parallel_size=2")
    p.add_argument("--json", default=None, help="also write the rows and sequences to this JSON file")


def main(args, engine_kwargs: Optional[dict] = None) -> int:
    """The CLI subcommand (``flydsl-backends serving-accuracy``). ``engine_kwargs``: engine arguments
    that are Python objects (a caller's own driver), under those of ``--engine-arg``."""
    try:
        engine_kwargs = {**(engine_kwargs or {}), **_parse_engine_args(args.engine_arg)}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_tokens < 1:
        print("error: --max-tokens: expected >= 1", file=sys.stderr)
        return 2
    if not args.kv_scale > 0 or math.isinf(args.kv_scale):
        print("error: --kv-scale: expected a finite number > 0", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec(args.framework) is None:
        print(f"error: --framework {args.framework}: {args.framework} is not installed here", file=sys.stderr)
        return 2
    from backend_core import platform

    reference = args.reference
    if reference == "auto":
        reference = "framework" if platform.has_gpu() else "hf"
    if reference == "framework" and not platform.has_gpu():
        print("error: --reference framework needs a GPU (the frameworks' Triton backends do not run on CPU); "
              "use --reference hf", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = tokenized_prompts(tok)
    ppl_ids = perplexity_ids(tok)
    if args.framework == "vllm":
        def engine(backend):
            return lambda: VLLMRunner(args.model, backend, **engine_kwargs)
        flydsl, native = engine("FLYDSL"), engine("TRITON_ATTN")
    else:
        def engine(backend):
            return lambda: SGLangRunner(args.model, backend, **engine_kwargs)
        flydsl, native = engine("flydsl"), engine("triton")
    if reference == "framework":
        result = run(flydsl, native, prompts, ppl_ids, max_tokens=args.max_tokens)
    else:
        result = run(flydsl, lambda: HFRunner(args.model, "fp8", args.kv_scale), prompts, ppl_ids,
                     extra=(lambda: HFRunner(args.model, "model"),), max_tokens=args.max_tokens)
    print(format_table(result.rows, args.model, args.framework))
    if args.json:
        with open(args.json, "w") as f:
            runs = {k: {"ppl": v["ppl"], "ids": [g.ids for g in v["gens"]]} for k, v in result.runs.items()}
            json.dump({"rows": [r.__dict__ for r in result.rows], "seconds": result.seconds, "runs": runs}, f, indent=1)
    return 0 if result.ok else 1
