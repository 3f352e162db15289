"""``verify_layout``: a few marked writes prove (or refute) that an engine's ``write`` puts
every element where a layout says.

Only the bytes of the sampled (layer, block) cells are touched: they are saved, poisoned,
written through the engine, read back and restored, so the cost is bounded by the sample,
never by the cache, and the cache's other contents are left alone.
"""
from __future__ import annotations

import numpy as np

from ..layout.descriptor import Layout, check_layout
from ..util.coerce import as_int
from ..util.errors import KVABIError
from .markers import Alphabet
from .marking import Geometry, Marked, gather, read_ids, scan
from .memory import plane_bytes

#: most tokens one verification writes (its cost and memory are bounded by the sample)
MAX_SAMPLES = 1 << 16


def sample_rows(geo: Geometry, samples: int, seed: int, avoid=()) -> Marked:
    """``samples`` distinct (layer, slot) rows: the first and the last slot of the cache,
    then seeded random ones (``avoid``: (layer, slot) pairs not to pick when possible)."""
    slots = geo.num_blocks * geo.block_size
    total = geo.num_layers * slots
    rng = np.random.default_rng(seed)
    want = min(samples, total)
    picked = [0, total - 1][:want]
    seen, avoid = set(picked), set(int(l) * slots + int(s) for l, s in avoid)
    tries = 0
    while len(picked) < want:
        x = int(rng.integers(total))
        tries += 1
        if x in seen or (x in avoid and tries < 8 * want):
            continue
        seen.add(x)
        picked.append(x)
    picked = np.array(sorted(picked), np.int64)
    layer, slot = np.divmod(picked, slots)
    block, token = np.divmod(slot, geo.block_size)
    return Marked(geo, layer, block, token)


def _cells(layout: Layout, rows: Marked):
    """[(plane, lo, hi)] covering each sampled (layer, block) cell with the padding that
    follows it, merged per plane."""
    from ..layout.regions import block_cells

    return block_cells(layout, zip(rows.layer.tolist(), rows.block.tolist()))


def _where(plane: int, off: int) -> str:
    return f"plane {plane}, byte {off}"


def check_marked(layout: Layout, mem, write, rows: Marked, what: str) -> None:
    """Write ``rows`` with markers into poisoned cells and check every element against
    ``layout``: the first misplaced element, or bytes written where ``layout`` has padding,
    raise KVABIError.  The cells' previous bytes are restored in every case."""
    isz = layout.itemsize
    alphabet = Alphabet.of(layout.dtype)
    cells = _cells(layout, rows)
    saved = [mem[p].read(lo, hi) for p, lo, hi in cells]
    try:
        for p, lo, hi in cells:
            mem[p].fill(lo, hi)
        n = rows.count
        c = rows.coords(np.arange(n))
        want_p, want_o = layout.byte_offset(**c)
        want_p = np.broadcast_to(want_p, want_o.shape).astype(np.int64)
        rounds = alphabet.rounds(n)
        found_p = found_o = None
        got, seen = [], []
        for r in range(rounds):
            rows.write_round(write, alphabet, r)
            if found_p is None:
                found_p, found_o = scan(mem, isz, cells, n)
            got.append(gather(mem, want_p, want_o, isz))
            seen.append(gather(mem, found_p, found_o, isz))
        at_want = read_ids(alphabet, got)
        at_found = read_ids(alphabet, seen)
        _report(layout, rows, what, want_p, want_o, at_want, found_p, found_o, at_found)
    finally:
        for (p, lo, _), data in zip(cells, saved):
            mem[p].write(lo, data)


def _report(layout, rows, label, want_p, want_o, at_want, found_p, found_o, at_found):
    """KVABIError for the first misplaced element, else for the first padding written."""
    ids = np.arange(len(want_o))
    wrong = np.flatnonzero(at_want != ids)
    if len(wrong):
        i = int(wrong[0])
        hit = np.flatnonzero(at_found == i)
        where = _where(int(want_p[i]), int(want_o[i]))
        if len(hit):
            p, o = int(found_p[hit[0]]), int(found_o[hit[0]])
            if p == want_p[i]:
                raise KVABIError(f"{rows.name(i)} found {o - int(want_o[i])} bytes from where "
                                 f"{label} puts it ({where})")
            raise KVABIError(f"{rows.name(i)} found in plane {p} at byte {o}, not where "
                             f"{label} puts it ({where})")
        held = at_want[i]
        now = "no marker (never written there, or the value was converted)" if held < 0 \
            else f"the {rows.name(held)}"
        raise KVABIError(f"{rows.name(i)} is not where {label} puts it ({where}: it holds "
                         f"{now}), nor anywhere else in the sampled blocks' bytes")
    # Every element is in place (so each wanted place was found); anything more found was
    # written where the layout pads.
    if len(found_o) == len(want_o):
        return
    span = layout.plane_nbytes
    extra = np.flatnonzero(~np.isin(found_p * span + found_o, want_p * span + want_o))
    if len(extra):
        k = int(extra[0])
        held = at_found[k]
        now = "a value kvabi never wrote" if held < 0 else f"a copy of the {rows.name(held)}"
        raise KVABIError(f"{_where(int(found_p[k]), int(found_o[k]))} was written ({now}), "
                         f"but {label} has padding there: the write touches bytes the "
                         f"layout leaves unused")


def probe_arguments(planes, write, samples, seed):
    """(samples, seed, plane bytes) of a probe's call, each checked by name."""
    samples = as_int(samples, "samples", lo=1, hi=MAX_SAMPLES)
    if not callable(write):
        raise KVABIError(f"write: must be callable (the engine's cache write), got "
                         f"{type(write).__name__}")
    return samples, as_int(seed, "seed", lo=0), plane_bytes(planes)


def verify_layout(layout: Layout, planes, write, *, samples: int = 8, seed: int = 0) -> None:
    """Check that the engine's ``write`` puts every element where ``layout`` says.

    ``planes``: the engine's own tensors (numpy arrays or torch tensors of any shape and
    dtype: only their bytes are read), one per plane of ``layout``.  ``write(layer,
    slot_mapping, key, value)``: the engine's cache write (numpy key/value [tokens,
    kv_heads, head_dim], value None for MLA; int64 slots).  ``samples`` tokens (the first
    and last slot of the cache and seeded random ones) are written with a marker per
    element, in as few writes as the dtype allows (one per layer touched; 8-bit dtypes
    may need two rounds).  Their blocks' bytes are saved first and restored after.

    Raises KVABIError naming the first element not where ``layout`` puts it (e.g. ``value
    of layer 0, block 3, token 3, head 1, dim 0 found 8192 bytes from where vllm.LBHNC puts
    it``), or bytes written where the layout has padding.
    """
    check_layout(layout)
    samples, seed, mem = probe_arguments(planes, write, samples, seed)
    _check_sizes(layout, mem)
    rows = sample_rows(Geometry.of_layout(layout), samples, seed)
    check_marked(layout, mem, write, rows, layout.name or "the layout")


def _check_sizes(layout: Layout, mem) -> None:
    if len(mem) != layout.num_planes:
        raise KVABIError(f"planes: {layout.name or 'the layout'} has {layout.num_planes} "
                         f"planes, got {len(mem)} tensors")
    label = layout.name or "the layout"
    for i, m in enumerate(mem):
        if m.nbytes < layout._span():
            raise KVABIError(f"planes[{i}]: spans {m.nbytes} bytes, but {label} addresses "
                             f"{layout._span()}")
