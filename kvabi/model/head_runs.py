"""The global KV heads a shard holds, kept as runs of consecutive heads (:class:`HeadRuns`).

A layout without a shard holds heads ``0 .. H-1``, and ``H`` may come from an untrusted
descriptor of a few bytes: a tuple of every head would cost memory and time in ``H``, not in
the text.  Runs cost what the text that states them costs (one run for every split a
tensor-parallel engine makes), so every operation a reader needs (length, membership, the
local index of a head, slices, comparison) is O(runs), never O(heads).
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from ..util.errors import KVABIError


class HeadRuns(Sequence):
    """An immutable sequence of distinct non-negative head indices as maximal runs
    ``(first, count)`` of consecutive heads, in local order.  Equal to any sequence of the
    same integers (a tuple, a list, a range)."""

    __slots__ = ("runs", "_starts", "_len")

    def __init__(self, runs):
        """``runs``: ``(first, count)`` pairs of checked ints (count > 0); adjacent runs
        that continue each other are merged."""
        out = []
        for first, count in runs:
            if out and out[-1][0] + out[-1][1] == first:
                out[-1] = (out[-1][0], out[-1][1] + count)
            else:
                out.append((first, count))
        self.runs = tuple(out)
        starts, n = [], 0
        for _, count in self.runs:
            starts.append(n)
            n += count
        self._starts = tuple(starts)  # local index of each run's first head
        self._len = n

    # -- building --------------------------------------------------------------------------
    @classmethod
    def of_range(cls, first: int, count: int) -> "HeadRuns":
        """Heads ``first .. first + count - 1`` (one run; none when ``count`` is 0)."""
        return cls(((first, count),) if count else ())

    @classmethod
    def of_ints(cls, heads) -> "HeadRuns":
        """The runs of a sequence of checked non-negative ints (O(len(heads)))."""
        a = np.asarray(heads, dtype=np.int64).reshape(-1)
        if not a.size:
            return cls(())
        brk = np.flatnonzero(a[1:] != a[:-1] + 1) + 1
        starts = np.r_[0, brk]
        counts = np.diff(np.r_[starts, a.size])
        return cls(zip(a[starts].tolist(), counts.tolist()))

    # -- Sequence ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(self._len)
            if step != 1:
                return tuple(self[j] for j in range(lo, hi, step))
            return self._cut(lo, max(hi, lo))
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"head index must be an integer, got {type(i).__name__}")
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("head index out of range")
        k = bisect_right(self._starts, i) - 1
        return self.runs[k][0] + i - self._starts[k]

    def _cut(self, lo: int, hi: int) -> "HeadRuns":
        out = []
        for (first, count), s in zip(self.runs, self._starts):
            a, b = max(lo, s), min(hi, s + count)
            if a < b:
                out.append((first + a - s, b - a))
        return HeadRuns(out)

    def __iter__(self):
        for first, count in self.runs:
            yield from range(first, first + count)

    def __contains__(self, h) -> bool:
        return self.find(h) is not None

    def find(self, h) -> int | None:
        """The local index of global head ``h``, or None (O(runs))."""
        if not isinstance(h, (int, np.integer)) or isinstance(h, bool):
            return None
        for (first, count), s in zip(self.runs, self._starts):
            if first <= h < first + count:
                return s + int(h) - first
        return None

    def index(self, h, *args) -> int:
        i = self.find(h)
        if i is None:
            raise ValueError(f"{h!r} is not held")
        return i

    def count(self, h) -> int:
        return int(self.find(h) is not None)

    # -- what a reader asks ------------------------------------------------------------------
    @property
    def max(self) -> int:
        """The largest head (KVABIError when empty)."""
        if not self.runs:
            raise KVABIError("shard.heads: a shard holds at least one head")
        return max(first + count - 1 for first, count in self.runs)

    def repeated(self) -> int | None:
        """A head that appears twice, or None (O(runs log runs))."""
        spans = sorted(self.runs)
        for (a, n), (b, _) in zip(spans, spans[1:]):
            if b < a + n:
                return b
        return None

    def issubset(self, other: "HeadRuns") -> bool:
        """Every head of ``self`` is in ``other`` (O(runs of both))."""
        return covered(self.runs, other.runs)

    # -- comparison, hashing, printing -------------------------------------------------------
    def __eq__(self, other):
        if isinstance(other, HeadRuns):
            return self.runs == other.runs
        if isinstance(other, range):
            if len(other) <= 1 or other.step == 1:
                return self.runs == HeadRuns.of_range(other.start, len(other)).runs
            # another step: every head a run of its own (as many runs as heads)
            return len(self.runs) == len(other) == self._len and all(
                r == (h, 1) for r, h in zip(self.runs, other))
        if isinstance(other, (tuple, list)):
            return len(other) == self._len and all(
                type(a) is int or isinstance(a, np.integer) for a in other) and \
                tuple(self) == tuple(int(a) for a in other)
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash(("HeadRuns", self.runs))

    def __repr__(self) -> str:
        if self._len <= 16:
            return repr(tuple(self))
        return "HeadRuns(" + ", ".join(
            f"{f}" if n == 1 else f"{f}..{f + n - 1}" for f, n in self.runs[:8]) + \
            (", ..." if len(self.runs) > 8 else "") + f"; {self._len} heads)"

    def __reduce__(self):
        return (HeadRuns, (self.runs,))


def covered(runs, by) -> bool:
    """Every head of ``runs`` lies in some run of ``by`` (both ``(first, count)``)."""
    spans = merged(by)
    starts = [a for a, _ in spans]
    for first, count in runs:
        k = bisect_right(starts, first) - 1
        if k < 0 or first + count > spans[k][0] + spans[k][1]:
            return False
    return True


def merged(runs) -> list[tuple[int, int]]:
    """The union of ``(first, count)`` runs as sorted, disjoint, maximal runs."""
    out: list[tuple[int, int]] = []
    for a, n in sorted(runs):
        if out and a <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], a + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((a, n))
    return out
