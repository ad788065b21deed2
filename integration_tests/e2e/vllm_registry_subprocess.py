"""``python -m integration_tests.e2e.vllm_registry_subprocess``: vLLM's model-inspection subprocess
(``python -m vllm.model_executor.models.registry``) with ``vllm_gpu``'s stand-ins for the CUDA extensions the
device image lacks installed first (``vllm_gpu.inspect_models_in_subprocess`` points vLLM at it). It reads the
pickled inspection from stdin and writes its result as vLLM's does."""

from integration_tests.e2e import vllm_gpu

vllm_gpu.register_ops()
vllm_gpu.install_flash_attn_stub()

from vllm.model_executor.models.registry import _run  # noqa: E402 (after the stand-ins)

if __name__ == "__main__":
    _run()
