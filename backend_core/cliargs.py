"""argparse types shared by the CLI (``flydsl_backends.cli``) and the op families' ``bench`` flags: a bad
value is refused by argparse with the flag's name, before any work starts."""

from __future__ import annotations

import argparse
import math

__all__ = ["positive_int", "nonnegative_int", "finite_float", "comma_list"]


def _int_at_least(lo: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    return parse


positive_int = _int_at_least(1, "a positive integer")  # argparse type: an integer >= 1
nonnegative_int = _int_at_least(0, "an integer >= 0")  # argparse type: an integer >= 0


def finite_float(text: str) -> float:
    """argparse type: a finite float (not nan / inf)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def comma_list(choices=None, item=str):
    """argparse type: a comma list of ``item`` values (each in ``choices`` when given)."""
    def parse(text: str):
        out = []
        for raw in text.split(","):
            raw = raw.strip()
            try:
                v = item(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise argparse.ArgumentTypeError(f"{raw!r} in {text!r}: {exc}") from None
            if choices is not None and v not in choices:
                raise argparse.ArgumentTypeError(f"{raw!r} in {text!r}: expected one of {', '.join(choices)}")
            out.append(v)
        return out
    return parse
