"""A stand-in for AITER's FlyDSL KDA entry points (``aiter.ops.flydsl``), for CPU contract tests.

It exposes the documented signatures and conventions (``raw_beta`` [1, B, H], ``out`` [1, B, H, V],
Kimi-K3 TP8 shapes, safe gate required, padding = index < 0 or past the *state* cache) and raises
TypeError/IndexError on anything else, so an adapter that passes the wrong thing fails the test.
The numbers come from the project's reference.
"""

import torch

from kda_backend import kda_decode, kda_decode_with_f_b

H, K, C = 12, 128, 3 * 12 * 128
calls = []


def _check(x, conv_weight, conv_bias, conv_state, raw_beta, lower_bound, state, state_indices, output_gate, out):
    B = x.shape[0]
    if tuple(x.shape) != (B, C) or tuple(conv_weight.shape) != (C, 4) or conv_bias is not None:
        raise TypeError(f"stand-in: x {tuple(x.shape)} / conv_weight {tuple(conv_weight.shape)} / bias not Kimi-K3 TP8")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (C, 3):
        raise TypeError(f"stand-in: conv_state must be [cache, {C}, 3] (or the width-major view), got "
                        f"{tuple(conv_state.shape)}")
    if raw_beta.dim() != 3 or tuple(raw_beta.shape) != (1, B, H):
        raise TypeError(f"stand-in: raw_beta must be [1, B, {H}], got {tuple(raw_beta.shape)}")
    if out is None or tuple(out.shape) != (1, B, H, K) or not out.is_contiguous():
        raise TypeError(f"stand-in: out must be a contiguous [1, B, {H}, {K}], got "
                        f"{None if out is None else tuple(out.shape)}")
    if lower_bound is None:
        raise TypeError("stand-in: lower_bound is required")
    if state_indices.dtype != torch.int32 or tuple(state_indices.shape) != (B,):
        raise TypeError("stand-in: state_indices must be int32 [B]")
    live = (state_indices >= 0) & (state_indices < state.shape[0])
    if bool((live & (state_indices >= conv_state.shape[0])).any()):
        raise IndexError("stand-in: a live index past the conv_state cache (AITER would read out of bounds)")
    if tuple(output_gate.shape) != (B, H, K):
        raise TypeError("stand-in: output_gate must be [B, H, V]")


def flydsl_kda_decode(x, conv_weight, conv_bias, conv_state, raw_a, raw_beta, A_log, dt_bias, lower_bound, state,
                      state_indices, output_gate, norm_weight, norm_eps, out=None):
    _check(x, conv_weight, conv_bias, conv_state, raw_beta, lower_bound, state, state_indices, output_gate, out)
    calls.append("flydsl_kda_decode")
    kda_decode(x, conv_weight, conv_state, raw_a, raw_beta[0], A_log, dt_bias, state, state_indices, output_gate,
               norm_weight, lower_bound=lower_bound, norm_eps=norm_eps, out=out[0], backend="torch")
    return out


def flydsl_kda_decode_with_f_b(f_a, f_b_weight, x, conv_weight, conv_bias, conv_state, raw_beta, A_log, dt_bias,
                               lower_bound, state, state_indices, output_gate, norm_weight, norm_eps, out=None):
    _check(x, conv_weight, conv_bias, conv_state, raw_beta, lower_bound, state, state_indices, output_gate, out)
    calls.append("flydsl_kda_decode_with_f_b")
    kda_decode_with_f_b(f_a, f_b_weight, x, conv_weight, conv_state, raw_beta[0], A_log, dt_bias, state,
                        state_indices, output_gate, norm_weight, lower_bound=lower_bound, norm_eps=norm_eps,
                        out=out[0], backend="torch")
    return out


flydsl_kda_decode.state_dtypes = (torch.float32, torch.bfloat16)
flydsl_kda_decode_with_f_b.state_dtypes = (torch.float32, torch.bfloat16)
supported_devices = []


def is_flydsl_kda_decode_supported(device=None):
    supported_devices.append(device)
    return True


def functions():
    return {"flydsl_kda_decode": flydsl_kda_decode, "flydsl_kda_decode_with_f_b": flydsl_kda_decode_with_f_b,
            "is_flydsl_kda_decode_supported": is_flydsl_kda_decode_supported}
