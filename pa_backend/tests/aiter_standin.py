"""A stand-in for AITER's FlyDSL paged decode (``aiter.ops.flydsl.pa_decode``), for CPU contract
tests: the documented signature and conventions (output first and contiguous, [1] per-tensor
scales, partition count covering the table), computed with the project's reference. Anything
else raises TypeError, so a wrong mapping fails the test."""


from pa_backend import pa_decode as _ref_decode

calls = []


def pa_decode(output, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
              query_length, max_context_partition_num, context_partition_size=256, compute_type=None, sinks=None,
              sliding_window=0):
    if not output.is_contiguous() or output.shape != query.shape or output.dtype != query.dtype:
        raise TypeError("stand-in: output must be contiguous, shaped and typed like query")
    for name, s in (("key_scale", key_scale), ("value_scale", value_scale)):
        if s.dim() not in (1, 3) or (s.dim() == 1 and s.numel() != 1):
            raise TypeError(f"stand-in: {name} must be [1] or [num_blocks, Hkv, block], got {tuple(s.shape)}")
    if compute_type != query.dtype:
        raise TypeError(f"stand-in: compute_type {compute_type} != query dtype {query.dtype}")
    if max_context_partition_num * context_partition_size < block_tables.shape[1] * key_cache.shape[3]:
        raise TypeError("stand-in: max_context_partition_num does not cover the block table")
    calls.append((query_length, max_context_partition_num, context_partition_size))
    _ref_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale.reshape(-1)[0]
                if key_scale.dim() == 1 else key_scale, value_scale.reshape(-1)[0] if value_scale.dim() == 1 else value_scale,
                query_length=query_length, sliding_window=sliding_window, sinks=sinks, out=output, backend="torch")
    return output


def functions():
    return {"pa_decode": pa_decode}
