"""KvabiConnector's scheduler side: which requests pull from a peer, which load from or
save to the host tier, and the parameters a prefill engine hands out (it lives in the
process of vLLM's scheduler, and reaches the worker side only through the step's
:class:`~kvabi_vllm.connector_meta.KvabiConnectorMetadata`)."""
from __future__ import annotations

import numpy as np

from .connector_config import ConnectorConfig
from .connector_meta import (NOTIFY_PREFIX, NULL_BLOCK, HostLoad, HostSave,
                             KvabiConnectorMetadata, KvabiHandshakeMetadata, Pull, prefix_keys,
                             usable_prefix)


def _host_on(request) -> bool:
    return (request.kv_transfer_params or {}).get("kvabi_host", True) is not False


class KvabiConnectorScheduler:
    """The scheduler-side object behind :class:`~kvabi_vllm.connector.KvabiConnector`."""

    def __init__(self, config: ConnectorConfig):
        self.config = config
        self._handshakes: list[dict[str, str]] = []
        self._pulls: dict[str, Pull] = {}
        self._saves: list[HostSave] = []
        self._loads: list[HostLoad] = []
        self._saving: set[str] = set()
        # host tier index: key -> which groups hold it; host blocks used per group
        self._index: dict[int, tuple[bool, ...]] = {}
        self._host_used = np.zeros(len(config.groups), np.int64)

    def set_xfer_handshake_metadata(self, metadata):
        for m in metadata.values():
            if isinstance(m, KvabiHandshakeMetadata):
                self._handshakes = list(m.handshakes)

    def _remote_prefill(self, request) -> dict | None:
        params = request.kv_transfer_params
        if self.config.consumer and params and params.get("do_remote_prefill") and \
                params.get("kvabi_handshakes"):
            return params
        return None

    def _host_hit(self, request) -> tuple[list[int], int]:
        """(keys of the prompt's full blocks, blocks restorable from the host tier)."""
        if not self.config.host_blocks or not self._index or not _host_on(request):
            return [], 0
        prompt = request.prompt_token_ids or []
        # the last prompt token is always computed (its logits start the decode)
        keys = prefix_keys(prompt[:max(len(prompt) - 1, 0)], self.config.block_size)
        if not keys:
            return keys, 0
        none = (False,) * len(self.config.groups)
        present = np.array([self._index.get(k, none) for k in keys], bool).T
        return keys, usable_prefix(present, self.config.need_back)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._remote_prefill(request) is not None:
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        _, k = self._host_hit(request)
        count = k * self.config.block_size - num_computed_tokens
        return (count, False) if count > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request):
        return tuple(range(len(self.config.groups)))

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = self._remote_prefill(request)
        if params is not None:
            params["do_remote_prefill"] = False
            if num_external_tokens > 0:
                n = len(request.prompt_token_ids)
                self._pulls[request.request_id] = Pull(
                    req_id=request.request_id, handshakes=list(params["kvabi_handshakes"]),
                    src_blocks=[list(b) for b in params["remote_block_ids"]],
                    dst_blocks=[list(b) for b in blocks.get_block_ids()],
                    start=n - num_external_tokens, num_tokens=num_external_tokens,
                    notify=str(params["kvabi_notify"]))
            return
        if num_external_tokens <= 0:
            return
        bs = self.config.block_size
        keys, k = self._host_hit(request)
        first = k - num_external_tokens // bs
        ids = blocks.get_block_ids()
        none = (False,) * len(self.config.groups)
        per_group = []
        for g, group_ids in enumerate(ids):
            row = []
            for i in range(first, k):
                held = self._index.get(keys[i], none)[g]
                row.append(group_ids[i] if i < len(group_ids) and held else NULL_BLOCK)
            per_group.append(row)
        self._loads.append(HostLoad(request.request_id, keys[first:k], per_group))

    def build_connector_meta(self, scheduler_output):
        meta = KvabiConnectorMetadata(pulls=list(self._pulls.values()), saves=self._saves,
                                      loads=self._loads)
        self._pulls, self._saves, self._loads = {}, [], []
        return meta

    def request_finished(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        cfg = self.config
        params = request.kv_transfer_params or {}
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED)
        if cfg.producer and params.get("do_remote_decode"):
            if not normal or not self._handshakes or not any(block_ids):
                return False, None
            return True, {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(map(int, b)) for b in block_ids],
                "remote_num_tokens": int(request.num_computed_tokens),
                "remote_request_id": request.request_id,
                "kvabi_handshakes": list(self._handshakes),
                "kvabi_notify": f"{NOTIFY_PREFIX}{cfg.engine}:{request.request_id}",
            }
        if cfg.host_blocks and normal and _host_on(request):
            return self._schedule_save(request, block_ids), None
        return False, None

    def _schedule_save(self, request, block_ids) -> bool:
        cfg = self.config
        toks = request.all_token_ids[:request.num_computed_tokens]
        keys = prefix_keys(toks, cfg.block_size)
        save_keys, rows = [], [[] for _ in cfg.groups]
        for i, key in enumerate(keys):
            if key in self._index:
                continue
            row = [int(b[i]) if i < len(b) else NULL_BLOCK for b in block_ids]
            held = np.array([b != NULL_BLOCK for b in row])
            if np.any(self._host_used + held > cfg.host_blocks):
                break  # host tier full (no eviction)
            self._host_used += held
            self._index[key] = tuple(bool(h) for h in held)
            save_keys.append(key)
            for g, b in enumerate(row):
                rows[g].append(b)
        if not save_keys:
            return False
        self._saves.append(HostSave(request.request_id, save_keys, rows))
        self._saving.add(request.request_id)
        return True

    def has_pending_push_work(self) -> bool:
        return bool(self._saves)

    def update_connector_output(self, connector_output):
        for r in connector_output.finished_sending or ():
            self._saving.discard(r)
