"""The GPU platform of the SGLang engine benchmark (``sglang_gpu``), checked where it can be without a
GPU: in a fresh process selecting it through SGLang's own platform discovery (the entry point
``prepare`` declares), the platform object has the properties the GPU path relies on, SGLang's fused
ops resolve their torch-native forwards, SGLang's custom ops get a CUDA kernel (not only PrivateUse1),
the MHA pool does not take the JIT store_cache path, and the device stub's sgl_kernel stand-ins
answer as documented.

Run: PYTHONPATH=integration_tests/stubs /path/to/venv-sgl/bin/python -m pytest -q \\
         integration_tests/e2e/test_sglang_gpu_platform.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from integration_tests.e2e import sglang_gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROBE = r"""
import torch
from sglang.srt.platforms import current_platform as p
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
assert type(p).__name__ == "TestCudaPlatform", type(p)
assert p.is_out_of_tree() and not p.is_cuda() and p.device_type == "cuda" and p.device_name == "cuda"
assert p.capabilities.supports_triton and p.capabilities.graph_capture, p.capabilities
assert not p.capabilities.piecewise_graph and not p.capabilities.supports_pynccl
assert p.get_dispatch_key_name() == "native" and p.get_default_attention_backend() == "triton"
assert p.get_graph_runner_cls() is DecodeCudaGraphRunner
assert p.get_torch_distributed_backend_str() == "nccl"
assert p.get_group_coordinator_device(0) == torch.device("cuda:0")

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.activation import SiluAndMul
for op in (RMSNorm(8), SiluAndMul()):
    assert op._resolve_forward_method().__func__ is type(op).forward_native, op

from sglang.srt.utils.common import direct_register_custom_op
def flydsl_probe_op(x: torch.Tensor) -> torch.Tensor:
    return x + 1
direct_register_custom_op("flydsl_probe_op", flydsl_probe_op, mutates_args=[])
has = torch._C._dispatch_has_kernel_for_dispatch_key
assert has("sglang::flydsl_probe_op", "CUDA") and not has("sglang::flydsl_probe_op", "PrivateUse1")
# other libraries keep their keys: torch's FSDP registers CUDA and PrivateUse1 kernels side by side
import torch.distributed.fsdp  # noqa: F401  (failed on the H200 while every PrivateUse1 became CUDA)
assert has("fsdp::all_gather_copy_in", "PrivateUse1") and has("fsdp::all_gather_copy_in", "CUDA")

import sglang.srt.layers.dual_gemm as dg
assert dg.is_cuda() is False  # no CuTe-DSL dual GEMM (cutlass) on this platform

import sglang.srt.mem_cache.memory_pool as mp
assert mp.can_use_store_cache(256, 256) is False

from sgl_kernel.utils import is_arch_support_pdl
from sgl_kernel import weak_ref_tensor
t = torch.ones(3)
assert is_arch_support_pdl() is False and weak_ref_tensor(t) is t
print("PROBE OK")
"""


def test_gpu_platform_declared_and_seams(tmp_path):
    env = dict(os.environ)
    env.update(sglang_gpu.prepare(tmp_path / "platform"))
    # the device stub of sgl_kernel, as benchmarks/device_run.sh puts it on the path
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "integration_tests" / "sglang" / "device_stubs")
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "PROBE OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


KIMI_PROBE = r"""
import os
from sglang.srt.platforms import current_platform as p
assert type(p).__name__ == "TestCudaPlatform", type(p)
assert p.supports_speculative_algorithm("EAGLE") and p.supports_speculative_algorithm("STANDALONE")
assert p.supports_speculative_draft_attention_backend("EAGLE", "torch_native")
assert p.get_default_speculative_draft_attention_backend("EAGLE") == "torch_native"
assert os.environ["FLYDSL_SGLANG_KDA_CALLS"].endswith("calls") and "TRITON_INTERPRET" not in os.environ
print("PROBE OK")
"""


def test_kimi_and_speculative_declarations_on_the_gpu_platform(tmp_path):
    """The GPU entry point of the Kimi engine case (``sglang_kimi.prepare(cuda=True)``: the same CUDA
    platform, its traces, no interpreter) and the platform's speculative-decoding declarations."""
    from integration_tests.e2e import sglang_kimi

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.update(sglang_kimi.prepare(tmp_path / "platform", count_path=tmp_path / "calls", cuda=True))
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "integration_tests" / "sglang" / "device_stubs")
    r = subprocess.run([sys.executable, "-c", KIMI_PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "PROBE OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
