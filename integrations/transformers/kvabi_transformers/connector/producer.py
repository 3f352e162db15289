"""The producer side in transformers' continuous batching: a request that asked to be
decoded elsewhere (``kv_transfer_params={"do_remote_decode": true}``) keeps its blocks
when it finishes, under a grant kvabi.pd publishes; its output carries the answer
(``kv_transfer_params``) that tells a consumer where they are.

Held blocks stay in transformers' allocator under a name no request can have
(``kvabi-held:<request id>``), so the scheduler never gives them to another request, and are
freed once kvabi.pd reports the grant read by every consumer rank or expired
(``hold_timeout_s``).  Blocks a held request shares with others (transformers' prefix
sharing) are full blocks, never written again; its own last block is its alone.
"""
from __future__ import annotations

import collections
import threading

from transformers.generation.continuous_batching.requests import RequestStatus

#: answers kept for the caller to take (the oldest dropped beyond it)
ANSWERS = 4096
HELD = "kvabi-held:"


class Producer:
    """Held requests and their answers, for one connector."""

    def __init__(self, conn):
        self.conn = conn
        #: request id -> the name its blocks are held under
        self.held: dict[str, str] = {}
        #: request id -> its answer (kv_transfer_params), until taken (any thread takes)
        self.answers: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def finish(self, state, params) -> bool:
        """``state`` ended; True when its blocks are now held for a consumer."""
        conn, rid = self.conn, state.request_id
        (alloc,) = conn.cache.cache_allocators.values()
        table = alloc.block_table.get(rid, [])
        blocks = conn.caches.kvabi_blocks(table)
        tokens = list(state.initial_tokens) + list(state.generated_tokens)
        hold, answer = conn.endpoint.finished(
            rid, params, normal=state.status == RequestStatus.FINISHED, tokens=tokens,
            num_computed=int(state.position_offset), blocks=blocks)
        if answer is not None:
            with self._lock:
                self.answers[rid] = answer
                while len(self.answers) > ANSWERS:
                    self.answers.popitem(last=False)
        if not hold:
            return False
        conn.caches.export_blocks(blocks[0])  # a jax cache's bytes, into what is served
        name = HELD + rid
        for a in conn.cache.cache_allocators.values():
            a.block_table[name] = a.block_table.pop(rid, [])
        self.held[rid] = name
        return True

    def sent(self, req_ids) -> None:
        """kvabi.pd says these held requests' blocks may be freed."""
        for rid in req_ids:
            name = self.held.pop(rid, None)
            if name is not None:
                self.conn.cache.free_blocks(name)

    def answer(self, rid: str):
        """The answer of finished request ``rid``, or None."""
        with self._lock:
            return self.answers.get(rid)

    def take_answer(self, rid: str):
        """The answer of finished request ``rid`` (then forgotten), or None."""
        with self._lock:
            return self.answers.pop(rid, None)


__all__ = ["HELD", "Producer"]
