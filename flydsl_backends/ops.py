"""The table of op families the CLI and the compile gate iterate over (``backend_core.ops``). A new
op family is its package plus one line here."""

from __future__ import annotations

from typing import Tuple

from backend_core.ops import OpFamily

__all__ = ["OPS", "get", "names"]

OPS: Tuple[OpFamily, ...] = (
    OpFamily("kda", "kda_backend", verify="kda_backend.verify:run_verify", accuracy="kda_backend.accuracy:run_accuracy",
             bench="kda_backend.benchmark:bench_cli",
             bench_args="kda_backend.benchmark:add_bench_args", flydsl_sources="kda_backend.flydsl:sources",
             flydsl_kernels="kda_backend.flydsl.shipped", registries="kda_backend.registry:REGISTRIES"),
    OpFamily("pa", "pa_backend", verify="pa_backend.verify:run_verify", accuracy="pa_backend.accuracy:run_accuracy",
             bench="pa_backend.benchmark:bench_cli",
             bench_args="pa_backend.benchmark:add_bench_args", flydsl_sources="pa_backend.flydsl:sources",
             registries="pa_backend.api:REGISTRIES"),
)


def names() -> Tuple[str, ...]:
    return tuple(op.name for op in OPS)


def get(name: str) -> OpFamily:
    for op in OPS:
        if op.name == name:
            return op
    raise ValueError(f"op: expected one of {names()}, got {name!r}")
