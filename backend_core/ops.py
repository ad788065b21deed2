"""The op-family protocol: what the CLI (``info``, ``verify``, ``accuracy``, ``bench``) and the FlyDSL compile gate
need from an op family, as import paths resolved on first use (docs/design.md §2).

An op family is one package (``kda_backend``, ``pa_backend``) plus one ``OpFamily`` line in
``flydsl_backends.ops.OPS``. The package provides:

* ``REGISTRY`` (``backend_core.registry.OpRegistry``): its implementations; a family of several ops
  (``pa``: decode, prefill, write) also names ``registries`` (a dict op -> registry, each op with its
  own coverage);
* ``verify``: ``run_verify(impls, device, small, progress=None) -> rows``, one dict per (implementation,
  case) with ``impl``, ``case``, ``ok`` and optionally ``out_err``, ``state_err``, ``error``,
  ``skipped``;
* ``accuracy`` (optional): ``run_accuracy(impls, device, steps, small, progress=None, step_progress=None) ->
  rows`` (rows as ``verify``'s, plus ``bound`` and ``detail``): long-horizon decode against float64;
* ``bench`` (optional): ``bench_cli(args) -> rows or int`` (an int is an exit status: the command
  printed its own result), and ``bench_args`` (optional): ``add_bench_args(parser)`` for its flags;
* ``flydsl_sources`` (optional): ``sources() -> [(source, usable, why)]`` for ``info``;
* ``flydsl_kernels`` (optional): a module with the project's own FlyDSL kernels for the compile
  gate: ``SHIPPED_SPECS``, ``kernel_name(spec)``, ``threads_of(spec)``, ``compile_spec(spec) ->
  resources`` and ``BUDGETS_PATH`` (its ``budgets.json``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["OpFamily", "accuracy_rows"]


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


@dataclass(frozen=True)
class OpFamily:
    name: str  # the CLI's name for it ("kda")
    package: str  # exposes REGISTRY
    verify: str  # "module:run_verify"
    bench: Optional[str] = None  # "module:bench_cli"
    bench_args: Optional[str] = None  # "module:add_bench_args"
    flydsl_sources: Optional[str] = None  # "module:sources"
    flydsl_kernels: Optional[str] = None  # "module" (the compile gate's protocol)
    registries: Optional[str] = None  # "module:NAME" of a dict op name -> registry (families of several ops)
    accuracy: Optional[str] = None  # "module:run_accuracy"

    def registry(self):
        return _resolve(self.package).REGISTRY

    def op_registries(self):
        """{op name: registry}: one entry per op of the family."""
        if self.registries:
            return dict(_resolve(self.registries))
        return {self.name: self.registry()}

    def run_verify(self, impls, device, small: bool, progress=None):
        return _resolve(self.verify)(impls, device, small, progress=progress)

    def run_accuracy(self, impls, device, steps: int, small: bool, progress=None, step_progress=None):
        if self.accuracy is None:
            raise ValueError(f"op {self.name!r} has no long-horizon accuracy run")
        return _resolve(self.accuracy)(impls, device, steps, small, progress=progress, step_progress=step_progress)

    def run_bench(self, args):
        if self.bench is None:
            raise ValueError(f"op {self.name!r} has no benchmark")
        return _resolve(self.bench)(args)

    def add_bench_args(self, parser) -> None:
        if self.bench_args is not None:
            _resolve(self.bench_args)(parser)

    def sources(self):
        return _resolve(self.flydsl_sources)() if self.flydsl_sources else []

    def kernels(self):
        """The compile gate's module, or None when the family ships no own FlyDSL kernel."""
        return _resolve(self.flydsl_kernels) if self.flydsl_kernels else None


def accuracy_rows(impls, cases, run_one, steps: int, progress=None, step_progress=None):
    """The rows of a family's ``run_accuracy``: ``run_one(impl, params, tick)`` for every (case, implementation)
    returns the row's fields (``ok`` and errors, or ``skipped`` with the reason) and calls ``tick(step)`` as it
    goes; ``cases`` is [(description, params)]. An exception is a failure row, not an abort of the table."""
    rows = []
    for desc, params in cases:
        for impl in impls:
            res = {"impl": impl, "case": desc}
            tick = None
            if step_progress:
                def tick(step, impl=impl, desc=desc):
                    step_progress(f"  {impl} {desc}: step {step}/{steps}")
            try:
                res.update(run_one(impl, params, tick))
            except Exception as exc:  # noqa: BLE001 - reported in the table
                res.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            rows.append(res)
            if progress:
                progress(res)
    return rows
