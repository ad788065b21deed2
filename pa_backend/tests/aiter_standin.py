"""A stand-in for AITER's FlyDSL paged decode (``aiter.ops.flydsl.pa_decode``), for CPU contract
tests: the documented signature and the conventions of the one readable version (output first and
contiguous, contiguous caches and tables, [1] per-tensor scales, the cache's FP8 dtype as compute_type,
blocks of 16 / 64, no sinks or window, 1..64 partitions covering the table), computed with the project's
reference. Anything else raises TypeError, so a wrong mapping fails the test."""


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
    if compute_type != key_cache.dtype:
        raise TypeError(f"stand-in: compute_type {compute_type} != the cache's FP8 dtype {key_cache.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
                    ("context_lengths", context_lengths)):
        if not t.is_contiguous():
            raise TypeError(f"stand-in: {name} must be contiguous (AITER derives its strides from the shape)")
    if key_cache.shape[3] not in (16, 64) or sinks is not None or sliding_window:
        raise TypeError("stand-in: blocks of 16 / 64 tokens, no sinks, no sliding window")
    if not 1 <= max_context_partition_num <= 64:
        raise TypeError("stand-in: 1..64 partitions")
    if max_context_partition_num * context_partition_size < block_tables.shape[1] * key_cache.shape[3]:
        raise TypeError("stand-in: max_context_partition_num does not cover the block table")
    calls.append((query_length, max_context_partition_num, context_partition_size))
    _ref_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale.reshape(-1)[0]
                if key_scale.dim() == 1 else key_scale,
                value_scale.reshape(-1)[0] if value_scale.dim() == 1 else value_scale,
                query_length=query_length, sliding_window=sliding_window, sinks=sinks, out=output, backend="torch")
    return output


def functions():
    return {"pa_decode": pa_decode}
