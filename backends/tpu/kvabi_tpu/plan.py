"""What the TPU backends prepare for a step: query tiles, page ranges and cache write
indices (``plan.prepared`` of a :class:`kvabi.StepPlan`).

Built once per step and KV group from the plan's metadata with vectorized numpy, then moved
to the device once; every layer of the group reuses it (nothing in it depends on the
layer).

Attention work is cut into *tiles*: up to ``tile_size`` consecutive query tokens of one
request.  Each tile records the key pages it can see (a sliding window or attention chunk
narrows the range), so a kernel reads only those pages.  Tile arrays are padded to a power
of two so that steps of similar size share one compiled kernel.

Index widths: the kernels index with int32 (TPU scalar memory holds 32-bit words, and jax
runs without 64-bit integers by default).  A flat slot number would wrap past 2**31 slots
(where :func:`kvabi.index_dtype` says int64), so writes address a slot as (block, offset
in block), both int32 whatever the cache size; a layout with more blocks than int32
holds, or sequences whose positions int32 cannot hold, is refused with a KVABIError naming
the size, never truncated.
"""
from __future__ import annotations

import attrs
import numpy as np

import kvabi
from kvabi import KVABIError
from kvabi.util.coerce import INT32_MAX

#: rows of TPUPlan.tile_info
TILE_REQ, TILE_POS0, TILE_QLEN, TILE_KVLEN, TILE_PAGE_LO, TILE_NPAGES = range(6)
#: pages a kernel may address past a tile's last page (prefetch blocks, masked chunks):
#: positions up to (pages + POSITION_MARGIN_PAGES) * block_size must fit in int32
POSITION_MARGIN_PAGES = 128


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, index within group) of every element of groups of sizes ``counts``."""
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return owner, np.arange(len(owner), dtype=np.int64) - starts[owner]


@attrs.frozen(eq=False)
class TPUSteps:
    """Device-side description of one step, shared by the write and the attention of every
    layer (the metadata, spec, layout and options are the :class:`kvabi.StepPlan`'s)."""

    fmt: object
    #: the plan's sinks as float32 on the device (the default of every layer), or None
    sinks_device: object
    tile_size: int
    #: tiles that hold real queries (the rest of the padded arrays are empty tiles)
    num_tiles: int
    #: int32 [6, W]: request, first query position, query count, kv length, first page
    #: (index into the request's block table row), page count; W a power of two
    tile_info: object
    #: int32 [R, P] block table padded to powers of two (entries past a request's pages: 0)
    page_table: object
    #: int32 [W * tile_size]: token gathered into each tile row
    q_index: object
    #: int32 [padded_tokens]: tile row holding each token's output (0 for padding)
    out_index: object
    #: the largest page count of one tile, rounded up to a power of two
    max_tile_pages: int
    #: num_tokens rounded up to a power of two: queries and new K/V are padded to this
    #: many rows so that steps of similar size share one compiled computation
    padded_tokens: int
    #: the window / chunk the kernels apply: the spec's, clamped to int32 (positions are
    #: below that, so a larger one masks exactly the same keys)
    window: int | None
    chunk: int | None
    #: the cache write's device arrays (:func:`write_slots` or :func:`write_slices`)
    write_args: tuple
    #: the :class:`~kvabi_tpu.step_buckets.Bucket` fixing every shape of this step (limits
    #: declared by ``warmup``), or None: each count padded to its own power of two
    bucket: object = None
    #: per-layer plane indices, filled on first use (layout-specific, not layer state)
    planes_of_layer: dict = attrs.field(factory=dict)


def write_slots(meta, layout, padded_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(block, offset) int32 [padded_tokens] of each token's slot; padding tokens (slot
    -1) get block ``num_blocks``, which a scatter drops."""
    bs = meta.block_size
    blk = np.full(padded_tokens, layout.num_blocks, np.int32)
    off = np.zeros(padded_tokens, np.int32)
    s = meta.slot_mapping.astype(np.int64)
    real = s >= 0
    blk[:len(s)][real] = s[real] // bs
    off[:len(s)][real] = s[real] % bs
    return blk, off


def write_slices(meta, per: int, padded: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [4, S] rows (block, offset in block, first token, length), int32 [1] count)
    from :func:`kvabi.transforms.kv_update_slices`; S ``padded`` or else a power-of-two
    multiple of ``per``.

    A slice never crosses a page, so its cache rows are ``offset:offset+length`` of one
    block: the block and offset come from the int64 slot of its first token, exact for
    any cache size (a flat int32 slot would wrap past 2**31 slots)."""
    slices, n = kvabi.transforms.kv_update_slices(meta, per)
    if padded is None:
        padded = next_pow2(max(1, slices.shape[1] // per)) * per
    out = np.zeros((4, padded), np.int32)
    tok = slices[1, :n].astype(np.int64)
    slot = meta.slot_mapping.astype(np.int64)[tok]
    out[0, :n] = slot // meta.block_size
    out[1, :n] = slot % meta.block_size
    out[2:, :n] = slices[1:, :n]
    return out, np.array([n], np.int32)


def check_index_range(meta, spec, layout) -> None:
    """Refuse what int32 kernel indices cannot address exactly (see the module doc).
    Slots outside the layout were refused by the plan's own check."""
    bs = spec.block_size
    if layout.num_blocks > INT32_MAX:
        raise KVABIError(f"layout.num_blocks: {layout.num_blocks} blocks "
                         f"({layout.num_blocks * bs} slots) exceed the {INT32_MAX} block ids "
                         f"the TPU kernels index with int32")
    pages = -(-int(meta.max_seq_len) // bs)
    if (pages + POSITION_MARGIN_PAGES) * bs > INT32_MAX:
        raise KVABIError(f"seq_lens: a sequence of {int(meta.max_seq_len)} tokens (block "
                         f"size {bs}) has positions beyond the int32 the TPU kernels use")


def build_steps(plan, fmt, *, tile_size: int, write: str, num_slices_per_block: int = 8,
                to_device, buckets=None) -> TPUSteps:
    """What a backend prepares for ``plan`` (a checked :class:`kvabi.StepPlan`; see
    :class:`TPUSteps`); ``write`` picks the write arrays ("slots" for a scatter, "slices"
    for the DMA kernel); ``to_device`` maps numpy arrays to the backend's device arrays;
    ``buckets`` (a :class:`~kvabi_tpu.step_buckets.StepBuckets`), when given, fixes every
    shape to the step's bucket and refuses a step beyond its limits."""
    meta, spec, layout = plan.meta, plan.spec, plan.layout
    bucket = None if buckets is None else buckets.for_step(meta)
    check_index_range(meta, spec, layout)
    sinks = None if plan.sinks is None else plan.sinks.astype(np.float32)
    bs = spec.block_size

    qsl = meta.query_start_loc.astype(np.int64)
    q = np.diff(qsl)
    c = meta.context_lens.astype(np.int64)
    s = meta.seq_lens.astype(np.int64)
    need = -(-s // bs)
    bt = meta.block_table
    used = np.arange(bt.shape[1])[None, :] < need[:, None]

    # -- tiles ---------------------------------------------------------------------------
    nt = -(-q // tile_size)
    req, i = _expand(nt)
    w = len(req)
    q0 = qsl[req] + i * tile_size
    qlen = np.minimum(tile_size, q[req] - i * tile_size)
    pos0 = c[req] + i * tile_size
    hi = pos0 + qlen  # one past the last query position: keys j < hi
    lo = spec.first_visible_key(pos0)
    page_lo = lo // bs
    npages = -(-hi // bs) - page_lo
    wpad = next_pow2(max(w, 1)) if bucket is None else bucket.tiles
    info = np.zeros((6, wpad), np.int32)
    for row, val in ((TILE_REQ, req), (TILE_POS0, pos0), (TILE_QLEN, qlen),
                     (TILE_KVLEN, s[req]), (TILE_PAGE_LO, page_lo), (TILE_NPAGES, npages)):
        info[row, :w] = val

    r = np.arange(tile_size, dtype=np.int64)
    qi = np.zeros((wpad, tile_size), np.int32)
    qi[:w] = np.where(r[None, :] < qlen[:, None], q0[:, None] + r[None, :], 0)
    total = int(qsl[-1])
    padded_tokens = next_pow2(max(1, meta.num_tokens)) if bucket is None else bucket.tokens
    out_index = np.zeros(padded_tokens, np.int32)
    if total:
        treq = np.repeat(np.arange(len(q)), q)
        local = np.arange(total) - qsl[treq]
        tile_base = np.cumsum(nt) - nt
        out_index[:total] = (tile_base[treq] + local // tile_size) * tile_size + \
            local % tile_size

    if bucket is None:
        table = np.zeros((next_pow2(max(1, bt.shape[0])), next_pow2(max(1, bt.shape[1]))),
                         np.int32)
    else:  # columns past a request's pages are unused: seq_lens <= max_seq_len
        table = np.zeros((bucket.reqs, bucket.pages), np.int32)
    if bt.size:
        cols = min(bt.shape[1], table.shape[1])
        table[:bt.shape[0], :cols] = np.where(used, bt, 0)[:, :cols]

    # -- cache write ---------------------------------------------------------------------
    if write == "slots":
        arrays = write_slots(meta, layout, padded_tokens)
    else:
        arrays = write_slices(meta, num_slices_per_block,
                              None if bucket is None else bucket.slices)

    # a window or chunk longer than every position masks like one that just covers them
    window = None if spec.window is None else min(int(spec.window), INT32_MAX)
    chunk = None if spec.chunk is None else min(int(spec.chunk), INT32_MAX)
    return TPUSteps(fmt, None if sinks is None else to_device(sinks), tile_size, w,
                    to_device(info), to_device(table), to_device(qi.reshape(-1)),
                    to_device(out_index), next_pow2(max(1, int(npages.max(initial=1)))),
                    padded_tokens, window, chunk, tuple(to_device(a) for a in arrays), bucket)
