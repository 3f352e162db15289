"""KvabiConnector's scheduler side: reads each request's ``kv_transfer_params`` once, where
it enters, and decides what the worker side does for it: pull from a peer, load from or
save to the host tier, publish a grant for a decode engine, or report it refused.  It
lives in the process of vLLM's scheduler and reaches the worker side only through the
step's :class:`~kvabi_vllm.connector_meta.KvabiConnectorMetadata`.

A refused request (bad parameters, no grant slot) is failed alone
through vLLM's own path for a failed KV load: the scheduler side reports it as an
asynchronous load, the worker side reports that load failed, and vLLM finishes the
request with an error (``kv_load_failure_policy="fail"``, the default) or computes it
itself (``"recompute"``).  Every table here is per live request and cleaned when it
finishes, or bounded (grants, the host tier, the grants this engine has used).
"""
from __future__ import annotations

import collections
import hashlib
import logging

import numpy as np

from kvabi import KVABIError

from .connector_checksum import tokens_digest
from .connector_config import ConnectorConfig
from .connector_grants import GrantBook
from .connector_host import HostIndex, chain_keys
from .connector_meta import (NULL_BLOCK, Fail, GrantIssue, HostLoad, HostSave,
                             KvabiConnectorMetadata, KvabiHandshakeMetadata, PullWork)
from .connector_params import Entry, ParamsReader

log = logging.getLogger(__name__)

#: refusals kept for inspection (the log has every one)
REFUSALS = 256


class KvabiConnectorScheduler:
    """The scheduler-side object behind :class:`~kvabi_vllm.connector.KvabiConnector`."""

    def __init__(self, config: ConnectorConfig):
        self.config = config
        self._reader = ParamsReader(consumer=config.consumer, windows=config.windows)
        self._handshakes: list[dict[str, str]] = []
        self._grants_msg = ""
        # per live request: what it asked (an Entry), or why it is refused (a str)
        self._entries: dict[str, Entry | str] = {}
        self._book = GrantBook(config.max_held) if config.producer else None
        self._host: HostIndex | None = None
        self._saving: set[str] = set()
        #: (request id, reason) of the latest refusals
        self.refusals: collections.deque = collections.deque(maxlen=REFUSALS)
        self._reset_step()

    def _reset_step(self) -> None:
        self._fails: list[Fail] = []
        self._pulls: list[PullWork] = []
        self._grants: list[GrantIssue] = []
        self._loads: list[HostLoad] = []
        self._evicts: list[bytes] = []
        self._saves: list[HostSave] = []
        self._step_keys: set[bytes] = set()

    def set_xfer_handshake_metadata(self, metadata):
        """Every worker's messages, by tensor-parallel rank: under TP 1 one message per part
        and one for the grant table; under TP M a list of M in each place (rank order),
        from which each decode rank reads the heads it holds."""
        ranks = [metadata[r] for r in sorted(metadata)
                 if isinstance(metadata[r], KvabiHandshakeMetadata)]
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
        if self.config.host_blocks and seeds:
            # one namespace for the engine: every rank's layouts (their shards) in it
            seed = seeds[0] if len(seeds) == 1 else \
                hashlib.blake2b(b"".join(seeds), digest_size=16).digest()
            self._host = HostIndex(len(self.config.groups), self.config.host_blocks, seed)

    # -- where a request enters --------------------------------------------------------
    def _entry(self, request) -> Entry | str:
        e = self._entries.get(request.request_id)
        if e is None:
            try:
                e = self._reader.read(request.kv_transfer_params,
                                      request.prompt_token_ids or [])
            except KVABIError as err:
                e = str(err)
                self._refuse(request.request_id, e)
            self._entries[request.request_id] = e
        return e

    def _refuse(self, req_id: str, reason: str) -> None:
        log.error("KvabiConnector: request %s refused: %s", req_id, reason)
        self.refusals.append((req_id, reason))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        e = self._entry(request)
        if isinstance(e, str):  # refused: an asynchronous load the worker reports failed
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        if e.remote is not None:
            count = e.remote.num_tokens - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        if not e.host:
            return 0, False
        _, k = self._host_hit(request)
        count = k * self.config.block_size - num_computed_tokens
        return (count, False) if count > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request):
        return tuple(range(len(self.config.groups)))

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        req_id = request.request_id
        e = self._entry(request)
        if isinstance(e, str) or e.remote is not None:
            # once: a request vLLM recomputes after the failure computes everything itself
            self._entries[req_id] = Entry(host=False)
        if isinstance(e, str):
            if num_external_tokens > 0:
                self._fails.append(Fail(req_id, e))
            return
        if e.remote is not None:
            if isinstance(request.kv_transfer_params, dict):
                request.kv_transfer_params["do_remote_prefill"] = False
            if num_external_tokens > 0:
                self._schedule_pull(req_id, e.remote, blocks, num_external_tokens)
            return
        if num_external_tokens > 0:
            self._schedule_load(request, blocks, num_external_tokens)

    def _schedule_pull(self, req_id: str, remote, blocks, num_external: int) -> None:
        self._pulls.append(PullWork(req_id, remote, [list(b) for b in blocks.get_block_ids()],
                                    remote.num_tokens - num_external, num_external))

    def build_connector_meta(self, scheduler_output):
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        meta = KvabiConnectorMetadata(fails=self._fails, pulls=self._pulls,
                                      grants=self._grants, loads=self._loads,
                                      evicts=self._evicts, saves=self._saves, idle=idle)
        self._reset_step()
        return meta

    # -- where a request leaves ------------------------------------------------------------
    def request_finished(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        e = self._entries.pop(req_id, None)
        if e is None:  # finished before it was scheduled (aborted): read what it asked
            try:
                e = self._reader.read(request.kv_transfer_params, [])
            except KVABIError:
                e = Entry(host=False)
        if isinstance(e, str):
            return False, None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED)
        cfg = self.config
        if cfg.producer and e.remote_decode:
            if not normal or not self._handshakes or not any(block_ids):
                return False, None
            return self._grant(request, block_ids)
        if self._host is not None and normal and e.host:  # (never a pulled prompt)
            return self._schedule_save(request, block_ids), None
        return False, None

    def _grant(self, request, block_ids):
        """Hold the request's blocks for a decode engine: a grant, and the parameters that
        carry it (or no hold when every grant slot is taken)."""
        cfg = self.config
        n = int(request.num_computed_tokens)
        need = -(-n // cfg.block_size)
        blocks = [list(map(int, b[:need])) for b in block_ids]
        issued = self._book.issue(request.request_id)
        if issued is None:
            self._refuse(request.request_id, f"max_held: {len(self._book)} requests already "
                                             "hold blocks for decode engines (kv_connector_"
                                             "extra_config.max_held); not held")
            return False, None
        slot, nonce = issued
        self._grants.append(GrantIssue(request.request_id, slot, nonce, blocks, n,
                                       tokens_digest(request.all_token_ids[:n])))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": blocks, "remote_num_tokens": n,
            "remote_engine_id": cfg.engine, "remote_request_id": request.request_id,
            "kvabi_handshakes": [{part: list(m) if isinstance(m, list) else m
                                  for part, m in g.items()} for g in self._handshakes],
            "kvabi_grants": list(self._grants_msg) if isinstance(self._grants_msg, list)
            else self._grants_msg,
            "kvabi_grant": {"slot": slot, "nonce": nonce.hex()},
        }

    # -- host tier ------------------------------------------------------------------------
    def _host_keys(self, request, token_ids):
        return chain_keys(self._host.seed, getattr(request, "cache_salt", None), token_ids,
                          self.config.block_size)

    def _host_hit(self, request) -> tuple[tuple, int]:
        """((keys, parents, tokens) of the prompt's full blocks, blocks restorable)."""
        if self._host is None or not len(self._host):
            return ([], [], None), 0
        prompt = request.prompt_token_ids or []
        # the last prompt token is always computed (its logits start the decode)
        chain = self._host_keys(request, prompt[:max(len(prompt) - 1, 0)])
        return chain, self._host.hit(*chain, self.config.need_back)

    def _schedule_load(self, request, blocks, num_external: int) -> None:
        (keys, parents, toks), k = self._host_hit(request)
        first = k - num_external // self.config.block_size
        present = self._host.present(keys[first:k], parents[first:k], toks[first:k])
        ids = blocks.get_block_ids()
        idx, rows = np.arange(first, k), []
        for g, group_ids in enumerate(ids):  # a loop over KV cache groups
            have = np.asarray(group_ids, np.int64)
            ok = (idx < have.size) & present[g]
            row = np.full(idx.size, NULL_BLOCK, np.int64)
            row[ok] = have[idx[ok]]
            rows.append(row.tolist())
        self._loads.append(HostLoad(request.request_id, keys[first:k], rows))

    def _schedule_save(self, request, block_ids) -> bool:
        """Index the request's full blocks the tier does not hold (evicting the least
        recently used), and queue their copy."""
        toks = request.all_token_ids[:request.num_computed_tokens]
        keys, parents, blocks = self._host_keys(request, toks)
        save_keys, rows = [], [[] for _ in self.config.groups]
        for i, key in enumerate(keys):  # a loop over the request's blocks
            if key in self._host:
                continue
            row = [int(b[i]) if i < len(b) else NULL_BLOCK for b in block_ids]
            evicted = self._host.add(key, parents[i], blocks[i],
                                     [b != NULL_BLOCK for b in row], keep=self._step_keys)
            if evicted is None:
                break  # it cannot fit (every entry is being saved this step)
            self._evicts += evicted
            self._step_keys.add(key)
            save_keys.append(key)
            for g, b in enumerate(row):
                rows[g].append(b)
        self._host.touch(keys)
        if not save_keys:
            return False
        self._saves.append(HostSave(request.request_id, save_keys, rows))
        self._saving.add(request.request_id)
        return True

    def has_pending_push_work(self) -> bool:
        return bool(self._saves or self._grants)

    def update_connector_output(self, connector_output):
        for r in connector_output.finished_sending or ():
            self._saving.discard(r)
            if self._book is not None:
                self._book.release(r)

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table (for tests and monitoring)."""
        return {"entries": len(self._entries), "saving": len(self._saving),
                "held": len(self._book) if self._book is not None else 0,
                "host_entries": len(self._host) if self._host is not None else 0,
                "refusals": len(self.refusals)}
