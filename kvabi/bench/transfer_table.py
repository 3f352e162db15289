"""The one table ``kvabi bench transfer`` prints (and returns under ``"table"`` in
``--json``): a row per move timed, each timed alternately with its references in the same
run, so that the ratios hold while the machine's load changes.

A row: ``pair`` (what moved: a local copy, an offload or onload through a host pool, a NIXL
pull between two processes), ``src`` and ``dst`` layouts, ``tp`` (source -> destination
tensor-parallel sizes), ``blocks`` (one run of blocks or scattered), ``bytes``, ``regions``
(of the plan; where it has many millions, counted before merging: an upper bound),
``descriptors`` (NIXL descriptors posted per pull; None for local moves), ``s`` (best
seconds), ``ref`` and ``ref_s`` (the reference it is compared with: the same
bytes pulled between equal layouts, equal TP sizes, or as one region; None where the row is
its own reference) and ``memcpy_s`` (one ``memcpy`` of the same bytes).
"""
from __future__ import annotations

import time

import numpy as np

#: the columns of a row, in print order
COLUMNS = ("pair", "src", "dst", "tp", "blocks", "bytes", "regions", "descriptors", "s",
           "ref", "ref_s", "memcpy_s")


def alternate(fns, repeat: int) -> list[float]:
    """Best seconds of each of ``fns``, called in turn ``repeat`` times (after one warm-up
    call of each), so that all see the same machine load."""
    for f in fns:
        f()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def side_by_side(op, ref, repeat: int) -> tuple[float, float]:
    """Best seconds of ``op`` and of ``ref``, timed alternately (:func:`alternate`)."""
    a, b = alternate([op, ref], repeat)
    return a, b


class Memcpy:
    """One ``memcpy`` of a given number of bytes (buffers kept per size)."""

    def __init__(self):
        self._bufs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, nbytes: int):
        """A function copying ``nbytes`` bytes between two buffers made once."""
        if nbytes not in self._bufs:
            self._bufs[nbytes] = (np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8))
        a, b = self._bufs[nbytes]
        return lambda: np.copyto(b, a)


def row(pair, src, dst, tp, blocks, nbytes, regions, descriptors, s, ref, ref_s,
        memcpy_s) -> dict:
    """A table row (see the module docstring); ints and floats as JSON takes them."""
    return dict(pair=pair, src=src, dst=dst, tp=tp, blocks=blocks, bytes=int(nbytes),
                regions=int(regions), descriptors=None if descriptors is None
                else int(descriptors), s=float(s), ref=ref,
                ref_s=None if ref_s is None else float(ref_s), memcpy_s=float(memcpy_s))


def format_table(rows) -> str:
    """The rows as text: MiB, ms, GB/s and both ratios (``x ref``: the reference's time over
    the row's, above 1 when the row is faster; ``x memcpy`` likewise)."""
    head = ("pair", "src -> dst", "TP", "blocks", "MiB", "regions", "descr", "ms", "GB/s",
            "reference", "x ref", "x memcpy")
    lines = []
    for r in rows:
        lines.append((r["pair"], f"{r['src']} -> {r['dst']}", r["tp"], r["blocks"],
                      f"{r['bytes'] / 2**20:.0f}", str(r["regions"]),
                      "-" if r["descriptors"] is None else str(r["descriptors"]),
                      f"{r['s'] * 1e3:.1f}", f"{r['bytes'] / r['s'] / 1e9:.2f}",
                      r["ref"] or "-",
                      "-" if r["ref_s"] is None else f"{r['ref_s'] / r['s']:.2f}",
                      f"{r['memcpy_s'] / r['s']:.2f}"))
    width = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h)
             for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, width)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, width)).rstrip() for x in lines]
    return "\n".join(out)


def find(rows, pair: str, src: str, blocks: str = "contiguous", dst: str | None = None,
         tp: str | None = None):
    """The first row of ``pair`` from ``src`` (and ``dst``, ``tp`` if given), or None."""
    for r in rows:
        if r["pair"] == pair and r["src"] == src and r["blocks"] == blocks and \
                (dst is None or r["dst"] == dst) and (tp is None or r["tp"] == tp):
            return r
    return None
