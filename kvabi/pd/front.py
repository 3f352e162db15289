"""An engine's front (``specs/pd.md`` sections 6.1 and 8): where requests enter and leave.

It reads each request's ``kv_transfer_params`` once, where it enters, and decides what the
cache sides do for it: pull from a producer, load from or save to the host tier, publish a
grant for a consumer, or report it refused.  It sees requests, never memory; it reaches the
cache sides only through the step's :class:`~.work.StepWork` (in the same process or
carried by the engine to its workers).

A refused request (bad parameters, no grant slot) fails alone: the front keeps the reason,
logs it, and hands the cache side a :class:`~.work.Fail` for it once the engine allocated
it (engines whose failed loads are reported by the cache side, as vLLM's, need that).
Every table here is per live request and cleaned when it finishes, or bounded (grants, the
host tier, the parsed handshakes).
"""
from __future__ import annotations

import collections
import hashlib
import logging

import numpy as np

from ..util.errors import KVABIError
from .digests import tokens_digest
from .grants import GrantBook
from .host_index import HostIndex, chain_keys
from .params import Entry, ParamsReader, answer
from .settings import PDSettings
from .slots import NULL, window_blocks
from .work import Fail, GrantIssue, HostLoad, HostSave, PullWork, Served, StepWork

#: refusals kept for inspection (the log has every one)
REFUSALS = 256


class Front:
    """The request side of one engine (all its ranks): ``windows`` per KV cache group its
    sliding window (None: full attention); ``engine_id`` goes into answers; ``log`` and
    ``label`` say where and under which name refusals are logged; ``settings_at`` where the
    engine's configuration states the bounds (a prefix of their names in messages)."""

    def __init__(self, settings: PDSettings, *, block_size: int, windows, engine_id: str = "",
                 log: logging.Logger | None = None, label: str = "kvabi.pd",
                 settings_at: str = ""):
        self.settings = settings
        self.block_size = int(block_size)
        self.windows = tuple(windows)
        self.engine_id = engine_id
        self.need_back = np.array([window_blocks(w, self.block_size) or 1 << 40
                                   for w in self.windows], np.int64)
        self._log = log or logging.getLogger("kvabi.pd")
        self._label = label
        self._at = settings_at  # where the engine's configuration states the bounds
        self._reader = ParamsReader(consumer=settings.consumer, windows=self.windows)
        self._handshakes: list = []
        self._grants_msg = ""
        # per live request: what it asked (an Entry), or why it is refused (a str)
        self._entries: dict[str, Entry | str] = {}
        self._book = GrantBook(settings.max_held) if settings.producer else None
        self._host: HostIndex | None = None
        self._saving: set[str] = set()
        #: (request id, reason) of the latest refusals
        self.refusals: collections.deque = collections.deque(maxlen=REFUSALS)
        self._work = StepWork()
        self._step_keys: set[bytes] = set()

    def serve(self, ranks) -> None:
        """What every rank's cache side serves (:class:`~.work.Served`, rank order): at TP 1
        one message per part and one for the grant table; at TP M a list of M in each
        place, from which each consumer rank reads the heads it holds."""
        ranks = [r for r in ranks if isinstance(r, Served)]
        if not ranks:
            return
        if len(ranks) == 1:
            self._handshakes = list(ranks[0].handshakes)
            self._grants_msg = ranks[0].grants
        else:
            first = ranks[0].handshakes
            self._handshakes = [{part: [r.handshakes[g][part] for r in ranks]
                                 for part in first[g]} for g in range(len(first))]
            self._grants_msg = [r.grants for r in ranks]
            if not all(self._grants_msg):
                self._handshakes, self._grants_msg = [], ""
        seeds = [r.host_seed for r in ranks if r.host_seed]
        if self.settings.host_blocks and seeds:
            # one namespace for the engine: every rank's layouts (their shards) in it
            seed = seeds[0] if len(seeds) == 1 else \
                hashlib.blake2b(b"".join(seeds), digest_size=16).digest()
            self._host = HostIndex(len(self.windows), self.settings.host_blocks, seed)

    # -- where a request enters --------------------------------------------------------
    def entry(self, req_id: str, params, prompt) -> Entry | str:
        """What the request asks (read once), or why it is refused."""
        e = self._entries.get(req_id)
        if e is None:
            try:
                e = self._reader.read(params, prompt or [])
            except KVABIError as err:
                e = str(err)
                self.refuse(req_id, e)
            self._entries[req_id] = e
        return e

    def refuse(self, req_id: str, reason: str) -> None:
        """Log and keep a refusal."""
        self._log.error("%s: request %s refused: %s", self._label, req_id, reason)
        self.refusals.append((req_id, reason))

    def matched(self, req_id: str, params, prompt, computed: int, salt=None) -> tuple[int, bool]:
        """(tokens the engine will receive beyond the ``computed`` it holds, whether they
        arrive asynchronously: a pull, or a refusal reported as a failed one)."""
        e = self.entry(req_id, params, prompt)
        if isinstance(e, str):  # refused: an asynchronous load the cache side reports failed
            count = len(prompt or []) - computed
            return (count, True) if count > 0 else (0, False)
        if e.remote is not None:
            count = e.remote.num_tokens - computed
            return (count, True) if count > 0 else (0, False)
        if not e.host:
            return 0, False
        _, k = self._host_hit(prompt, salt)
        count = k * self.block_size - computed
        return (count, False) if count > 0 else (0, False)

    def allocated(self, req_id: str, params, prompt, blocks, num_external: int,
                  salt=None) -> None:
        """The engine gave the request ``blocks`` (per group, its block ids for positions
        from 0, -1 none) and will receive ``num_external`` tokens: queue the pull, the host
        load or the refusal."""
        e = self.entry(req_id, params, prompt)
        if isinstance(e, str) or e.remote is not None:
            # once: a request the engine recomputes after the failure computes everything
            self._entries[req_id] = Entry(host=False)
        if isinstance(e, str):
            if num_external > 0:
                self._work.fails.append(Fail(req_id, e))
            return
        if e.remote is not None:
            if num_external > 0:
                self._work.pulls.append(PullWork(req_id, e.remote, [list(b) for b in blocks],
                                                 e.remote.num_tokens - num_external,
                                                 num_external))
            return
        if num_external > 0:
            self._schedule_load(prompt, salt, blocks, num_external, req_id)

    def take_work(self) -> StepWork:
        """This step's work for the cache sides (then empty)."""
        work, self._work = self._work, StepWork()
        self._step_keys = set()
        return work

    # -- where a request leaves ------------------------------------------------------------
    def finished(self, req_id: str, params, *, normal: bool, tokens, num_computed: int,
                 blocks, salt=None) -> tuple[bool, dict | None]:
        """The request ended (``normal``: by its length or a stop, not an abort or error),
        having computed ``num_computed`` of ``tokens`` in ``blocks`` (per group): (whether
        the engine must keep its blocks until the cache side reports it sent, the answer to
        return with it or None)."""
        e = self._entries.pop(req_id, None)
        if e is None:  # finished before it was scheduled (aborted): read what it asked
            try:
                e = self._reader.read(params, [])
            except KVABIError:
                e = Entry(host=False)
        if isinstance(e, str):
            return False, None
        if self.settings.producer and e.remote_decode:
            if not normal or not self._handshakes or not any(len(b) for b in blocks):
                return False, None
            return self._grant(req_id, tokens, num_computed, blocks)
        if self._host is not None and normal and e.host:  # (never a pulled prompt)
            return self._schedule_save(req_id, tokens[:num_computed], blocks, salt), None
        return False, None

    def _grant(self, req_id, tokens, n: int, blocks):
        """Hold the request's blocks for a consumer: a grant, and the answer carrying it (or
        no hold when every grant slot is taken)."""
        need = -(-n // self.block_size)
        blocks = [[int(x) for x in b[:need]] for b in blocks]
        issued = self._book.issue(req_id)
        if issued is None:
            self.refuse(req_id, f"max_held: {len(self._book)} requests already hold blocks "
                                f"for decode engines ({self._at}max_held); not held")
            return False, None
        slot, nonce = issued
        self._work.grants.append(GrantIssue(req_id, slot, nonce, blocks, n,
                                            tokens_digest(tokens[:n])))
        return True, answer(slot=slot, nonce=nonce, num_tokens=n, blocks=blocks,
                            handshakes=self._handshakes, grants=self._grants_msg,
                            engine_id=self.engine_id, request_id=req_id)

    def sent(self, req_ids) -> None:
        """The cache sides reported these requests' blocks free (grants closed, saves
        done): their grant slots may be issued again."""
        for r in req_ids:
            self._saving.discard(r)
            if self._book is not None:
                self._book.release(r)

    def has_pending_work(self) -> bool:
        """Whether grants or saves wait for the cache sides."""
        return bool(self._work.saves or self._work.grants)

    # -- host tier ------------------------------------------------------------------------
    def _host_keys(self, salt, token_ids):
        return chain_keys(self._host.seed, salt, token_ids, self.block_size)

    def _host_hit(self, prompt, salt) -> tuple[tuple, int]:
        """((keys, parents, tokens) of the prompt's full blocks, blocks restorable)."""
        if self._host is None or not len(self._host):
            return ([], [], None), 0
        prompt = prompt or []
        # the last prompt token is always computed (its logits start the decode)
        chain = self._host_keys(salt, prompt[:max(len(prompt) - 1, 0)])
        return chain, self._host.hit(*chain, self.need_back)

    def _schedule_load(self, prompt, salt, blocks, num_external: int, req_id: str) -> None:
        (keys, parents, toks), k = self._host_hit(prompt, salt)
        first = k - num_external // self.block_size
        present = self._host.present(keys[first:k], parents[first:k], toks[first:k])
        idx, rows = np.arange(first, k), []
        for g, group_ids in enumerate(blocks):  # a loop over KV cache groups
            have = np.asarray(group_ids, np.int64)
            ok = (idx < have.size) & present[g]
            row = np.full(idx.size, NULL, np.int64)
            row[ok] = have[idx[ok]]
            rows.append(row.tolist())
        self._work.loads.append(HostLoad(req_id, keys[first:k], rows))

    def _schedule_save(self, req_id, tokens, blocks, salt) -> bool:
        """Index the request's full blocks the tier does not hold (evicting the least
        recently used), and queue their copy."""
        keys, parents, toks = self._host_keys(salt, tokens)
        save_keys, rows = [], [[] for _ in self.windows]
        for i, key in enumerate(keys):  # a loop over the request's blocks
            if key in self._host:
                continue
            row = [int(b[i]) if i < len(b) else NULL for b in blocks]
            evicted = self._host.add(key, parents[i], toks[i], [b != NULL for b in row],
                                     keep=self._step_keys)
            if evicted is None:
                break  # it cannot fit (every entry is being saved this step)
            self._work.evicts += evicted
            self._step_keys.add(key)
            save_keys.append(key)
            for g, b in enumerate(row):
                rows[g].append(b)
        self._host.touch(keys)
        if not save_keys:
            return False
        self._work.saves.append(HostSave(req_id, save_keys, rows))
        self._saving.add(req_id)
        return True

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table (for tests and monitoring)."""
        return {"entries": len(self._entries), "saving": len(self._saving),
                "held": len(self._book) if self._book is not None else 0,
                "host_entries": len(self._host) if self._host is not None else 0,
                "refusals": len(self.refusals)}


__all__ = ["Front", "REFUSALS"]
