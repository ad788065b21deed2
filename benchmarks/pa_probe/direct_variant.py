"""A decode variant for the probes (nothing here ships): a work item whose context fits in one partition
(n_live == 1: every item up to MIN_PARTITION_TOKENS, and more at small batches) has its output rows written
by that partition's task, and the reduce's program for it does nothing. The shipped kernels write the
partial to the workspace and merge that single partial in the reduce (a second round trip per item).

``direct_module()`` is the tree's pa_decode.py with that change made in memory (each edit must match
exactly once, so a changed kernel file fails loudly instead of probing something else)."""
import os

from probe_util import module_from_source

_KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "pa_backend", "triton",
                       "pa_decode.py")

EDITS = [
    # partition task: the only live partition of an item writes the rows (tasks past it store nothing)
    ("""    else:
        ws = ((i_s * HKV + i_h) * P + i_p) * BM""",
     """    elif n_live == 1:
        _store_rows(b_m, b_l, b_acc, p_sinks, p_out, q0, row, grp, m_valid & live_p_, i_h, stride_o_t, stride_o_h,
                    G, D, HAS_SINKS)
    else:
        ws = ((i_s * HKV + i_h) * P + i_p) * BM"""),
    # reduce: nothing to merge for such an item (n_live == 0 still writes its zero rows)
    ("""    # the max over partitions: RED_PC partitions' rows per load, independent of each other
    o_c = tl.arange(0, RED_PC)""",
     """    if n_live != 1:
        _merge_rows(p_ws_m, p_ws_l, p_ws_acc, p_sinks, p_out, base, n_live, q0, row, grp, m_valid, i_h,
                    stride_o_t, stride_o_h, G, BM, D, HAS_SINKS, UNROLL)


@triton.jit
def _merge_rows(p_ws_m, p_ws_l, p_ws_acc, p_sinks, p_out, base, n_live, q0, row, grp, m_valid, i_h,
                stride_o_t, stride_o_h, G: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
                HAS_SINKS: tl.constexpr, UNROLL: tl.constexpr):
    o_m = tl.arange(0, BM)
    o_d = tl.arange(0, D)
    # the max over partitions: RED_PC partitions' rows per load, independent of each other
    o_c = tl.arange(0, RED_PC)"""),
]


def direct_source() -> str:
    with open(_KERNEL) as f:
        src = f.read()
    for old, new in EDITS:
        n = src.count(old)
        if n != 1:
            raise RuntimeError(f"direct_variant: an edit matches {n} times in pa_decode.py (expected 1): "
                               f"{old.splitlines()[0]!r}")
        src = src.replace(old, new)
    return src


def direct_module(name: str = "pa_decode_direct"):
    return module_from_source(direct_source(), name)


class _SinksAware:
    """The variant's partition kernel launched where the tree launches its own: the tree passes HAS_SINKS only
    to a direct (P == 1) launch, the variant's tasks may write rows in any launch (sinks are argument 11; the
    tree passes the workspace's m buffer, argument 8, when there are none)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw["HAS_SINKS"] = args[11] is not args[8]
            return self.kernel[grid](*args, **kw)
        return launch


def direct_kernels():
    """(partition, reduce) of the variant, to put in place of pa_backend.triton.pa_decode's."""
    mod = direct_module()
    return _SinksAware(mod.pa_decode_partition_kernel), mod.pa_decode_reduce_kernel
