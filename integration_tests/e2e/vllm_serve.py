"""``vllm serve`` without vLLM's compiled extensions (issue 16), on CPU or on an NVIDIA GPU.

    VLLM_TARGET_DEVICE=cpu python -m integration_tests.e2e.vllm_serve MODEL_DIR \\
        --attention-backend FLYDSL --kv-cache-dtype fp8 --block-size 16 --port 8000 ...
    FLYDSL_E2E_CUDA=1 python -m integration_tests.e2e.vllm_serve MODEL_DIR ... $(vllm_gpu.serve_args)

Everything after the module name is ``vllm serve``'s own command line; the server runs in this
process through vLLM's CLI entry point (``vllm.entrypoints.cli.main``), as the ``vllm`` script
would run it. ``FLYDSL_E2E_CUDA=1``: the GPU stand-ins of ``vllm_gpu`` (the CUDA extensions vLLM
cannot load on the device image) instead of ``vllm_cpu``'s CPU ones; the engine arguments that keep
every op on its native path come from ``vllm_gpu.serve_args``.

vLLM's OpenAI server always runs the engine core in a separate process, and the CPU platform
starts it with ``spawn``. A spawned child imports the parent's main module under the name
``__mp_main__`` before it unpickles its arguments, so this module's top level is where the child
gets what ``prepare()`` supplies (the extension stand-ins, the platform honouring the named
backend); a forked child inherits them. The plugins are left to vLLM, as in a real ``vllm serve``:
its CLI loads them in the API server, and the engine core loads them after it has unpickled its
config. So a spawned engine core fails on ``--attention-backend FLYDSL`` (a member the plugin adds)
exactly as a user's would, and takes ``CUSTOM``. Nothing happens on a plain ``import`` of this
module.

The ``flydsl_backends`` loggers print to stderr at INFO in both processes, so the server log shows
the plugin registering and which implementation the paged-attention calls chose.
"""

from __future__ import annotations

import sys


def _prepare_process() -> None:
    import logging

    log = logging.getLogger("flydsl_backends")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("(%(processName)s) %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    import os

    if os.environ.get("FLYDSL_E2E_CUDA") == "1":
        from integration_tests.e2e import vllm_gpu

        vllm_gpu.prepare()
    else:
        from integration_tests.e2e import vllm_cpu

        vllm_cpu.prepare()


def main(argv=None) -> None:
    _prepare_process()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__mp_main__":  # the spawned engine-core process
    _prepare_process()

if __name__ == "__main__":
    main()
