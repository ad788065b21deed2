"""Run in a fresh process by test_plugin.py: parse each argv (JSON list in argv[1]) the way ``vllm serve``
does (``AsyncEngineArgs.add_cli_args`` loads the general plugins first), build the engine config and
report the selected attention backend; print one JSON object on the last line.

With ``--pickle PATH`` instead: pickle the first config's ``attention_config`` to PATH (for the
spawned-process check)."""

import json
import pickle
import sys

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
cases = json.loads(sys.argv[1])
pickle_to = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--pickle" else None
results = []
for argv in cases:
    try:
        vc = AsyncEngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()
        b = vc.attention_config.backend
        results.append({"ok": True, "error": "", "backend": None if b is None else b.name,
                        "path": None if b is None else b.get_path(), "kv_cache_dtype": vc.cache_config.cache_dtype,
                        "block_size": vc.cache_config.block_size})
        if pickle_to:
            with open(pickle_to, "wb") as f:
                pickle.dump(vc.attention_config, f)
            pickle_to = None
    except SystemExit as e:
        results.append({"ok": False, "error": f"SystemExit({e.code})"})
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
KERNELS = ("pa_backend.triton.pa_decode", "pa_backend.triton.write_kv", "kda_backend.triton.kda_decode",
           "kda_backend.flydsl.kernel", "flydsl")
heavy = sorted(m for m in sys.modules if m in KERNELS or m.startswith("flydsl."))
# modules whose import initialises the GPU (FLA's utilities query it): in vLLM's parent process a context holds GPU
# memory there and forces a `vllm.LLM` engine core to spawn (the plugin must register its KDA layer hooks without
# importing them)
GPU_AT_IMPORT = ("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn",
                 "vllm.third_party.flash_linear_attention.ops.utils")
print(json.dumps({"results": results, "heavy_modules": heavy,
                  "gpu_at_import": sorted(m for m in GPU_AT_IMPORT if m in sys.modules)}))
