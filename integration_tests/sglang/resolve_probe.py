"""Run in a fresh process by test_plugin.py: load SGLang's plugins the way ``launch_server`` does, then
parse + resolve each argv given as JSON in argv[1]; print one JSON result list on the last line.

Result per case: ``{"ok": bool, "error": str, "args": {...resolved fields...}}``; plus, once, the
plugin modules' view of the process (which heavy modules got imported)."""

import json
import os
import sys

from sglang.srt.plugins import load_plugins

load_plugins()  # what python -m sglang.launch_server does before prepare_server_args

if os.environ.get("FLYDSL_PROBE_CUDA_DEFAULTS") == "1":
    # SGLang's CUDA default for the prefill CUDA graph (breakable) on this CPU machine
    import sglang.srt.model_executor.cuda_graph_config as _cgc

    _cgc.default_prefill_backend = lambda: _cgc.Backend.BREAKABLE

from sglang.srt.server_args import prepare_server_args  # noqa: E402

ENV = dict(os.environ)
def _prefill_graph(a):
    from sglang.srt.arg_groups.overrides import resolved_view

    graphs = getattr(resolved_view(a), "cuda_graph_config", None)
    return None if graphs is None else str(graphs.prefill.backend)


FIELDS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend",
          "linear_attn_decode_backend", "kv_cache_dtype", "page_size", "tp_size")
results = []
for argv in json.loads(sys.argv[1]):
    # each case resolves as in its own server process: resolution publishes some arguments as environment
    # variables (e.g. --mamba-ssm-dtype as SGLANG_MAMBA_SSM_DTYPE), which later cases must not inherit
    os.environ.clear()
    os.environ.update(ENV)
    try:
        a = prepare_server_args(argv)
        a.resolve_once()
        results.append({"ok": True, "error": "", "args": dict({f: getattr(a, f, None) for f in FIELDS},
                                                               prefill_graph=_prefill_graph(a))})
    except SystemExit as e:  # argparse rejected a flag / choice
        results.append({"ok": False, "error": f"SystemExit({e.code})", "args": {}})
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.append({"ok": False, "error": f"{type(e).__name__}: {e}", "args": {}})
# the kernel modules (they import triton / flydsl); SGLang itself imports triton, so that name says nothing
KERNELS = ("kda_backend.triton.kda_decode", "pa_backend.triton.pa_decode", "pa_backend.triton.write_kv",
           "kda_backend.flydsl.kernel", "flydsl")
heavy = sorted(m for m in sys.modules if m in KERNELS or m.startswith("flydsl."))
print(json.dumps({"results": results, "heavy_modules": heavy}))
