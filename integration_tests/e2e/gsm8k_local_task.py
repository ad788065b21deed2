"""An offline stand-in for lm-eval's ``gsm8k`` task, for checking the GSM8K command's plumbing on a
machine that cannot reach the Hugging Face hub (where lm-eval downloads ``openai/gsm8k``).

    python integration_tests/e2e/gsm8k_local_task.py DIR [--test 8]
    lm_eval --include_path DIR --tasks gsm8k_local ...

Run it with the Python that has lm-eval installed. It writes ``DIR/gsm8k_local.yaml`` (the
installed ``gsm8k.yaml`` included by absolute path — prompt, 5-shot, stop strings, filters and
metric unchanged — with the dataset replaced by local JSON lines) and ``DIR/train.jsonl`` /
``DIR/test.jsonl``: generated one-step addition questions in GSM8K's format (``question``;
``answer`` ending in ``#### N``). Scores on them are not GSM8K scores; the real task needs the hub
(or a local copy of the dataset: point ``data_files`` at it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

NAMES = ["Ann", "Bo", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["apples", "pens", "books", "stamps", "coins", "cards"]


def installed_gsm8k_yaml() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("lm_eval is not installed in this Python (run this with lm-eval's interpreter)")
    path = Path(list(spec.submodule_search_locations)[0]) / "tasks" / "gsm8k" / "gsm8k.yaml"
    if not path.is_file():
        raise SystemExit(f"{path} not found: this lm-eval version keeps gsm8k elsewhere")
    return path


def question(rng: random.Random) -> dict:
    who, what = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    return {"question": f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?",
            "answer": f"{who} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {what}.\n#### {a + b}"}


def write(out: Path, n_test: int, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", 8), ("test", n_test)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps(question(rng)) + "\n")
    yaml_text = "\n".join([
        f"include: {installed_gsm8k_yaml()}",
        "task: gsm8k_local",
        "tag: []",
        "dataset_path: json",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        f"    train: {out.resolve() / 'train.jsonl'}",
        f"    test: {out.resolve() / 'test.jsonl'}",
        "",
    ])
    path = out / "gsm8k_local.yaml"
    path.write_text(yaml_text)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--test", type=int, default=8, help="number of test questions")
    args = ap.parse_args(argv)
    print(write(args.dir, args.test))
    return 0


if __name__ == "__main__":
    sys.exit(main())
