"""Run a :class:`~kvabi.transfer.TransferPlan` between two caches in this process.

Each plane is seen as a flat byte array.  A plan of whole blocks
(:func:`~kvabi.transfer.plan_block_transfer`) carries its structure, the same regions per
sub-block (:mod:`kvabi.transfer.pattern`): it is copied as strided views, one copy per run of
sub-blocks and plane pair (:mod:`kvabi.transfer.pattern_copy`).  Other plans go by their
regions: regions of at least :data:`LARGE` bytes are copied
one slice each (each long enough that the call costs little next to the copy); all smaller
regions of a plane pair are moved without a Python loop per region: where their offsets
step by constant strides (a relayout of whole blocks) they are folded into a few strided
boxes, each copied in one pass; otherwise they go through one vectorized gather/scatter,
cut into rows of the largest size dividing every offset and length and moved with one
fancy-indexing copy per batch of :data:`BATCH` bytes.

numpy arrays and torch tensors (CPU or CUDA) are written in place; jax arrays are immutable,
so a jax destination comes back as a new handle.  torch planes in host memory are copied by
numpy over the same bytes (``Tensor.numpy()`` views share memory), so they take the same
strided copies as numpy planes; CUDA planes use torch copies on the device.

Before any byte moves, what can change under a checked handle is checked again
(:func:`check_in_use`) and the plan's regions are checked against the planes; a plan itself
is immutable (``specs/security.md``).
"""
from __future__ import annotations

import numpy as np

from ..memory.cache import KVCache
from ..util.errors import KVABIError
from ..util.tensors import framework
from .pattern import plane_sizes
from .pattern_copy import copy_pattern
from .plan import TransferPlan

#: regions at least this long are copied as one slice each: a slice costs about a
#: microsecond of Python, a 64 KiB copy several at memory bandwidth, and a slice moves
#: the bytes once where a gather/scatter moves them twice (measured 2x faster for a
#: per-layer layout's 64 KiB blocks)
LARGE = 64 << 10
#: boxes (see :func:`fold`) at least this large are copied one strided copy each
BOX_LOOP = 16 << 10
#: bytes moved per gather/scatter batch (bounds the temporary)
BATCH = 8 << 20


def _handle(x, layout, side) -> KVCache:
    try:
        return KVCache.wrap(layout, x)
    except KVABIError as e:
        raise KVABIError(f"{side}: {e}") from None


def byte_view(plane, layout, i: int | None = None):
    """A flat uint8 view (no copy) of the bytes a numpy or torch plane addresses (plane
    ``i``'s size, or ``layout.plane_nbytes``), from its first element, whatever the
    plane's own dtype (a component layout's planes may be bytes)."""
    nbytes = layout.plane_nbytes if i is None else layout.plane_size(i)
    if isinstance(plane, np.ndarray):
        isz = plane.dtype.itemsize
        raw = plane.view(np.dtype(f"u{isz}"))
        flat = np.lib.stride_tricks.as_strided(raw, (-(-nbytes // isz),), (isz,))
        return flat.view(np.uint8)[:nbytes]
    isz = plane.element_size()
    return plane.as_strided((-(-nbytes // isz),), (1,), plane.storage_offset()).view(
        _torch().uint8)[:nbytes]


def _torch():
    import torch

    return torch


def execute(plan: TransferPlan, src, dst):
    """Copy the plan's regions from ``src`` to ``dst`` (KVCache handles or lists of planes
    of the plan's source and destination layouts).

    Both sides are checked against the layouts (plane count, shape, dtype, strides, memory
    reach, memory: no meta tensors), and again at this call where memory can change under
    a handle: a read-only destination, a plane changed since the handle was made (``KVCache.check_unchanged``: e.g. ``Tensor.set_``), source and
    destination memory that overlap (``execute(plan, c, c)``): each a KVABIError naming
    the plane.  The
    regions are checked against the planes at every call before any byte moves.  Returns
    ``dst`` (the same object for numpy/torch, written in place; a new KVCache for jax).
    """
    if not isinstance(plan, TransferPlan):
        raise KVABIError(f"plan: must be a TransferPlan, got {type(plan).__name__}")
    s = _handle(src, plan.src_layout, "src")
    d = _handle(dst, plan.dst_layout, "dst")
    check_in_use(s, d, plan.regions)
    plan.check()  # the planes hold plane_nbytes each: checked by wrap and check_in_use
    if not len(plan):
        return dst
    if plan.pattern is not None:  # whole blocks: strided views, no per-region work
        return _run(plan.pattern, None, s, d, dst)
    return _run(None, plan.regions, s, d, dst)


def execute_pattern(pattern, src_layout, dst_layout, src, dst):
    """:func:`execute` of a whole-block move given as a
    :class:`~kvabi.transfer.pattern.BlockPattern` (no regions built: the host pool's path).
    The same checks: both sides against the layouts and at use, and the pattern's bounds
    proven from its template and bases before any byte moves."""
    s = _handle(src, src_layout, "src")
    d = _handle(dst, dst_layout, "dst")
    check_in_use(s, d)
    pattern.check(plane_sizes(src_layout), plane_sizes(dst_layout))
    return _run(pattern, None, s, d, dst)


def check_in_use(s: KVCache | None, d: KVCache | None, regions=None) -> None:
    """What can change under a checked handle, checked again at use: the memory of every
    torch plane (storage replaced by ``set_``), a writable destination, and
    source memory disjoint from destination memory.  Where planes of both sides share
    memory (a copy between blocks of one cache) and the plan's ``regions`` are given, only
    bytes read that are also written are refused: disjoint regions copy correctly in any
    order."""
    for c, side in ((s, "src"), (d, "dst")):
        if c is not None:
            check_memory(c, side, write=side == "dst")
    if s is None or d is None or "jax" in (s.framework, d.framework):
        return  # a jax destination is written through a copy; a jax source is read-only
    a, b = _spans(s), _spans(d)
    hit = ((a[:, None, 0] == b[None, :, 0]) & (a[:, None, 1] < b[None, :, 2])
           & (b[None, :, 1] < a[:, None, 2]))
    if not hit.any():
        return
    if regions is not None:
        k = _read_and_written(regions, a, b)
        if k is None:
            return
        raise KVABIError(f"regions[{k}]: its destination bytes are also read by the plan "
                         "(source and destination share memory); execute copies between "
                         "disjoint bytes (copy through a third cache, e.g. a HostPool)")
    i, j = (int(x) for x in np.argwhere(hit)[0])
    raise KVABIError(f"dst[{j}]: shares memory with src[{i}]; execute copies between "
                     "disjoint memory (copy through a third cache, e.g. a HostPool)")


def _read_and_written(regions: np.ndarray, a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of a region whose destination bytes overlap bytes some region reads, given the
    planes' spans ``a`` (source) and ``b`` (destination) from :func:`_spans`; None if none.
    Vectorized: source intervals sorted by start with a running maximum of their ends, each
    destination interval looked up by binary search."""
    r = regions
    src_dev, dst_dev = a[r[:, 0], 0], b[r[:, 2], 0]
    s0 = a[r[:, 0], 1] + r[:, 1]
    d0 = b[r[:, 2], 1] + r[:, 3]
    bad = np.zeros(len(r), bool)
    for dev in np.intersect1d(src_dev, dst_dev):  # a device at a time (a handful)
        ss, dd = np.flatnonzero(src_dev == dev), np.flatnonzero(dst_dev == dev)
        order = ss[np.argsort(s0[ss], kind="stable")]
        starts = s0[order]
        ends = np.maximum.accumulate(starts + r[order, 4])
        k = np.searchsorted(starts, d0[dd] + r[dd, 4], side="left")  # sources before d's end
        bad[dd] = (k > 0) & (ends[np.maximum(k - 1, 0)] > d0[dd])
    return int(np.argmax(bad)) if bad.any() else None


def check_memory(c: KVCache, side: str, *, write: bool) -> None:
    """KVABIError naming the plane unless every plane of ``c`` is memory kvabi may read
    (and write, with ``write``) over the layout's ``plane_nbytes``, now: each plane as
    ``KVCache.wrap`` checked it (:meth:`KVCache.check_unchanged`: a torch ``set_()`` or
    storage ``resize_()`` since is refused), writable.  Memory that is not memory (a torch
    plane on the meta device) is refused where it enters, by ``KVCache.wrap``; a plane
    cannot move there later without a new storage, which ``check_unchanged`` sees."""
    try:
        c.check_unchanged()
    except KVABIError as e:
        raise KVABIError(f"{side}: {e}") from None
    if write and c.framework == "numpy":  # the one flag a caller can turn off after wrap
        for i, p in enumerate(c):
            if not p.flags.writeable:
                raise KVABIError(f"{side}[{i}]: the numpy plane is read-only")


def _spans(c: KVCache) -> np.ndarray:
    """[planes, 3] of (device key, first byte address, end address) of each plane's reach."""
    n = np.asarray(c.layout.plane_sizes, np.int64)
    rows = []
    for p in c:
        if isinstance(p, np.ndarray):
            rows.append((-1, p.__array_interface__["data"][0]))
        else:
            dev = p.device
            rows.append((-1 if dev.type == "cpu" else hash(str(dev)) & 0xFFFF, p.data_ptr()))
    out = np.array(rows, np.int64).reshape(-1, 2)
    return np.concatenate([out, out[:, 1:] + n[:, None]], axis=1)


def copy_from_staging(planes, regions, pattern, layout, d: KVCache, dst):
    """The local half of a staged pull (:mod:`kvabi.transfer.staging`): copy checked
    ``regions`` (or a checked ``pattern`` of ``layout``) whose source planes are the flat
    byte buffers ``planes`` (numpy uint8, or torch uint8 tensors on the destination's
    device) into ``d``.  ``dst`` back, or a new handle for jax."""
    planes = [p.numpy() if framework(p) == "torch" and p.device.type == "cpu" else p
              for p in planes]
    return _run(pattern, regions, None, d, dst, sbytes=planes, src_layout=layout)


def _run(pattern, regions, s: KVCache | None, d: KVCache, dst, sbytes=None,
         src_layout=None):
    """Copy (a pattern's sub-blocks, or regions) from ``s`` (or the flat ``sbytes`` of
    ``src_layout``) to ``d``; ``dst`` back, or a new handle for jax."""
    src_layout = s.layout if s is not None else src_layout
    dst_layout = d.layout
    jax = d.framework == "jax"
    if jax:  # immutable: copy the planes written into writable buffers
        touched = np.unique((pattern.template if pattern is not None else regions)[:, 2])
        bufs = {int(i): np.array(d[int(i)]) for i in touched}
        dbytes = [bufs[i].reshape(-1).view(np.uint8) if i in bufs else None
                  for i in range(len(d))]
    else:
        dbytes = [byte_view(p, dst_layout, i) for i, p in enumerate(d)]
    # torch planes in host memory are copied by numpy over the same bytes (strided copies,
    # no index tensors): as fast as numpy planes
    torch_side = d.framework == "torch" and d[0].device.type != "cpu"
    if d.framework == "torch" and not torch_side:
        dbytes = [b.numpy() for b in dbytes]
    if sbytes is None:
        sbytes = [_source_bytes(p, src_layout, d[0] if torch_side else None, i)
                  for i, p in enumerate(s)]
    if pattern is not None:
        copy_pattern(pattern, src_layout, dst_layout, sbytes, dbytes, torch_side=torch_side)
    else:
        copy_regions(regions, sbytes, dbytes, torch_side=torch_side)
    if jax:
        import jax.numpy as jnp

        return d.replace_planes({i: jnp.asarray(b) for i, b in bufs.items()})
    return dst


def _source_bytes(plane, layout, device_plane, i=None):
    """Source bytes as a flat uint8 numpy array, or (``device_plane`` given: a torch
    tensor on a device) as a torch tensor on that device."""
    if isinstance(plane, np.ndarray):
        b = byte_view(plane, layout, i)
        if device_plane is not None:
            return _torch().from_numpy(b).to(device_plane.device)
        return b
    if framework(plane) == "torch":
        b = byte_view(plane, layout, i)
        if device_plane is not None:
            return b.to(device_plane.device)
        return b.numpy() if b.device.type == "cpu" else b.cpu().numpy()
    # jax: dense planes, read through numpy
    b = np.ascontiguousarray(np.asarray(plane)).reshape(-1).view(np.uint8)
    return _torch().from_numpy(b.copy()).to(device_plane.device) \
        if device_plane is not None else b


def copy_regions(regions, sbytes, dbytes, *, torch_side: bool):
    """Copy ``regions`` (checked) between flat byte planes (numpy arrays, or torch tensors
    on one device when ``torch_side``)."""
    r = regions
    # Group by (src plane, dst plane): one vectorized copy per pair.
    if r[0, 0] == r[-1, 0] and np.all(r[:, 0] == r[0, 0]) and np.all(r[:, 2] == r[0, 2]):
        bounds = np.array([0, len(r)])  # one plane pair (cross-layer layouts): no grouping
    else:
        pair = r[:, 0] * len(dbytes) + r[:, 2]
        if np.any(pair[1:] < pair[:-1]):  # plans come sorted by source plane: grouped
            r = r[np.argsort(pair, kind="stable")]
            pair = r[:, 0] * len(dbytes) + r[:, 2]
        bounds = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1], True])
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        g = r[a:b]
        sb, db = sbytes[int(g[0, 0])], dbytes[int(g[0, 2])]
        large = g[:, 4] >= LARGE
        small = g
        if large.any():
            for so, do, n in g[large][:, [1, 3, 4]].tolist():
                db[do:do + n] = sb[so:so + n]
            small = g[~large]
        if not len(small):
            continue
        so, do, n = small[:, 1], small[:, 3], small[:, 4]
        if not torch_side and _try_boxes(so, do, n, sb, db):
            continue
        _gather_scatter(so, do, n, sb, db, torch_side)


def _try_boxes(so, do, n, sb, db) -> bool:
    """Copy the regions as boxes if their offsets are regular; False when they are not.

    Merging leaves a few regions that are multiples of the others (two atoms adjacent in
    both layouts across a block boundary): those are cut back into atoms first, so that
    the sequence is regular again."""
    n0 = int(n.min())
    if np.any(n % n0):
        return False
    k = n // n0
    total = int(k.sum())
    if total > 2 * n.size:
        return False
    if total != n.size:
        within = (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)) * n0
        so, do = np.repeat(so, k) + within, np.repeat(do, k) + within
    starts_s, starts_d, shape, ss, ds = fold(so, do)
    if not shape:
        return False
    _copy_boxes(starts_s, starts_d, shape, ss, ds, n0, sb, db)
    return True


def fold(so, do):
    """Fold equal-length regions into boxes: strided arrays of regions whose source and
    destination offsets step by constant strides (a relayout of whole blocks is a few
    such boxes per plane).  Returns the boxes' start offsets and their common shape and
    source/destination byte strides (outermost first); an empty shape when the offsets
    have no such structure."""
    shape, ss, ds = [], [], []
    while so.size > 1:
        dso, ddo = np.diff(so), np.diff(do)
        brk = np.flatnonzero((dso != dso[0]) | (ddo != ddo[0]))
        c = int(brk[0]) + 1 if brk.size else so.size
        if c < 2 or so.size % c:
            break
        s2, d2 = so.reshape(-1, c), do.reshape(-1, c)
        if not (np.all(np.diff(s2, axis=1) == dso[0]) and np.all(np.diff(d2, axis=1) == ddo[0])):
            break  # not periodic: stop at the boxes found so far
        shape.insert(0, c)
        ss.insert(0, int(dso[0]))
        ds.insert(0, int(ddo[0]))
        so, do = s2[:, 0], d2[:, 0]
    return so, do, shape, ss, ds


def _copy_boxes(so, do, shape, ss, ds, n, sb, db):
    """numpy: copy boxes of ``shape`` x ``n`` bytes (strides ``ss``/``ds``) starting at
    ``so``/``do``: one strided copy per box where boxes are large (each byte moved once),
    a batched fancy-index copy of whole boxes where they are small."""
    g = int(np.gcd.reduce(np.concatenate([so, do]))) or 1
    si, di = so // g, do // g
    # Grids of every box start (every g bytes) whose elements are the n-byte regions (a
    # void item: numpy moves each with one memcpy).  The regions were bounds-checked, so
    # every byte a selected box addresses lies inside its plane.
    item = np.dtype((np.void, n))
    sv, dv = _items(sb, item), _items(db, item)
    sgrid = np.lib.stride_tricks.as_strided(sv, (int(si.max()) + 1,) + tuple(shape),
                                            (g,) + tuple(ss))
    dgrid = np.lib.stride_tricks.as_strided(dv, (int(di.max()) + 1,) + tuple(shape),
                                            (g,) + tuple(ds))
    nbytes = n * int(np.prod(shape))
    if nbytes >= BOX_LOOP:
        for a, b in zip(si.tolist(), di.tolist()):
            dgrid[b] = sgrid[a]
    else:
        step = max(1, BATCH // nbytes)
        for i in range(0, si.size, step):
            dgrid[di[i:i + step]] = sgrid[si[i:i + step]]


def _items(flat, item):
    """A 1-D uint8 array seen as items of ``item.itemsize`` bytes from its first byte."""
    return flat[:flat.shape[0] // item.itemsize * item.itemsize].view(item)


def _rows(flat, u, torch_side):
    """``flat`` as rows of ``u`` bytes: numpy one void element per row (a fancy-index copy
    then moves each row with one memcpy), torch a 2-D tensor of the widest integer type
    that divides ``u``."""
    n = flat.shape[0] // u
    if torch_side:
        torch = _torch()
        for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if u % w == 0 and flat.storage_offset() % w == 0:
                try:
                    return flat[:n * u].view(dt).view(n, u // w)
                except RuntimeError:  # unaligned storage: try a narrower type
                    continue
        return flat[:n * u].view(n, u)
    return flat[:n * u].view(np.dtype((np.void, u)))


def _gather_scatter(so, do, n, sb, db, torch_side):
    u = int(np.gcd.reduce(np.concatenate([so, do, n])))
    k = n // u
    total = int(k.sum())
    # Row indices of every piece, vectorized: region start + position within the region.
    first = np.cumsum(k) - k
    within = np.arange(total, dtype=np.int64) - np.repeat(first, k)
    si = np.repeat(so // u, k) + within
    di = np.repeat(do // u, k) + within
    s2, d2 = _rows(sb, u, torch_side), _rows(db, u, torch_side)
    step = max(1, BATCH // u)
    if torch_side:
        torch = _torch()
        si = torch.from_numpy(si).to(d2.device)
        di = torch.from_numpy(di).to(d2.device)
        for i in range(0, total, step):
            d2.index_copy_(0, di[i:i + step], s2.index_select(0, si[i:i + step]))
    else:
        for i in range(0, total, step):
            d2[di[i:i + step]] = s2[si[i:i + step]]
