"""``vllm serve`` without vLLM's compiled extensions (issue 16), on CPU or on an NVIDIA GPU.

    VLLM_TARGET_DEVICE=cpu python -m integration_tests.e2e.vllm_serve MODEL_DIR \\
        --attention-backend FLYDSL --kv-cache-dtype fp8 --block-size 16 --port 8000 ...
    FLYDSL_E2E_CUDA=1 python -m integration_tests.e2e.vllm_serve MODEL_DIR ... $(vllm_gpu.serve_args)

Everything after the module name is ``vllm serve``'s own command line; the server runs in this
process through vLLM's CLI entry point (``vllm.entrypoints.cli.main``), as the ``vllm`` script
would run it. ``FLYDSL_E2E_CUDA=1``: the GPU stand-ins of ``vllm_gpu`` (the CUDA extensions vLLM
cannot load on the device image) instead of ``vllm_cpu``'s CPU ones; the engine arguments that keep
every op on its native path come from ``vllm_gpu.serve_args``.

vLLM's OpenAI server always runs the engine core in a separate process, and its CLI starts it with
``spawn`` (``cli_env_setup``; the CPU platform insists on it too). A spawned child imports the
parent's main module under the name ``__mp_main__`` before it unpickles its arguments, so this
module's top level is where the child gets what ``prepare()`` supplies (the extension stand-ins, the
platform honouring the named backend). The plugins are left to vLLM, as in a real ``vllm serve``: its
CLI loads them in the API server, and the engine core loads them after it has unpickled its config
(which the plugin's ``FLYDSL`` member survives: ``flydsl_backends.plugins.vllm_flydsl_member``).
Nothing happens on a plain ``import`` of this module.

The ``flydsl_backends`` loggers print to stderr at INFO in both processes, so the server log shows
the plugin registering and which implementation the paged-attention calls chose.

On a GPU (``FLYDSL_E2E_CUDA=1``) the API server's process records where torch first initialises CUDA
(``trace_cuda_init``; nothing there should: a CUDA context in the API server holds GPU memory the
engine core needs); the log line ``flydsl-e2e: CUDA initialised in the API server`` names the caller.
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
        if __name__ != "__mp_main__":
            # the API server (not the spawned engine core, whose module is __mp_main__): model inspection in a
            # subprocess, as in a real `vllm serve`, so it cannot initialise CUDA here
            vllm_gpu.inspect_models_in_subprocess()
    else:
        from integration_tests.e2e import vllm_cpu

        vllm_cpu.prepare()


CUDA_INIT_MARK = "flydsl-e2e: CUDA initialised in the API server"


def trace_cuda_init() -> None:
    """From now on, the first initialisation of CUDA through torch in this process (not in a forked
    child, whose engine core initialises it as it should) writes one line to
    stderr: ``CUDA_INIT_MARK``, then the Python stack that caused it (frames joined by " | "). torch's
    CUDA functions look ``_lazy_init`` up in ``torch.cuda``'s globals, where this wraps it."""
    import os
    import traceback

    import torch.cuda

    real = torch.cuda._lazy_init
    if getattr(real, "_flydsl_traced", False):
        return
    pid = os.getpid()

    def traced():
        if not torch.cuda.is_initialized() and os.getpid() == pid:  # not in a forked child
            frames = traceback.format_stack(limit=30)[:-1]
            stack = " | ".join(f.strip().replace("\n", " ") for f in frames)
            sys.stderr.write(f"{CUDA_INIT_MARK} at: {stack}\n")
            sys.stderr.flush()
        return real()

    traced._flydsl_traced = True
    torch.cuda._lazy_init = traced


def main(argv=None) -> None:
    import os

    if os.environ.get("FLYDSL_E2E_CUDA") == "1":
        trace_cuda_init()
    _prepare_process()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__mp_main__":  # the spawned engine-core process
    _prepare_process()

if __name__ == "__main__":
    main()
