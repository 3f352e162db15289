"""Chunked local attention for libraries without it: plain causal attention over
kvabi's local virtual batches (one virtual request per attention chunk a request's queries
touch; outputs line up 1:1 with the original tokens)."""
from __future__ import annotations

from kvabi import UnsupportedError


def attention_meta(meta, spec, backend: str):
    """The metadata to hand a causal-only library: ``meta`` itself, or for chunked local
    attention its virtual batches (needs the chunk to be a multiple of the block size)."""
    if spec.kind != "chunked_local":
        return meta
    if spec.chunk % spec.block_size:
        raise UnsupportedError(f"{backend}: unsupported: chunked local attention needs chunk "
                               f"{spec.chunk} to be a multiple of block_size {spec.block_size}")
    from kvabi.transforms import local_virtual_batches

    return local_virtual_batches(meta, spec.chunk)[0]
