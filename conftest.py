"""Test session setup shared by every test folder.

Without a GPU, Triton kernels run through Triton's interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before any test module loads; the interpreter
then treats NaN as a GPU does (``backend_core.interpreter``): FP8 NaN bytes read as NaN, maxNum.
Tests marked ``gpu`` are skipped, with the reason, when torch sees no GPU.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from backend_core import platform

    if platform.triton_interpreter_enabled():
        from backend_core.interpreter import faithful_interpreter

        faithful_interpreter()  # FP8 NaN bytes (the caches' poisoned pages) read as NaN, maxNum as on a GPU


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (none visible to torch); run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
