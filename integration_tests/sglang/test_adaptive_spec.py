"""--speculative-adaptive with flydsl: SGLang's adaptive controller switches between tiers of
candidate_steps + 1 draft tokens at run time, and flydsl verifies at most 4 per request: start-up refuses
tiers wider than that (they failed mid-serving, eager in init_forward_metadata, with graphs at capture) and
accepts a config whose tiers all fit. (The flag through the installed plugin: test_plugin.py.)"""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import pa_backend.sglang as pas  # noqa: E402


def _cfg(**kw):
    base = dict(attention_backend="flydsl", prefill_attention_backend=None, decode_attention_backend=None,
                disaggregation_mode="null", hicache_storage_backend=None, enable_pdmux=False,
                kv_cache_dtype="fp8_e4m3", page_size=16, speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                speculative_num_steps=3, speculative_num_draft_tokens=4,
                speculative_draft_attention_backend="triton", speculative_adaptive=False,
                speculative_adaptive_config=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_adaptive_speculation_with_default_tiers_is_refused_at_start_up():
    pas.check_server_args(_cfg(), is_mla=False)  # the fixed chain stays accepted
    with pytest.raises(ValueError, match="--speculative-adaptive"):
        pas.check_server_args(_cfg(speculative_adaptive=True), is_mla=False)


def test_adaptive_speculation_within_four_tokens_is_accepted(tmp_path):
    cfg_path = tmp_path / "adaptive.json"
    cfg_path.write_text(json.dumps({"1": {"candidate_steps": [0, 1, 3]}, "8": {"candidate_steps": [0, 1]}}))
    pas.check_server_args(_cfg(speculative_adaptive=True, speculative_adaptive_config=str(cfg_path)), is_mla=False)
