"""The compile key of the TPU backends: every shape of a step rounded up to a bucket.

XLA compiles one computation per combination of input shapes and static arguments.  Without
declared limits a TPU plan pads each count of a step (tokens, requests, pages per request,
tiles, update slices) to its own power of two, so a step whose decode count, chunk length or
context crosses a power of two compiles again.  Once an engine declares its
:class:`kvabi.StepLimits` (``backend.warmup(spec, layout, limits)``), every count follows the
token count instead: the buckets form one ladder, indexed by the padded token count, and each
rung fixes every other shape to the largest a step of that many tokens can need.  A step
uses the smallest rung that holds its tokens and requests, so the compile key takes one
value per rung (times the layers of a cross-layer layout, whose layer is a static index).

Rung of ``T`` tokens (``R`` requests, ``ts`` the shared tile height, ``rows`` the
``tpu.jax`` prefill tile height, ``bs`` the block size):

========================  ===================================================
tokens                    16, 32, 64, ... below ``max_tokens``, then ``max_tokens``
requests ``R``            ``min(T, max_reqs)``; the top rung ``max_reqs``
pages per request         ``ceil(max_seq_len / bs)`` (every rung)
tiles (shared plan)       ``(T - n) // ts + n``, ``n = min(R, T)``
decode tiles (tpu.jax)    ``min(R, T)``
prefill tiles (tpu.jax)   ``(T - m) // rows + m``, ``m = min(R, T // 2)``
update slices (pallas)    ``min(T, (T - n) // bs + 2 n)``, up to a multiple of the
                          slices per grid step
========================  ===================================================

Each bound is the most that ``T`` tokens over at most ``R`` requests can need (a request of
``q`` tokens needs ``ceil(q / h)`` tiles of height ``h`` and touches at most
``(q - 1) // bs + 2`` pages), so any step within the limits fits its rung.  Padding tiles
and slices are empty: the kernels skip them.
"""
from __future__ import annotations

import attrs

import kvabi
from kvabi import KVABIError

#: the smallest token rung: below it padding costs less than another compile
MIN_TOKENS = 16


@attrs.frozen
class Bucket:
    """The shapes of one rung (see the module doc)."""

    tokens: int
    reqs: int
    pages: int
    tiles: int
    decode_tiles: int
    prefill_tiles: int
    slices: int


def rung(tokens: int, reqs: int, pages: int, *, block_size: int, tile_size: int,
         prefill_rows: int, slices_per_block: int) -> Bucket:
    """The bucket of ``tokens`` padded tokens and ``reqs`` page-table rows."""
    t = tokens
    n = min(reqs, t)
    m = min(reqs, t // 2)
    slices = min(t, (t - n) // block_size + 2 * n)
    per = slices_per_block
    return Bucket(tokens=t, reqs=reqs, pages=pages, tiles=(t - n) // tile_size + n,
                  decode_tiles=n, prefill_tiles=(t - m) // prefill_rows + m,
                  slices=max(1, -(-slices // per)) * per)


@attrs.frozen
class StepBuckets:
    """The ladder of buckets a backend uses for steps within ``limits``."""

    limits: kvabi.StepLimits
    ladder: tuple

    @classmethod
    def build(cls, limits, *, block_size: int, tile_size: int, prefill_rows: int,
              slices_per_block: int) -> "StepBuckets":
        if not isinstance(limits, kvabi.StepLimits):
            raise KVABIError(f"limits: must be a kvabi.StepLimits, got "
                             f"{type(limits).__name__}")
        tokens = []
        t = MIN_TOKENS
        while t < limits.max_tokens:
            tokens.append(t)
            t *= 2
        tokens.append(limits.max_tokens)
        pages = -(-limits.max_seq_len // block_size)
        ladder = tuple(
            rung(t, limits.max_reqs if i == len(tokens) - 1 else min(t, limits.max_reqs),
                 pages, block_size=block_size, tile_size=tile_size,
                 prefill_rows=prefill_rows, slices_per_block=slices_per_block)
            for i, t in enumerate(tokens))
        return cls(limits, ladder)

    def for_step(self, meta) -> Bucket:
        """The smallest bucket holding ``meta``'s tokens and requests; KVABIError naming the
        limit a step beyond the declared limits exceeds (such a step is refused, never
        compiled)."""
        self.limits.check(meta)
        t, r = int(meta.num_tokens), int(meta.num_reqs)
        for b in self.ladder:
            if t <= b.tokens and r <= b.reqs:
                return b
        raise AssertionError("unreachable: the top rung holds every step within the limits")

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The padded token counts, smallest first: an engine that pads its metadata to one
        of these (``kvabi.transforms.pad``) hands the backend arrays it uses as they are."""
        return tuple(b.tokens for b in self.ladder)
