"""The SGLang adapters' server-argument policies (``kda_backend.sglang.check_server_args``, then
``pa_backend.sglang.check_server_args``, the order the plugin's resolution hook runs them) on plain
records (no SGLang needed): what they accept, what they reject and that each message names the flag
and a combination that works. The same checks run inside SGLang's resolution pipeline in
integration_tests/sglang/test_plugin.py."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

import kda_backend.sglang as kda_sglang
import pa_backend.sglang as pa_sglang


def check_sglang_args(cfg, is_mla):
    kda_sglang.check_server_args(cfg)
    pa_sglang.check_server_args(cfg, is_mla)


SPEC = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, speculative_num_draft_tokens=3,
            speculative_draft_attention_backend="triton")


def _cfg(**over):
    base = dict(attention_backend="flydsl", prefill_attention_backend=None, decode_attention_backend=None,
                kv_cache_dtype="fp8_e4m3", page_size=16, speculative_algorithm=None, linear_attn_backend=None,
                linear_attn_prefill_backend=None, linear_attn_verify_backend=None, linear_attn_decode_backend=None)
    base.update(over)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("over", [{}, dict(page_size=64), dict(page_size=128),
                                  dict(attention_backend="triton", decode_attention_backend="flydsl",
                                       prefill_attention_backend="flydsl"),
                                  dict(attention_backend="triton", kv_cache_dtype="auto", page_size=1),
                                  dict(attention_backend="aiter", kv_cache_dtype="auto", page_size=None,
                                       linear_attn_decode_backend="flydsl"),
                                  dict(SPEC, speculative_num_draft_tokens=2),
                                  dict(SPEC, speculative_algorithm="EAGLE", speculative_num_draft_tokens=4),
                                  dict(SPEC, speculative_algorithm="NEXTN"),
                                  dict(attention_backend="triton", speculative_algorithm="NGRAM",
                                       speculative_eagle_topk=8),
                                  dict(disaggregation_mode="null", hicache_storage_backend=None,
                                       disaggregation_decode_enable_offload_kvcache=False, kv_canary="none"),
                                  dict(attention_backend="triton", disaggregation_mode="prefill")])
def test_accepts(over):
    check_sglang_args(_cfg(**over), is_mla="aiter" in over.values())


@pytest.mark.parametrize("over, is_mla, needle", [
    ({}, True, "--linear-attn-decode-backend flydsl"),
    (dict(kv_cache_dtype="auto"), False, "--kv-cache-dtype fp8_e4m3"),
    (dict(kv_cache_dtype="fp8_e5m2"), False, "--kv-cache-dtype fp8_e4m3"),
    (dict(page_size=1), False, "--page-size 16"),
    (dict(page_size=32), False, "--page-size 16"),
    (dict(SPEC, speculative_algorithm="NGRAM"), False, "--speculative-algorithm EAGLE3"),
    (dict(SPEC, speculative_eagle_topk=4), False, "--speculative-eagle-topk 1"),
    (dict(SPEC, speculative_eagle_topk=None), False, "--speculative-eagle-topk 1"),
    (dict(SPEC, speculative_num_draft_tokens=5), False, "--speculative-num-draft-tokens 3"),
    (dict(SPEC, speculative_num_draft_tokens=1), False, "--speculative-num-draft-tokens 3"),
    (dict(SPEC, speculative_draft_attention_backend=None), False, "--speculative-draft-attention-backend triton"),
    (dict(prefill_attention_backend="flydsl", decode_attention_backend="flydsl", attention_backend="triton",
          page_size=8), False, "--page-size"),
    # one side only: the other backend would read the flydsl pool's layout as its own
    (dict(attention_backend="triton", decode_attention_backend="flydsl"), False,
     "--prefill-attention-backend triton with flydsl on the other path"),
    (dict(prefill_attention_backend="flydsl", attention_backend="triton"), False,
     "--decode-attention-backend triton with flydsl on the other path"),
    (dict(attention_backend="flydsl", prefill_attention_backend="torch_native"), False,
     "use flydsl for both (--attention-backend flydsl)"),
    # KV moved between servers in SGLang's own layout
    (dict(disaggregation_mode="prefill"), False, "--disaggregation-mode prefill with --attention-backend flydsl"),
    (dict(disaggregation_mode="decode"), False, "--attention-backend triton"),
    (dict(hicache_storage_backend="file"), False, "--enable-hierarchical-cache without a storage backend"),
    (dict(disaggregation_decode_enable_offload_kvcache=True), False, "--disaggregation-decode-enable-offload"),
    (dict(kv_canary="log"), False, "use --kv-canary none"),
    (dict(attention_backend="triton", linear_attn_backend="flydsl"), False, "--linear-attn-decode-backend flydsl"),
    (dict(attention_backend="triton", linear_attn_prefill_backend="flydsl"), False, "--linear-attn-prefill-backend"),
    (dict(attention_backend="triton", linear_attn_verify_backend="flydsl"), False, "--linear-attn-verify-backend"),
])
def test_rejects_with_working_combination(over, is_mla, needle):
    with pytest.raises(ValueError) as ei:
        check_sglang_args(_cfg(**over), is_mla=is_mla)
    assert needle in str(ei.value)


def test_plugin_module_imports_only_the_standard_library():
    code = ("import sys; import flydsl_backends.plugins; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'flydsl', 'sglang', 'vllm')]; "
            "assert not bad, bad[:5]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
