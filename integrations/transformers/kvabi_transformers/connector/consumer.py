"""The consumer side in transformers' continuous batching: a request whose
``kv_transfer_params`` name a producer's prompt KV gets blocks, waits (outside the
scheduler's queues) while kvabi.pd pulls that KV into them, and then joins the scheduler
as a request whose prompt is computed up to its last token, exactly as transformers' own
prefix sharing resumes a request from shared blocks (``position_offset``, the remaining
prefill tokens, status ``PREFILLING``).  The last prompt token is computed here (its
logits start the decode), over the pulled KV.

A request refused where it enters, or whose pull fails, fails alone (its blocks freed at
once: a pull ends, or is given up, before the engine learns it ended), or computes its
prompt itself with ``kv_load_failure_policy="recompute"``.  Pulled blocks are never
offered to transformers' prefix sharing: KV from another engine serves only the request
that asked for it.
"""
from __future__ import annotations

import collections

from transformers.generation.continuous_batching.requests import RequestStatus


class Consumer:
    """Requests waiting for blocks or for their pull, for one connector."""

    def __init__(self, conn):
        self.conn = conn
        #: request id -> (state, params, tokens to pull), waiting for blocks (FIFO)
        self.waiting: collections.OrderedDict = collections.OrderedDict()
        #: request id -> (state, tokens pulled), pull queued or running
        self.pulling: dict = {}
        #: requests cancelled while pulling: dropped when their pull ends
        self.cancelled: set[str] = set()
        #: requests whose blocks hold pulled KV (never hashed for prefix sharing)
        self.pulled: set[str] = set()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.pulling)

    def enter(self, state, params) -> bool:
        """Take ``state`` if its parameters ask for a pull (or are refused): True; False
        when it is scheduled as any request."""
        ep, rid, prompt = self.conn.endpoint, state.request_id, state.initial_tokens
        n, asynchronous = ep.matched(rid, params, prompt)
        if not asynchronous:
            return False
        reason = ep.refusal(rid, params, prompt)
        if reason is not None:
            self.conn.fail(state, reason)
            return True
        self.waiting[rid] = (state, params, n)
        self.allocate()
        return True

    def allocate(self) -> None:
        """Give waiting requests their blocks, in arrival order, while the cache has room;
        queue their pulls."""
        cache = self.conn.cache
        while self.waiting:
            rid, (state, params, n) = next(iter(self.waiting.items()))
            if not cache.can_store_request_tokens(state, n):
                return
            del self.waiting[rid]
            (alloc,) = cache.cache_allocators.values()
            blocks = self.conn.caches.kvabi_blocks(alloc.block_table[rid])
            self.pulling[rid] = (state, n)
            self.conn.endpoint.allocated(rid, params, state.initial_tokens, blocks, n)

    def ended(self, received, failed: dict) -> None:
        """Pulls that ended (``failed``: the reasons of those that did not arrive)."""
        conn = self.conn
        for rid in received:
            got = self.pulling.pop(rid, None)
            if got is None:
                continue
            state, n = got
            if rid in self.cancelled:  # its blocks were kept until no byte could land
                self.cancelled.discard(rid)
                conn.cache.free_blocks(rid)
                conn.forget(state)
            elif rid in failed:
                conn.cache.free_blocks(rid)
                if conn.options.failure_policy == "recompute":
                    conn.forget(state)
                    conn.scheduler.add_waiting_request(state)
                else:
                    conn.fail(state, failed[rid])
            else:
                self.resume(state, n)
        self.allocate()

    def resume(self, state, n: int) -> None:
        """``state``'s first ``n`` prompt tokens arrived in its blocks: the scheduler takes
        it with all but its last prompt token computed."""
        conn = self.conn
        (alloc,) = conn.cache.cache_allocators.values()
        conn.caches.import_blocks(conn.caches.kvabi_blocks(alloc.block_table[state.request_id])[0])
        done = min(n, len(state.initial_tokens) - 1)
        state.position_offset = done
        state.remaining_prefill_tokens = state.initial_tokens[done:]
        state.status = RequestStatus.PREFILLING
        self.pulled.add(state.request_id)
        conn.scheduler.active_requests[state.request_id] = state

    def cancel(self, rid: str) -> bool:
        """A cancelled request: dropped now when it waits for blocks; kept (with its blocks)
        until its pull ends when pulling.  False when it is not here."""
        got = self.waiting.pop(rid, None)
        if got is not None:
            self.conn.forget(got[0])
            return True
        if rid in self.pulling:
            self.cancelled.add(rid)
            return True
        return False

    def fail_all(self, error) -> None:
        """The engine stops: every waiting or pulling request fails."""
        for rid, (state, params, _) in list(self.waiting.items()):
            self.conn.fail(state, str(error))
        for rid, (state, _) in list(self.pulling.items()):
            if rid not in self.cancelled:
                self.conn.fail(state, str(error))
        self.waiting.clear()
        self.pulling.clear()
        self.cancelled.clear()


__all__ = ["Consumer"]
