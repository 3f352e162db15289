"""Option value types for the ``kvabi`` commands: a bad value is a usage error.

argparse calls a ``type=`` function on the option's text; these refuse what the option
cannot mean (``--block-size 0``, ``--time-budget -5``, ``--max-examples 1.5``) with an
``argparse.ArgumentTypeError``, which the ``kvabi`` command prints as one line
(``kvabi: error: <command>: argument --x: <why>``) and exit status 2.  :func:`from_kvabi`
turns any kvabi parser that raises :class:`~kvabi.KVABIError` into such a type.
"""
from __future__ import annotations

import argparse
import math
import re

from ..coerce import INT64_MAX
from ..errors import KVABIError

_INT = re.compile(r"[+-]?[0-9]+")


def int_arg(lo: int | None = None, hi: int | None = None, name: str = "integer"):
    """A ``type=`` for a decimal integer in ``[lo, hi]`` (no float, no ``1e3``; never
    beyond int64)."""
    top = INT64_MAX if hi is None else min(hi, INT64_MAX)

    def parse(text: str) -> int:
        t = text.strip()
        if not _INT.fullmatch(t):
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}")
        if len(t) > 20:  # beyond int64 whatever the digits; never convert thousands of them
            raise argparse.ArgumentTypeError(f"must be <= {top}, got {t[:24]}...")
        v = int(t)
        if v > top:
            raise argparse.ArgumentTypeError(f"must be <= {top}, got {v}")
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def float_arg(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
              name: str = "number"):
    """A ``type=`` for a finite real number in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``); ``nan`` and ``inf`` are refused."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo}, "
                                             f"got {text}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {text}")
        return v

    parse.__name__ = name
    return parse


def from_kvabi(fn, name: str | None = None):
    """A ``type=`` from ``fn(text)`` that raises KVABIError for a bad value."""
    def parse(text: str):
        try:
            return fn(text)
        except KVABIError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name or getattr(fn, "__name__", "value")
    return parse


#: tokens per block, heads, head dims, lengths: at least 1
positive_int = int_arg(lo=1, name="positive integer")
#: counts that may be 0
nonnegative_int = int_arg(lo=0, name="non-negative integer")
