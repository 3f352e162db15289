"""One block of a layout as a byte map: which component (or padding) owns each byte, drawn
as text (with ANSI colour on a terminal) or SVG (``kvabi layout show``, ``kvabi probe
--draw``).  Pure: it reads the descriptor, never a cache.

A *map* covers the bytes of one (layer, block) of each plane it touches: its regions
(``Layout.block_regions``) extended over the padding that follows them, up to the next
element of any component.  Two maps of the same range compare byte by byte: where an
engine's bytes landed against where a declared layout puts them.
"""
from __future__ import annotations

import html
import math

import attrs
import numpy as np

from ..util.errors import KVABIError
from .component import NAMES
from .regions import block_cells

#: one letter per component in text maps; ``.`` is padding
LETTERS = {"key": "K", "value": "V", "latent": "L", "rope": "R", "key_scale": "k",
           "value_scale": "v", "latent_scale": "l", "rope_scale": "r"}
PAD = "."
#: SVG fill per component (and padding), ANSI colour per letter
COLOURS = {"key": "#4e79a7", "value": "#f28e2b", "latent": "#59a14f", "rope": "#b07aa1",
           "key_scale": "#9ecae9", "value_scale": "#ffbe7d", "latent_scale": "#8cd17d",
           "rope_scale": "#d4a6c8", None: "#e8e8e8"}
ANSI = {"key": "34", "value": "33", "latent": "32", "rope": "35", "key_scale": "94",
        "value_scale": "93", "latent_scale": "92", "rope_scale": "95", None: "90"}
#: bytes per text row, and the most rows a text map prints (bytes per character grow)
COLUMNS, MAX_ROWS = 64, 32


@attrs.frozen(eq=False)
class PlaneMap:
    """Bytes ``[start, start + len(owner))`` of ``plane``: ``owner[i]`` is the index of the
    owning component's name in :data:`kvabi.layout.component.NAMES`, or -1 for padding."""

    plane: int
    start: int
    owner: np.ndarray
    #: the element of its component each byte holds: (token * heads + head) * count + index
    element: np.ndarray


@attrs.frozen(eq=False)
class BlockMap:
    """The byte map of one (layer, block) of a layout."""

    title: str
    names: tuple
    planes: tuple  # of PlaneMap
    detail: dict  # component name -> "int8 x 128"
    heads: int
    counts: dict  # component name -> elements per index

    def describe(self, pm: "PlaneMap", i: int) -> str:
        """What byte ``i`` of ``pm`` holds, in words."""
        o = int(pm.owner[i])
        if o < 0:
            return "padding"
        name = NAMES[o]
        n, rest = divmod(int(pm.element[i]), self.heads * self.counts[name])
        h, e = divmod(rest, self.counts[name])
        return f"{name} token {n}, head {h}, element {e}"

    def owner_at(self, plane: int, offset: int):
        for pm in self.planes:
            if pm.plane == plane and pm.start <= offset < pm.start + pm.owner.size:
                o = int(pm.owner[offset - pm.start])
                return None if o < 0 else NAMES[o]
        raise KVABIError(f"offset: byte {offset} of plane {plane} is not in this map")


def block_map(layout, *, layer: int = 0, block: int = 0, cells=None) -> BlockMap:
    """The byte map of ``block`` of ``layer`` (``cells``: the byte ranges to cover, default
    the block's own)."""
    names = tuple(n for n in NAMES if n in layout.component_names)
    cells = block_cells(layout, [(layer, block)]) if cells is None else cells
    maps = [PlaneMap(p, lo, np.full(hi - lo, -1, np.int16), np.full(hi - lo, -1, np.int64))
            for p, lo, hi in cells]
    for name in names:
        i = NAMES.index(name)
        c = layout.component(name)
        sizes = {a: (layout.size(a) if c.varies(a) else 1) for a in ("N", "H")}
        n, h, e = np.meshgrid(np.arange(sizes["N"]), np.arange(sizes["H"]),
                              np.arange(0, c.count, c.count // c.units), indexing="ij")
        p, o = layout.element_offset(name, layer=layer, block=block, token=n.ravel(),
                                     head=h.ravel(), index=e.ravel())
        p = np.broadcast_to(p, np.shape(o))
        eid = (n.ravel() * layout.size("H") + h.ravel()) * c.count + e.ravel()
        for pm in maps:
            sel = p == pm.plane
            at = (o[sel][:, None] + np.arange(c.unit)).ravel() - pm.start
            ids = np.repeat(eid[sel], c.unit)
            keep = (at >= 0) & (at < pm.owner.size)
            pm.owner[at[keep]] = i
            pm.element[at[keep]] = ids[keep]
    detail = {n: f"{layout.component(n).dtype} x {layout.component(n).count}" for n in names}
    title = f"{layout.name or 'custom layout'}: layer {layer}, block {block}"
    return BlockMap(title, names, tuple(maps), detail, layout.size("H"),
                    {n: layout.component(n).count for n in names})


def runs(pm: PlaneMap) -> list[tuple[int, int, str | None]]:
    """(first byte, last byte, owner) of each run of one owner, in plane offsets."""
    o = pm.owner
    if not o.size:
        return []
    cut = np.flatnonzero(np.diff(o)) + 1
    starts = np.r_[0, cut]
    ends = np.r_[cut, o.size] - 1
    return [(pm.start + int(a), pm.start + int(b), None if o[a] < 0 else NAMES[o[a]])
            for a, b in zip(starts, ends)]


def _cell_owner(chunk: np.ndarray):
    """The owner one character stands for: its bytes' owner when they agree, else the
    most frequent (ties: the first)."""
    vals, counts = np.unique(chunk, return_counts=True)
    return int(vals[np.argmax(counts)]), len(vals) > 1


def text(bm: BlockMap, *, colour: bool = False, against: BlockMap | None = None) -> str:
    """The map as text rows of :data:`COLUMNS` characters, the byte offset of each row on
    the left, a legend and the runs; ``against``: a second map of the same bytes, drawn
    under each row, with ``^`` under every character whose bytes differ."""
    lines = [bm.title + ("" if against is None else f"  vs  {against.title}")]
    for k, pm in enumerate(bm.planes):
        size = pm.owner.size
        per = max(1, math.ceil(size / (COLUMNS * MAX_ROWS)))
        lines.append(f"plane {pm.plane}, bytes {pm.start}..{pm.start + size - 1} ({size} "
                     f"bytes), one character = {per} byte{'s' if per > 1 else ''}")
        other = against.planes[k].owner if against is not None else None
        for r0 in range(0, size, COLUMNS * per):
            row, under, diff = [], [], []
            for c0 in range(r0, min(size, r0 + COLUMNS * per), per):
                o, _ = _cell_owner(pm.owner[c0:c0 + per])
                row.append(_char(o, colour))
                if other is not None:
                    o2, _ = _cell_owner(other[c0:c0 + per])
                    under.append(_char(o2, colour))
                    bad = bool(np.any(_differs(pm, against.planes[k], c0, c0 + per)))
                    diff.append("^" if bad else " ")
            lines.append(f"{pm.start + r0:>10} |{''.join(row)}|")
            if other is not None:
                lines.append(f"{'landed':>10} |{''.join(under)}|")
                if "^" in diff:
                    lines.append(f"{'':>10}  {''.join(diff).rstrip()}")
    names = bm.names + tuple(n for n in (against.names if against else ()) if n not in bm.names)
    detail = {**(against.detail if against else {}), **bm.detail}
    legend = "  ".join(f"{_char(NAMES.index(n), colour)} {n} ({detail[n]})" for n in names)
    lines.append(f"legend: {legend}  {_char(-1, colour)} padding")
    for pm in bm.planes:
        shown = runs(pm)
        more = len(shown) - 12
        lines.append(f"runs of plane {pm.plane}: " + ", ".join(
            f"{a}-{b} {n or 'padding'}" for a, b, n in shown[:12]) +
            (f", ... ({more} more)" if more > 0 else ""))
    if against is not None:
        lines.append(differences(bm, against))
    return "\n".join(lines)


def _char(o: int, colour: bool) -> str:
    name = None if o < 0 else NAMES[o]
    ch = PAD if name is None else LETTERS[name]
    return f"\x1b[{ANSI[name]}m{ch}\x1b[0m" if colour else ch


def differences(declared: BlockMap, landed: BlockMap) -> str:
    """One line: the first byte whose owner differs, or that every byte agrees."""
    for a, b in zip(declared.planes, landed.planes):
        bad = np.flatnonzero(_differs(a, b, 0, a.owner.size))
        if bad.size:
            i = int(bad[0])
            return (f"mismatch: {bad.size} bytes differ; first at plane {a.plane}, byte "
                    f"{a.start + i}: declared {declared.describe(a, i)}, landed "
                    f"{landed.describe(b, i)}")
    return "every byte where the declared layout puts it"


def _differs(a: PlaneMap, b: PlaneMap, lo: int, hi: int) -> np.ndarray:
    """Per byte of ``[lo, hi)``: another component or another element of it."""
    return (a.owner[lo:hi] != b.owner[lo:hi]) | (a.element[lo:hi] != b.element[lo:hi])


def svg(bm: BlockMap, *, against: BlockMap | None = None) -> str:
    """The map as an SVG document: one rectangle per run of one owner per row (title:
    its byte range), the byte offset of each row on the left axis and of each 16th
    column on the top axis, a legend; ``against``: its rows under each row, and every
    byte that differs outlined in red."""
    cell, left, top = 10, 90, 40
    out, y = [], top
    for k, pm in enumerate(bm.planes):
        size = pm.owner.size
        per = max(1, math.ceil(size / (COLUMNS * 4 * MAX_ROWS)))
        cols = COLUMNS
        out.append(f'<text x="4" y="{y - 6}" class="h">plane {pm.plane}, bytes {pm.start}'
                   f'..{pm.start + size - 1}, one cell = {per} byte(s)</text>')
        for c in range(0, cols, 16):
            out.append(f'<text x="{left + c * cell}" y="{y + 8}" class="a">+{c * per}</text>')
        y += 12
        other = against.planes[k].owner if against is not None else None
        for r0 in range(0, size, cols * per):
            out.append(f'<text x="{left - 4}" y="{y + cell - 2}" class="o" '
                       f'text-anchor="end">{pm.start + r0}</text>')
            for owner, yy in ((pm.owner, y),) + (((other, y + cell),)
                                                  if other is not None else ()):
                x = 0
                while x < cols and r0 + x * per < size:
                    o, _ = _cell_owner(owner[r0 + x * per:r0 + (x + 1) * per])
                    w = 1
                    while x + w < cols and r0 + (x + w) * per < size and _cell_owner(
                            owner[r0 + (x + w) * per:r0 + (x + w + 1) * per])[0] == o:
                        w += 1
                    name = None if o < 0 else NAMES[o]
                    a = pm.start + r0 + x * per
                    b = min(pm.start + size, a + w * per) - 1
                    out.append(f'<rect x="{left + x * cell}" y="{yy}" width="{w * cell}" '
                               f'height="{cell}" fill="{COLOURS[name]}" stroke="#fff" '
                               f'stroke-width="0.5"><title>{html.escape(name or "padding")}'
                               f' bytes {a}-{b}</title></rect>')
                    x += w
            if other is not None:
                for x in range(cols):
                    lo, hi = r0 + x * per, r0 + (x + 1) * per
                    if lo < size and np.any(_differs(pm, against.planes[k], lo, hi)):
                        out.append(f'<rect x="{left + x * cell}" y="{y}" width="{cell}" '
                                   f'height="{2 * cell}" fill="none" stroke="#d62728" '
                                   f'stroke-width="1.5" class="diff"/>')
                y += cell
            y += cell + 1
        y += 24
    lx = 4
    names = bm.names + tuple(n for n in (against.names if against else ()) if n not in bm.names)
    detail = {**(against.detail if against else {}), **bm.detail}
    for name in names + (None,):
        label = f"{name} ({detail[name]})" if name else "padding"
        out.append(f'<rect x="{lx}" y="{y}" width="{cell}" height="{cell}" '
                   f'fill="{COLOURS[name]}"/><text x="{lx + cell + 4}" y="{y + cell - 1}" '
                   f'class="l">{html.escape(label)}</text>')
        lx += 14 + 7 * len(label)
    y += 2 * cell
    if against is not None:
        out.append(f'<text x="4" y="{y}" class="h">{html.escape(differences(bm, against))}'
                   f'</text>')
        y += cell
    title = bm.title + ("" if against is None else f" (upper rows) vs {against.title} "
                        "(lower rows)")
    width = max(left + COLUMNS * cell + 20, lx + 10)
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}" '
            f'font-family="monospace" font-size="10"><style>.h{{font-weight:bold}} '
            f'.a,.o{{fill:#555}}</style><title>{html.escape(title)}</title>'
            f'<text x="4" y="14" class="h">{html.escape(title)}</text>')
    return head + "".join(out) + "</svg>\n"
