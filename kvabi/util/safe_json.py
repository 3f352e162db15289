"""The one JSON reader for untrusted documents (``specs/security.md``).

Layout descriptors from peers, ``config.json`` files from model hubs and transfer handshakes
all go through :func:`loads`, which either returns plain Python data or raises a
:class:`~kvabi.KVABIError` naming the document.  Unlike :func:`json.loads` it refuses:

- documents larger than ``max_bytes`` (checked before parsing);
- bytes that are not UTF-8 (no ``UnicodeDecodeError`` escapes);
- nesting deeper than ``max_depth`` (measured before parsing, so the parser never recurses
  far enough for a ``RecursionError``);
- duplicate keys in an object (the key is named: "last one wins" lets two readers of one
  document disagree about it);
- ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON) and numbers that overflow to infinity;
- integers beyond int64 (no kvabi quantity is larger; a 5,000-digit integer would
  otherwise cost quadratic time to convert).
"""
from __future__ import annotations

import json
import math

import numpy as np

from .coerce import INT64_MAX
from .errors import KVABIError

#: Default size limit: 16 MiB (the largest public config.json files are well under 1 MiB).
MAX_BYTES = 16 * 2**20
#: Default nesting limit (descriptors nest 3 deep, configs 4 or 5).
MAX_DEPTH = 64
#: int64's range: the default for ``max_int``.
MAX_INT = INT64_MAX

# Bytes that matter to nesting: a lookup table picks them out of the text in one pass.
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_KEEP = _STEP != 0
_KEEP[[_QUOTE, _BACKSLASH]] = True


def _utf8(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)


def nesting_depth(text: str, raw: np.ndarray | None = None) -> int:
    """Deepest nesting of arrays and objects in ``text`` (vectorized, linear time, no
    recursion).  Brackets inside strings do not count: a quote opens or closes a string
    unless an odd run of backslashes precedes it.

    For a malformed document the count up to the first syntax error matches the parser's,
    which is all the depth guard needs: the parser stops there.
    """
    a = _utf8(text) if raw is None else raw
    pos = np.flatnonzero(_KEEP[a])  # brackets, quotes and backslashes only
    if not pos.size:
        return 0
    v = a[pos]
    bs = v == _BACKSLASH
    if bs.any():  # escapes: a quote counts unless an odd run of backslashes precedes it
        k = np.arange(v.size)
        adjacent = np.zeros(v.size, bool)
        adjacent[1:] = np.diff(pos) == 1
        # Runs of backslashes adjacent in the text; the length of the run before a quote.
        prev_bs = np.zeros(v.size, bool)
        prev_bs[1:] = bs[:-1]
        run_start = np.maximum.accumulate(np.where(bs & ~(prev_bs & adjacent), k, 0))
        run_before = np.zeros(v.size, np.int64)
        follows = prev_bs & adjacent
        run_before[follows] = k[follows] - run_start[k[follows] - 1]
        quote = (v == _QUOTE) & (run_before % 2 == 0)
    else:
        quote = v == _QUOTE
    in_string = (np.cumsum(quote) - quote) % 2 == 1  # odd count of quotes strictly before
    step = np.where(in_string, 0, _STEP[v]).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


class _Refused:
    """A value the parser met but refuses (NaN, an integer beyond ``max_int``), kept in
    place until parsing ends so that the error can name where it sits."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _find_refused(x, path: str):
    """(path, why) of the first refused value in parsed data, or None (iterative)."""
    todo = [(x, path)]
    while todo:
        v, p = todo.pop()
        if isinstance(v, _Refused):
            return p, v.why
        if isinstance(v, dict):
            todo.extend((w, f"{p}.{k}" if p else str(k)) for k, w in reversed(v.items()))
        elif isinstance(v, list):
            todo.extend((w, f"{p}[{i}]") for i, w in reversed(list(enumerate(v))))
    return None


def loads(data, *, what: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
          max_int: int | None = MAX_INT, name_fields: bool = False):
    """Parse ``data`` (``str``, ``bytes`` or ``bytearray``) as one strict JSON document.

    ``what`` names the document in every error (e.g. ``"descriptor"``, ``"config
    'x.json'"``).  ``max_int`` bounds the magnitude of integers (None: no bound beyond the
    size limit).  With ``name_fields``, a refused value (``NaN``, ``Infinity``, an integer
    beyond ``max_int``) is reported by its place in the document (``sizes.L: ...``)
    instead of by ``what``.  Returns dicts, lists, str, int, float, bool and None.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if len(raw) > max_bytes:
            raise KVABIError(f"{what}: {len(raw)} bytes, more than the limit of {max_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KVABIError(f"{what}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                             f"{e.start})") from None
    elif isinstance(data, str):
        # A character is at least one byte: cheap bound first, then the exact size.
        if len(data) > max_bytes or len(data.encode("utf-8", "surrogatepass")) > max_bytes:
            raise KVABIError(f"{what}: more than the limit of {max_bytes} bytes")
        text = data
    else:
        raise KVABIError(f"{what}: must be JSON text (str or bytes), got {type(data).__name__}")
    if text.startswith("\ufeff"):
        raise KVABIError(f"{what}: starts with a byte-order mark; JSON text must not")
    raw = _utf8(text)
    depth = nesting_depth(text, raw)
    if depth > max_depth:
        raise KVABIError(f"{what}: nested {depth} deep, more than the limit of {max_depth}")

    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise KVABIError(f"{what}: duplicate key {_short(k)} in one object")
            out[k] = v
        return out

    limit_digits = None if max_int is None else len(str(max_int)) + 1

    def refuse(why: str):
        if name_fields:
            return _Refused(why)
        raise KVABIError(f"{what}: {why}")

    def integer(s: str) -> int:
        # The length first: converting thousands of digits costs quadratic time.
        if limit_digits is not None and len(s) > limit_digits:
            return refuse(f"integer {_short(s)} is beyond +-{max_int}")
        v = int(s)
        if max_int is not None and not -max_int <= v <= max_int:
            return refuse(f"integer {v} is beyond +-{max_int}")
        return v

    def real(s: str) -> float:
        v = float(s)
        if not math.isfinite(v):
            return refuse(f"number {_short(s)} overflows a double")
        return v

    def constant(s: str):
        return refuse(f"{s} is not a JSON value")

    # Integers go through the checking hook only when some run of digits could be one
    # beyond the bound (or too long to convert cheaply): with every run shorter than the
    # bound's digits, each integer is within it, and the C parser converts them.
    fast = max_int is not None and longest_digit_run(raw) < limit_digits - 1
    hook = int if fast else integer
    try:
        out = json.loads(text, object_pairs_hook=pairs, parse_int=hook, parse_float=real,
                         parse_constant=constant)
    except KVABIError:
        raise
    except json.JSONDecodeError as e:
        raise KVABIError(f"{what}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    except RecursionError:  # only with a max_depth beyond what the parser can nest
        raise KVABIError(f"{what}: nested too deep for the parser") from None
    except ValueError as e:  # defence in depth; the hooks above raise KVABIError
        raise KVABIError(f"{what}: not valid JSON ({e})") from None
    if name_fields:
        bad = _find_refused(out, "")
        if bad is not None:
            raise KVABIError(f"{bad[0] or what}: {bad[1]}")
    return out


def longest_digit_run(raw: np.ndarray) -> int:
    """The most consecutive ASCII digits in UTF-8 bytes ``raw`` (vectorized)."""
    digit = np.empty(raw.size + 2, np.int8)
    digit[0] = digit[-1] = 0
    np.less(raw - np.uint8(48), 10, out=digit[1:-1], casting="unsafe")
    edges = np.flatnonzero(np.diff(digit))  # run starts and ends, alternating
    return int((edges[1::2] - edges[::2]).max(initial=0))


def _short(s: str, limit: int = 40) -> str:
    r = repr(s)
    return r if len(r) <= limit else r[:limit - 3] + "..."
