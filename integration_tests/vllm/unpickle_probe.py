"""A spawned worker's view: unpickle an ``AttentionConfig`` *before* any plugin loads (as vLLM's spawned
engine-core / worker processes do), then load the general plugins and resolve the backend class (and for FLYDSL, pickle
it on)."""

import json
import pickle
import sys

out = {}
try:
    with open(sys.argv[1], "rb") as f:
        cfg = pickle.load(f)
    out["unpickled"] = cfg.backend.name
except Exception as e:  # noqa: BLE001
    out["unpickled"] = f"{type(e).__name__}: {e}"
    cfg = None
from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()
if cfg is not None:
    cls = cfg.backend.get_class()
    out["class"] = f"{cls.__module__}.{cls.__qualname__}"
    out["name"] = cls.get_name()
    if cfg.backend.name == "FLYDSL":  # on to a grandchild (the engine core's workers)
        out["pickles_on"] = pickle.loads(pickle.dumps(cfg)).backend.name
print(json.dumps(out))
