"""Backend-neutral attention metadata for one step: which tokens it touches and where.

Metadata is checked once, where it enters kvabi: :meth:`CommonAttentionMetadata.from_lengths`
checks its arguments, a hand-built ``CommonAttentionMetadata(...)`` coerces every field
(:mod:`kvabi.util.coerce`) and runs :meth:`~CommonAttentionMetadata.validate`.  The transforms
build their outputs from metadata that was already checked, through
:meth:`CommonAttentionMetadata._trusted`, which checks nothing: their property tests prove
every output would pass ``validate()``.

Index dtypes: ``query_start_loc``, ``seq_lens``, ``context_lens`` and ``block_table`` are
int32 (every length and block id fits; longer ones are refused, never wrapped); ``positions``
and ``slot_mapping`` are int64, and every slot ``num_blocks * block_size`` can reach must fit
in int64.
"""
from __future__ import annotations

from itertools import chain

import attrs
import numpy as np

from ..util.coerce import INT32_MAX, INT64_MAX, as_int, index_array, int_array
from ..util.errors import KVABIError, require

#: Most tokens (padding included) and requests one step may hold.  Arrays of a step are
#: allocated from these counts, and a count is a few bytes of input: the limit keeps memory
#: bounded (~16.8M tokens is far beyond any engine's step; specs/security.md).
MAX_STEP_TOKENS = 1 << 24
MAX_STEP_REQS = 1 << 24


def _array(dtype, field: str, ndim: int = 1):
    def conv(x):
        a = index_array(x, field, dtype, ndim=ndim)
        if a is x or not a.flags.owndata:
            # the caller's array (index_array keeps one of the right dtype as it is) or
            # memory it shares (numpy, torch): the caller may write it later, and freezing
            # it would make the caller's own buffer read-only
            a = a.copy()
        return _frozen(a)

    return conv


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a`` made read-only (kvabi's own array: validated once, never changed)."""
    a.flags.writeable = False
    return a


def _block_size(v) -> int:
    return as_int(v, "block_size", lo=1)


def _num_blocks(v) -> int | None:
    return None if v is None else as_int(v, "num_blocks", lo=0)


@attrs.frozen(eq=False)
class CommonAttentionMetadata:
    """The tokens of one step, in the canonical semantics of ``specs/semantics.md``.

    Request r owns query tokens ``query_start_loc[r]:query_start_loc[r+1]`` (its new tokens)
    and has ``context_lens[r]`` tokens already cached; ``seq_lens = context_lens + query
    lengths``.  Tokens from ``query_start_loc[-1]`` to ``num_tokens`` are padding: slot -1,
    position 0, never written or read.  Requests may have zero query tokens (padding
    requests).  Arrays are numpy; construct with :meth:`from_lengths` or by hand (every
    field coerced, then :meth:`validate`).  Arrays may be shared between metadata objects
    (a transform's output and its input): never mutate them.
    """

    query_start_loc: np.ndarray = attrs.field(converter=_array(np.int32, "query_start_loc"))
    seq_lens: np.ndarray = attrs.field(converter=_array(np.int32, "seq_lens"))
    context_lens: np.ndarray = attrs.field(converter=_array(np.int32, "context_lens"))
    positions: np.ndarray = attrs.field(converter=_array(np.int64, "positions"))
    slot_mapping: np.ndarray = attrs.field(converter=_array(np.int64, "slot_mapping"))
    block_table: np.ndarray = attrs.field(converter=_array(np.int32, "block_table", 2))
    block_size: int = attrs.field(converter=_block_size)
    num_blocks: int | None = attrs.field(default=None, converter=_num_blocks)

    def __attrs_post_init__(self):
        self.validate()

    @classmethod
    def _trusted(cls, query_start_loc, seq_lens, context_lens, positions, slot_mapping,
                 block_table, block_size: int, num_blocks) -> "CommonAttentionMetadata":
        """Metadata from arrays already of the field dtypes and already consistent (built
        by kvabi from checked metadata): no coercion, no validation.  Internal."""
        self = object.__new__(cls)
        for name, v in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                        ("context_lens", context_lens), ("positions", positions),
                        ("slot_mapping", slot_mapping), ("block_table", block_table),
                        ("block_size", block_size), ("num_blocks", num_blocks)):
            object.__setattr__(self, name, _frozen(v) if isinstance(v, np.ndarray) else v)
        return self

    # -- derived sizes -----------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the step, padding included."""
        return int(self.slot_mapping.shape[0])

    @property
    def num_actual_tokens(self) -> int:
        """Tokens that belong to a request (padding excluded)."""
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc).astype(np.int32)

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))

    @property
    def token_request(self) -> np.ndarray:
        """Request index of each real token (int32, length num_actual_tokens)."""
        return np.repeat(np.arange(self.num_reqs, dtype=np.int32), self.query_lens)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_lengths(cls, query_lens, context_lens, block_table, block_size: int, *,
                     num_blocks: int | None = None, num_tokens: int | None = None
                     ) -> "CommonAttentionMetadata":
        """Build metadata from per-request query and context lengths and a block table.

        ``num_tokens`` (default: the sum of query lengths) adds trailing padding tokens.
        Every argument is checked (KVABIError naming it): lengths are non-negative integers
        whose ``seq_len`` fits in int32, block ids of the used columns lie in
        ``[0, num_blocks)`` and every slot they reach fits in int64.
        """
        bs = _block_size(block_size)
        nb = _num_blocks(num_blocks)
        q = int_array(query_lens, "query_lens", lo=0, hi=INT32_MAX)
        c = int_array(context_lens, "context_lens", lo=0, hi=INT32_MAX)
        require(q.shape == c.shape, "query_lens",
                f"query_lens {q.shape} and context_lens {c.shape} must have equal length")
        seq = c + q  # < 2**32: both were checked against int32
        if len(seq) and int(seq.max()) > INT32_MAX:
            r = int(np.argmax(seq > INT32_MAX))
            raise KVABIError(f"context_lens/query_lens: request {r} has seq_len "
                             f"{int(c[r])} + {int(q[r])} = {int(seq[r])}, beyond int32 "
                             f"({INT32_MAX})")
        r = len(q)
        bt = index_array(_rows(block_table), "block_table", np.int32, ndim=2)
        if bt is block_table or bt.base is not None:  # the caller's memory: keep our own copy
            bt = bt.copy()
        require(bt.shape[0] == r, "block_table",
                f"must be 2-D with one row per request ({r}), shape", bt.shape)
        qsl = np.empty(r + 1, np.int64)
        qsl[0] = 0
        np.cumsum(q, out=qsl[1:])
        total = int(qsl[-1])
        require(total <= MAX_STEP_TOKENS, "query_lens",
                f"must sum to at most MAX_STEP_TOKENS = {MAX_STEP_TOKENS}", total)
        n = total if num_tokens is None else as_int(num_tokens, "num_tokens",
                                                    hi=MAX_STEP_TOKENS)
        require(n >= total, "num_tokens", f"must be >= the {total} real tokens", n)
        check_blocks(bt, seq, bs, nb)
        slots = np.full(n, -1, np.int64)
        positions = np.zeros(n, np.int64)
        if total:
            # One repeat per token array, no per-request loop: positions are the token
            # index shifted by (context - query start) of its request.
            pos = positions[:total]
            np.add(np.arange(total, dtype=np.int64), np.repeat(c - qsl[:-1], q), out=pos)
            row = np.repeat(np.arange(0, r * bt.shape[1], bt.shape[1], dtype=np.int64), q)
            blk = bt.ravel()[row + pos // bs]
            np.multiply(blk, bs, out=slots[:total], dtype=np.int64)  # int32 ids: no wrap
            slots[:total] += pos % bs
        return cls._trusted(qsl.astype(np.int32), seq.astype(np.int32), c.astype(np.int32),
                            positions, slots, bt, bs, nb)

    # -- validation --------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`KVABIError` unless the fields are consistent: dtypes and shapes,
        lengths (``seq_lens == context_lens + query lengths``, all in int32), block ids of
        the used columns inside the pool, every reachable slot in int64, padding tokens at
        slot -1 and position 0, and each real token's position and slot as the semantics
        define them.  Independent of how the metadata was built."""
        qsl, seq, ctx = self.query_start_loc, self.seq_lens, self.context_lens
        pos, slots, bt = self.positions, self.slot_mapping, self.block_table
        for name, a, dt, nd in (("query_start_loc", qsl, np.int32, 1),
                                ("seq_lens", seq, np.int32, 1),
                                ("context_lens", ctx, np.int32, 1),
                                ("positions", pos, np.int64, 1),
                                ("slot_mapping", slots, np.int64, 1),
                                ("block_table", bt, np.int32, 2)):
            if not (isinstance(a, np.ndarray) and a.dtype == dt and a.ndim == nd
                    and a.flags.c_contiguous):
                raise KVABIError(f"{name}: must be a C-contiguous {nd}-D numpy "
                                 f"{np.dtype(dt)} array, got "
                                 f"{type(a).__name__} {getattr(a, 'dtype', '')} of shape "
                                 f"{getattr(a, 'shape', None)}")
        bs = _block_size(self.block_size)
        nb = _num_blocks(self.num_blocks)
        require(len(qsl) >= 1, "query_start_loc", "must have length >= 1", qsl.shape)
        require(int(qsl[0]) == 0, "query_start_loc", "must start at 0", int(qsl[0]))
        d = np.diff(qsl.astype(np.int64))
        if (d < 0).any():
            r = int(np.argmax(d < 0))
            raise KVABIError(f"query_start_loc: must be non-decreasing, but entry {r + 1} "
                             f"({int(qsl[r + 1])}) < entry {r} ({int(qsl[r])})")
        r = len(qsl) - 1
        require(seq.shape == (r,), "seq_lens", f"must have {r} entries", seq.shape)
        require(ctx.shape == (r,), "context_lens", f"must have {r} entries", ctx.shape)
        if r:
            require(int(ctx.min()) >= 0, "context_lens", "must be >= 0", int(ctx.min()))
        bad = np.nonzero(seq.astype(np.int64) != ctx.astype(np.int64) + d)[0]
        require(len(bad) == 0, "seq_lens", "must equal context_lens + query lengths at request",
                bad[:3].tolist())
        n = len(slots)
        require(pos.shape == (n,), "positions", f"must have {n} entries (one per slot_mapping "
                "entry)", pos.shape)
        total = int(qsl[-1])
        require(total <= n, "query_start_loc", f"last entry exceeds num_tokens {n}", total)
        require(bt.shape[0] == r, "block_table", f"must be 2-D with {r} rows", bt.shape)
        check_blocks(bt, seq, bs, nb)
        bad = np.nonzero(slots[total:] != -1)[0]
        require(len(bad) == 0, "slot_mapping", "padding tokens must have slot -1, not at "
                "tokens", (bad[:3] + total).tolist())
        bad = np.nonzero(pos[total:] != 0)[0]
        require(len(bad) == 0, "positions", "padding tokens must have position 0, not at "
                "tokens", (bad[:3] + total).tolist())
        if total:
            req = np.repeat(np.arange(r), d)
            want = (ctx.astype(np.int64) - qsl[:-1])[req] + np.arange(total)
            bad = np.nonzero(pos[:total] != want)[0]
            require(len(bad) == 0, "positions", "must be context_len + index within the "
                    "request's query, wrong at tokens", bad[:3].tolist())
            blk = bt.ravel()[req * bt.shape[1] + want // bs].astype(np.int64)
            bad = np.nonzero(slots[:total] != blk * bs + want % bs)[0]
            require(len(bad) == 0, "slot_mapping", "disagrees with block_table at tokens",
                    bad[:3].tolist())


def check_blocks(bt: np.ndarray, seq: np.ndarray, block_size: int, num_blocks) -> None:
    """The block table (int32 [R, W]) covers every request's ``seq_len`` blocks, their ids
    lie in ``[0, num_blocks)`` and every slot they reach fits in int64."""
    need = -(-seq.astype(np.int64) // block_size)
    if len(need) and int(need.max()) > bt.shape[1]:
        r = int(np.argmax(need > bt.shape[1]))
        raise KVABIError(f"block_table: request {r} needs {int(need[r])} blocks for "
                         f"seq_len {int(seq[r])}, but the table has {bt.shape[1]} columns")
    if num_blocks is not None and num_blocks * block_size - 1 > INT64_MAX:
        raise KVABIError(f"block_size: num_blocks * block_size = {num_blocks} * "
                         f"{block_size} slots cannot be represented in int64")
    if not len(need) or bt.size == 0:
        return
    # Fast path, no mask: ids as unsigned are >= hi exactly when negative or too large.
    hi = 1 << 31 if num_blocks is None else min(num_blocks, 1 << 31)
    if bool((bt.view(np.uint32) >= hi).any()):
        used = np.arange(bt.shape[1])[None, :] < need[:, None]
        bad = used & ((bt < 0) | (bt >= hi))
        if bad.any():
            rr, cc = np.nonzero(bad)
            raise KVABIError(f"block_table: entry [{int(rr[0])}, {int(cc[0])}] = "
                             f"{int(bt[rr[0], cc[0]])} is out of range [0, "
                             f"{'inf' if num_blocks is None else num_blocks})")
    if num_blocks is None and block_size > 1 << 32:  # int32 ids * block_size may pass int64
        used = np.arange(bt.shape[1])[None, :] < need[:, None]
        top = int(np.where(used, bt, 0).max())
        if (top + 1) * block_size - 1 > INT64_MAX:
            raise KVABIError(f"block_size: block id {top} * block_size {block_size} is a "
                             f"slot that cannot be represented in int64")


def _rows(table):
    """A block table given as Python rows, as a numpy array: rows of different lengths
    named, bool entries refused, both checked with the iteration in C (no Python step per
    entry); anything else is returned as it is for :func:`index_array` to check."""
    if not (isinstance(table, (list, tuple)) and table
            and set(map(type, table)) <= {list, tuple}):
        return table
    lens = np.fromiter(map(len, table), np.int64, len(table))
    if np.any(lens != lens[0]):
        r = int(np.argmax(lens != lens[0]))
        raise KVABIError(f"block_table: row {r} has {int(lens[r])} entries, row 0 has "
                         f"{int(lens[0])} (rows must have equal length)")
    types = set(map(type, chain.from_iterable(table)))
    if bool in types or np.bool_ in types:
        raise KVABIError("block_table: must hold integers, got a bool entry")
    if types & {list, tuple}:
        return table  # nested deeper than rows: index_array refuses it by shape
    try:
        if types == {int}:  # the common case: no dtype discovery needed
            return np.fromiter(chain.from_iterable(table), np.int64,
                               len(table) * int(lens[0])).reshape(len(table), int(lens[0]))
        return np.asarray(table)
    except (ValueError, TypeError, OverflowError):
        return table  # index_array names what is wrong
