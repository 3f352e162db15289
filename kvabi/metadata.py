"""Backend-neutral attention metadata for one step: which tokens it touches and where."""
from __future__ import annotations

import attrs
import numpy as np

from .errors import KVABIError, require


def _arr(dtype):
    def conv(x):
        return np.ascontiguousarray(np.asarray(x), dtype=dtype)

    return conv


@attrs.frozen(eq=False)
class CommonAttentionMetadata:
    """The tokens of one step, in the canonical semantics of ``specs/semantics.md``.

    Request r owns query tokens ``query_start_loc[r]:query_start_loc[r+1]`` (its new tokens)
    and has ``context_lens[r]`` tokens already cached; ``seq_lens = context_lens + query
    lengths``.  Tokens from ``query_start_loc[-1]`` to ``num_tokens`` are padding: slot -1,
    position 0, never written or read.  Requests may have zero query tokens (padding
    requests).  Arrays are numpy; construct with :meth:`from_lengths` or validate by hand.
    """

    query_start_loc: np.ndarray = attrs.field(converter=_arr(np.int32))
    seq_lens: np.ndarray = attrs.field(converter=_arr(np.int32))
    context_lens: np.ndarray = attrs.field(converter=_arr(np.int32))
    positions: np.ndarray = attrs.field(converter=_arr(np.int64))
    slot_mapping: np.ndarray = attrs.field(converter=_arr(np.int64))
    block_table: np.ndarray = attrs.field(converter=_arr(np.int32))
    block_size: int = attrs.field()
    num_blocks: int | None = attrs.field(default=None)

    def __attrs_post_init__(self):
        self.validate()

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
        """
        require(isinstance(block_size, (int, np.integer)) and block_size > 0, "block_size",
                "must be a positive int", block_size)
        q = np.asarray(query_lens)
        c = np.asarray(context_lens)
        require(q.ndim == 1 and c.ndim == 1 and q.shape == c.shape, "query_lens",
                f"query_lens {q.shape} and context_lens {c.shape} must be 1-D of equal length")
        require(np.issubdtype(q.dtype, np.integer) or q.size == 0, "query_lens",
                "must be integers", q.dtype)
        require(np.issubdtype(c.dtype, np.integer) or c.size == 0, "context_lens",
                "must be integers", c.dtype)
        require(bool((q >= 0).all()), "query_lens", "must be >= 0", q[q < 0][:3].tolist())
        require(bool((c >= 0).all()), "context_lens", "must be >= 0", c[c < 0][:3].tolist())
        q = q.astype(np.int64)
        c = c.astype(np.int64)
        bt = np.asarray(block_table)
        if bt.ndim == 1 and len(q) == 0:
            bt = bt.reshape(0, 0)
        require(bt.ndim == 2 and bt.shape[0] == len(q), "block_table",
                f"must be 2-D with one row per request ({len(q)}), shape", bt.shape)
        qsl = np.zeros(len(q) + 1, np.int64)
        np.cumsum(q, out=qsl[1:])
        total = int(qsl[-1])
        n = total if num_tokens is None else int(num_tokens)
        require(n >= total, "num_tokens", f"must be >= the {total} real tokens", num_tokens)
        req = np.repeat(np.arange(len(q)), q)
        pos = c[req] + (np.arange(total) - qsl[req])
        seq = c + q
        _check_blocks(bt, seq, int(block_size), num_blocks)
        slots = np.full(n, -1, np.int64)
        positions = np.zeros(n, np.int64)
        positions[:total] = pos
        if total:
            blk = bt[req, pos // block_size].astype(np.int64)
            slots[:total] = blk * block_size + pos % block_size
        return cls(qsl, seq, c, positions, slots, bt, int(block_size), num_blocks)

    # -- validation --------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`KVABIError` unless the arrays are consistent."""
        qsl, seq, ctx = self.query_start_loc, self.seq_lens, self.context_lens
        require(qsl.ndim == 1 and len(qsl) >= 1, "query_start_loc", "must be 1-D, length >= 1",
                qsl.shape)
        require(int(qsl[0]) == 0, "query_start_loc", "must start at 0", int(qsl[0]))
        d = np.diff(qsl)
        if (d < 0).any():
            r = int(np.argmax(d < 0))
            raise KVABIError(f"query_start_loc: must be non-decreasing, but entry {r + 1} "
                             f"({int(qsl[r + 1])}) < entry {r} ({int(qsl[r])})")
        r = len(qsl) - 1
        require(seq.shape == (r,), "seq_lens", f"must have {r} entries", seq.shape)
        require(ctx.shape == (r,), "context_lens", f"must have {r} entries", ctx.shape)
        bad = np.nonzero(seq != ctx + d)[0]
        require(len(bad) == 0, "seq_lens", "must equal context_lens + query lengths at request",
                bad[:3].tolist())
        require(bool((ctx >= 0).all()), "context_lens", "must be >= 0")
        n = self.num_tokens
        require(self.positions.shape == (n,), "positions", f"must have {n} entries",
                self.positions.shape)
        require(int(qsl[-1]) <= n, "query_start_loc", f"last entry exceeds num_tokens {n}",
                int(qsl[-1]))
        require(self.block_table.ndim == 2 and self.block_table.shape[0] == r, "block_table",
                f"must be 2-D with {r} rows", self.block_table.shape)
        _check_blocks(self.block_table, seq, self.block_size, self.num_blocks)
        total = int(qsl[-1])
        require(bool((self.slot_mapping[total:] == -1).all()), "slot_mapping",
                "padding tokens must have slot -1")
        if total:
            req = np.repeat(np.arange(r), d)
            want = ctx[req] + (np.arange(total) - qsl[req])
            bad = np.nonzero(self.positions[:total] != want)[0]
            require(len(bad) == 0, "positions", "must be context_len + index within the "
                    "request's query, wrong at tokens", bad[:3].tolist())
            p = want
            blk = self.block_table[req, p // self.block_size].astype(np.int64)
            slot = blk * self.block_size + p % self.block_size
            s = self.slot_mapping[:total]
            bad = np.nonzero(s != slot)[0]
            require(len(bad) == 0, "slot_mapping", "disagrees with block_table at tokens",
                    bad[:3].tolist())


def _check_blocks(bt: np.ndarray, seq: np.ndarray, block_size: int, num_blocks) -> None:
    need = -(-seq.astype(np.int64) // block_size)
    if len(need) and int(need.max()) > bt.shape[1]:
        r = int(np.argmax(need > bt.shape[1]))
        raise KVABIError(f"block_table: request {r} needs {int(need[r])} blocks for "
                         f"seq_len {int(seq[r])}, but the table has {bt.shape[1]} columns")
    if not len(need) or bt.size == 0:
        return
    used = np.arange(bt.shape[1])[None, :] < need[:, None]
    hi = np.iinfo(np.int64).max if num_blocks is None else num_blocks
    # Elementwise over the table: a boolean gather (bt[used]) is several times slower.
    bad = used & ((bt < 0) | (bt >= hi))
    if bad.any():
        rr, cc = np.nonzero(bad)
        raise KVABIError(f"block_table: entry [{int(rr[0])}, {int(cc[0])}] = "
                         f"{int(bt[rr[0], cc[0]])} is out of range [0, "
                         f"{'inf' if num_blocks is None else num_blocks})")
