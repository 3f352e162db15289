"""Option value types for command lines (the ``kvabi`` commands, and the bench suites of
kvabi and of plugins): a bad value is a usage error.

A public module outside :mod:`kvabi.commands` so that a backend's bench suite can use it
without depending on the command line.  argparse calls a ``type=`` function on the option's
text; these refuse what the option cannot mean (``--block-size 0``, ``--time-budget -5``,
``--max-examples 1.5``, ``--junit-xml`` naming a directory) with an
``argparse.ArgumentTypeError``, which the ``kvabi`` command prints as one line
(``kvabi: error: <command>: argument --x: <why>``) and exit status 2.  :func:`from_kvabi`
turns any kvabi parser that raises :class:`~kvabi.KVABIError` into such a type.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from .coerce import INT64_MAX
from .errors import KVABIError

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


def _existing_ancestor(p: Path) -> Path:
    """The nearest of ``p``'s ancestors that exists (``p`` itself not included)."""
    for a in p.absolute().parents:
        if os.path.lexists(a):
            return a
    return Path("/")  # unreachable: the root exists


def _path_text(text: str) -> Path:
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a path, got {text!r}")
    return Path(text)


def output_file_arg(text: str) -> str:
    """A ``type=`` for a file to write (created with its missing parent directories): not
    an existing directory, and below nothing that is not a directory.  Returns the text."""
    p = _path_text(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if os.path.lexists(p) and not p.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a regular file")
    a = _existing_ancestor(p)
    if not a.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(a)!r} is not a directory")
    return text


def directory_arg(text: str) -> str:
    """A ``type=`` for a directory to write into: an existing directory, or a path that can
    be made one (below nothing that is not a directory).  Returns the text."""
    p = _path_text(text)
    if os.path.lexists(p):
        if not p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
        return text
    a = _existing_ancestor(p)
    if not a.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(a)!r} is not a directory")
    return text


output_file_arg.__name__ = "file path"
directory_arg.__name__ = "directory"
