"""Writing marked tokens through an engine's own ``write`` and reading back where they went.

A probe writes whole tokens: *rows* ``(layer, block, token)``, each carrying every head,
every dim, key and value.  Element ids are row-major over ``(row, kv, head, dim)``, so an
id names its logical coordinates without a table.  Rows of one layer go in one ``write``
call; with ``R`` digits (see :mod:`.markers`) every row is written ``R`` times.
"""
from __future__ import annotations

import attrs
import numpy as np

from ..util.coerce import as_int
from ..util.errors import KVABIError
from .markers import Alphabet
from .memory import PlaneBytes, _TooMany


@attrs.frozen
class Geometry:
    """Sizes of the logical axes: what any layout of this cache must hold."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    kvs: int  # 2 (key, value) or 1 (MLA: the key is the latent)
    dtype: str

    @classmethod
    def of_spec(cls, spec, num_blocks, num_layers) -> "Geometry":
        from ..model.spec import KVSpec

        if not isinstance(spec, KVSpec):
            raise KVABIError(f"spec: must be a KVSpec, got {type(spec).__name__}")
        if not spec.is_mla and spec.head_dim_v != spec.head_dim:
            raise KVABIError(f"spec.head_dim_v: a layout has one D axis; head_dim_v "
                             f"{spec.head_dim_v} != head_dim {spec.head_dim}")
        return cls(as_int(num_layers, "num_layers", lo=1), as_int(num_blocks, "num_blocks",
                                                                    lo=1),
                   spec.block_size, spec.num_kv_heads, spec.head_dim,
                   1 if spec.is_mla else 2, spec.dtype)

    @classmethod
    def of_layout(cls, layout) -> "Geometry":
        return cls(layout.num_layers, layout.num_blocks, layout.size("N"), layout.size("H"),
                   layout.size("D"), 2 if layout.has_kv else 1, layout.dtype)

    @property
    def per_row(self) -> int:
        return self.kvs * self.num_heads * self.head_dim


@attrs.frozen
class Marked:
    """Rows written with markers: ``layer``, ``block``, ``token`` arrays (one entry a row)."""

    geo: Geometry
    layer: np.ndarray
    block: np.ndarray
    token: np.ndarray

    @property
    def count(self) -> int:
        """Elements written."""
        return len(self.layer) * self.geo.per_row

    def coords(self, ids) -> dict[str, np.ndarray]:
        """Logical coordinates of element ids: layer, block, kv, token, head, dim."""
        g = self.geo
        ids = np.asarray(ids, np.int64)
        row, rest = np.divmod(ids, g.per_row)
        kv, rest = np.divmod(rest, g.num_heads * g.head_dim)
        head, dim = np.divmod(rest, g.head_dim)
        return {"layer": self.layer[row], "block": self.block[row], "kv": kv,
                "token": self.token[row], "head": head, "dim": dim}

    def name(self, i: int) -> str:
        """``key of layer 0, block 5, token 3, head 1, dim 0`` for element id ``i``."""
        c = {k: int(v[0]) if np.ndim(v) else int(v) for k, v in self.coords([i]).items()}
        what = "latent" if self.geo.kvs == 1 else ("key", "value")[c["kv"]]
        return (f"{what} of layer {c['layer']}, block {c['block']}, token {c['token']}, "
                f"head {c['head']}, dim {c['dim']}")

    def write_round(self, write, alphabet: Alphabet, r: int) -> None:
        """Call ``write(layer, slot_mapping, key, value)`` once per layer with digit ``r``
        of every element's id (value None for MLA)."""
        g = self.geo
        shape = (g.num_heads, g.head_dim)
        for layer in np.unique(self.layer):
            rows = np.flatnonzero(self.layer == layer)
            ids = (rows[:, None] * g.per_row + np.arange(g.per_row)).reshape(
                len(rows), g.kvs, *shape)
            vals = alphabet.values(alphabet.digit(ids, r))
            slots = self.block[rows] * g.block_size + self.token[rows]
            key = np.ascontiguousarray(vals[:, 0])
            value = np.ascontiguousarray(vals[:, 1]) if g.kvs == 2 else None
            write(int(layer), slots.astype(np.int64), key, value)


def read_ids(alphabet: Alphabet, round_words: list[np.ndarray]) -> np.ndarray:
    """Combine the digits read at the same places in each round into ids; -1 where a
    round found a value no marker uses (or poison)."""
    n = len(round_words[0])
    ids = np.zeros(n, np.int64)
    bad = np.zeros(n, bool)
    for r, words in enumerate(round_words):
        d = alphabet.decode(words)
        bad |= d < 0
        ids += np.maximum(d, 0) * alphabet.size ** r
    ids[bad] = -1
    return ids


def gather(mem: list[PlaneBytes], plane: np.ndarray, off: np.ndarray,
           itemsize: int) -> np.ndarray:
    """Elements at (plane, off) as unsigned words, in the order given."""
    out = np.zeros(len(off), np.dtype(f"u{itemsize}"))
    for p in np.unique(plane):
        sel = np.flatnonzero(plane == p)
        out[sel] = mem[int(p)].words(off[sel], itemsize)
    return out


def scan(mem: list[PlaneBytes], itemsize: int, ranges, written: int):
    """(plane, offset) of every written element in ``ranges`` ([(plane, lo, hi)]); far
    more than the ``written`` elements found raises KVABIError (the write touched memory
    it was not given), which also bounds the memory of the result."""
    limit = 2 * written + 4096
    planes, offs, total = [], [], 0
    for p, lo, hi in ranges:
        try:
            hits = mem[p].written(itemsize, lo, hi, limit=limit - total)
        except _TooMany as e:
            raise KVABIError(f"write: more than {limit} elements changed for {written} "
                             f"elements written (at least {total + e.count}): the write "
                             f"touches memory outside the slots it was given") from None
        total += len(hits)
        planes.append(np.full(len(hits), p, np.int64))
        offs.append(hits)
    return (np.concatenate(planes) if planes else np.zeros(0, np.int64),
            np.concatenate(offs) if offs else np.zeros(0, np.int64))
