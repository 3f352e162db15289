"""``KvabiConnector``: a vLLM KV connector that moves KV between engines whose caches differ
in layout and block size, and keeps a host tier.

Load it with ``KVTransferConfig(kv_connector="KvabiConnector",
kv_connector_module_path="kvabi_vllm.connector", kv_role=...)``:

- ``kv_producer`` (prefill engine): a request sent with ``kv_transfer_params=
  {"do_remote_decode": True}`` keeps its blocks when it finishes; its output's
  ``kv_transfer_params`` carry the block ids and this engine's kvabi handshakes (per KV cache
  group, one per *part*: the layout descriptor, the registered planes, the NIXL agent's
  metadata).
- ``kv_consumer`` (decode engine): a request carrying those params reads the prompt's KV
  with one NIXL READ per part, planned by ``kvabi.transfer`` from the two layouts (relayout
  included), after validating the peer's handshakes as untrusted input; the last READ's
  notification frees the producer's blocks.

Parts (``connector_layout``): a cache whose K and V share one layout serves it as ``kv``;
vLLM's CPU backend, whose keys are stored transposed, serves ``k`` and ``v``; every cache
with one ``kv`` layout also serves its ``k`` and ``v`` halves, and a cache with dense
block-heads an ``image`` (a block's bytes as one run) for peers of the very same format.
The decode side reads the image if both serve the same, else ``kv``, else ``k`` and ``v``.
- ``kv_connector_extra_config={"host_blocks": N}`` (any role): a host tier on
  ``kvabi.transfer.HostPool`` (cross-layer blocks): full blocks of a finished request are
  saved, and a later request whose prompt starts with them loads them instead of computing.
  Sliding-window groups keep (and need) only the blocks inside the window.  A request
  with ``kv_transfer_params={"kvabi_host": False}`` neither loads nor saves.

The layouts of the cache vLLM allocates are derived from its views (or taken from the kvabi
attention-backend plugin) and checked against the engine's own cache write at start with
``kvabi.probe.verify_layout``: a mismatch stops the engine before any transfer.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from kvabi import KVABIError
from kvabi.transfer import HostPool, plan_transfer
from kvabi.transfer.kv_scales import check_same_scales
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorHandshakeMetadata,
                                                               KVConnectorRole, SupportsHMA)

from .connector_layout import (IMAGE, engine_writer, group_parts, image_part, interior_of,
                               is_kvabi_backend, kvabi_backend_part, part_cache, split_kv,
                               verify_part)
from .connector_meta import (NULL_BLOCK, HostLoad, HostSave, KvabiConnectorMetadata, Pull,
                             paired_slots, prefix_keys, usable_prefix)
from .kv_quant import FP8

log = logging.getLogger(__name__)

NOTIFY_PREFIX = "kvabi.pull:"


@dataclass
class KvabiHandshakeMetadata(KVConnectorHandshakeMetadata):
    """The producer worker's handshake messages (JSON), per KV cache group one per part."""
    handshakes: list[dict[str, str]] = field(default_factory=list)


def _window_blocks(spec, block_size: int) -> int | None:
    """Blocks a sliding-window group needs before a block boundary (None: all of them):
    the first token computed after it attends back ``window - 1`` tokens."""
    w = getattr(spec, "sliding_window", None)
    return None if not w else max(-(-(int(w) - 1) // block_size), 1)


def _host_parts(parts):
    """The parts the host tier keeps: the block image where there is one (whole blocks,
    no relayout), else all."""
    image = [(n, c) for n, c in parts if n.startswith(IMAGE)]
    return image or parts


def _block_pairs(src, dst, block_size: int, start: int, num_tokens: int):
    """(source, destination) ids of the blocks holding positions ``start ..
    start + num_tokens - 1`` on both sides (equal block sizes; null on either side: left
    out).  Whole blocks move: slots past the last token hold nothing the destination reads
    before writing them itself."""
    lo, hi = start // block_size, -(-(start + num_tokens) // block_size)
    s, d = np.asarray(src[lo:hi], np.int64), np.asarray(dst[lo:hi], np.int64)
    n = min(s.size, d.size)
    s, d = s[:n], d[:n]
    keep = (s != NULL_BLOCK) & (d != NULL_BLOCK)
    return s[keep], d[keep]


def _matching_parts(parts, theirs, g: int):
    """[(part, own cache, peer's message)] to pull for group ``g``: the block image when the
    peer serves the same one (same interior, block size, head dim), else every other part,
    which the peer must serve too."""
    if not isinstance(theirs, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in theirs.items()):
        raise KVABIError(f"kvabi_handshakes[{g}]: must be an object of part -> message")
    for name, cache in parts:
        if name.startswith(IMAGE) and name in theirs:
            return [(name, cache, theirs[name])]
    mine = dict((n, c) for n, c in parts if not n.startswith(IMAGE))
    served = sorted(k for k in theirs if not k.startswith(IMAGE))
    for want in (("kv",), ("k", "v")):  # one K/V layout each, else keys and values apart
        if all(w in mine and w in theirs for w in want):
            return [(w, mine[w], theirs[w]) for w in want]
    raise KVABIError(f"kvabi_handshakes[{g}]: the peer serves parts {served}, this engine "
                     f"{sorted(mine)}: no pair to copy between")


def _host_on(request) -> bool:
    return (request.kv_transfer_params or {}).get("kvabi_host", True) is not False


class KvabiConnector(KVConnectorBase_V1, SupportsHMA):
    """P/D over NIXL across layouts and block sizes, and a host tier (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        # P/D needs one side each; kv_both engines use the host tier only
        self._producer, self._consumer = cfg.kv_role == "kv_producer", cfg.kv_role == "kv_consumer"
        self._host_blocks = int(extra.get("host_blocks", 0))
        self._nixl_host = str(extra.get("nixl_host", "127.0.0.1"))
        self._engine = cfg.engine_id or uuid.uuid4().hex[:8]
        self._block_size = int(vllm_config.cache_config.block_size)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self._groups = groups
        # per group: how many blocks before a position it needs (full attention: all)
        self._need_back = np.array([
            _window_blocks(g.kv_cache_spec, self._block_size) or 1 << 40 for g in groups],
            np.int64)
        if role == KVConnectorRole.SCHEDULER:
            self._handshakes: list[dict[str, str]] = []
            self._pulls: dict[str, Pull] = {}
            self._saves: list[HostSave] = []
            self._loads: list[HostLoad] = []
            self._saving: set[str] = set()
            # host tier index: key -> which groups hold it; host blocks used per group
            self._index: dict[int, tuple[bool, ...]] = {}
            self._host_used = np.zeros(len(groups), np.int64)
        else:
            self._caches = []
            self._scales: list = []  # per group: per layer (k_scale, v_scale), or None
            self._agent = None
            self._own_handshakes: list[str] = []
            self._peers: dict[str, object] = {}
            self._pools: list[HostPool] = []
            self._host_ids: list[dict[int, int]] = []
            self._recved: set[str] = set()
            self._saved: set[str] = set()
            self._notified: dict[str, int] = {}
            self._sent: set[str] = set()
            self._finished_seen: set[str] = set()
            self._load_errors: set[int] = set()
            #: per pull: (request id, seconds, regions, bytes, seconds in READs), for benchmarks
            self.pull_stats: list[tuple[str, float, int, int]] = []
            #: host tier: blocks saved and loaded (per group, all parts), for tests and benchmarks
            self.host_stats = {"saved": 0, "loaded": 0}

    # ================================ worker side ================================
    def register_kv_caches(self, kv_caches):
        """Describe each KV cache group's memory with kvabi layouts (one, or a K and a V
        part), check them against the engine's own write, register them with NIXL for P/D
        and make the host pools."""
        ctx = self._vllm_config.compilation_config.static_forward_context
        layout_name = self._vllm_config.cache_config.kv_cache_layout
        kv_dtype = FP8.get(self._vllm_config.cache_config.cache_dtype)  # fp8: codes
        for gi, group in enumerate(self._groups):
            names = [n for n in group.layer_names if n in kv_caches]
            tensors = [kv_caches[n] for n in names]
            # per-tensor scales are layer state: they travel in the handshake
            self._scales.append(None if kv_dtype is None else [
                (ctx[n]._k_scale_float, ctx[n]._v_scale_float) for n in names])
            backend = getattr(ctx.get(names[0]), "attn_backend", None)
            if is_kvabi_backend(backend):  # the plugin's own layout; its backend's write
                part, cache, write = kvabi_backend_part(tensors, self._vllm_config)
                verify_part(cache, write)
                parts, interior = [(part, cache)], cache.layout.name
            else:
                interior = interior_of(backend)
                name = f"vllm.{layout_name}.{interior}.g{gi}"
                parts = [(part, part_cache(tensors, layout, off)) for part, layout, off in
                         group_parts(tensors, interior=interior, name=name, dtype=kv_dtype)]
                if all(n in ctx for n in names):
                    layers = [ctx[n] for n in names]
                    for part, cache in parts:
                        verify_part(cache, engine_writer(layers, tensors, parts, part))
                image = image_part(tensors, interior=interior, name=name, dtype=kv_dtype)
                if image is not None:  # bytes of verified parts, seen whole
                    parts.append((image[0], part_cache(tensors, image[1], 0)))
            if [n for n, _ in parts if not n.startswith(IMAGE)] == ["kv"]:
                halves = split_kv(parts[0][1])  # for peers that hold K and V apart
                parts += halves or []
            self._caches.append(parts)
        if self._producer or self._consumer:
            from kvabi.transfer.nixl import NixlAgent

            self._agent = NixlAgent(f"kvabi-{self._engine}-{uuid.uuid4().hex[:8]}",
                                    host=self._nixl_host)
            for parts in self._caches:
                for _, c in parts:
                    self._agent.register(c)
            if self._producer:
                self._own_handshakes = [
                    {part: self._agent.handshake(c, include_metadata=True, kv_scales=sc)
                     for part, c in parts} for parts, sc in zip(self._caches, self._scales)]
        if self._host_blocks:
            for parts in self._caches:
                self._pools.append({part: HostPool(c.layout, self._host_blocks,
                                                   preset="cross_layer", framework="torch")
                                    for part, c in _host_parts(parts)})
                self._host_ids.append({})
        log.info("KvabiConnector: %d KV cache group(s): %s", len(self._caches), "; ".join(
            f"{c.layout.name} {c.layout.order or c.layout.component_names} "
            f"N={c.layout.size('N')}"
            for parts in self._caches for _, c in parts))

    def part_layouts(self) -> list[dict[str, str]]:
        """Per KV cache group, each part's layout name (what this engine serves and reads)."""
        return [{part: c.layout.name for part, c in parts} for parts in self._caches]

    def get_handshake_metadata(self):
        if not self._own_handshakes:
            return None
        return KvabiHandshakeMetadata(handshakes=list(self._own_handshakes))

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvabiConnectorMetadata):
            return
        for p in meta.pulls:
            self._pull(p)
        for s in meta.saves:
            self._save(s)
        for ld in meta.loads:
            self._load(ld)

    def _peer(self, message: str):
        peer = self._peers.get(message)
        if peer is None:
            peer = self._peers[message] = self._agent.connect(message)
        return peer

    def _pull(self, p: Pull) -> None:
        t0, regions, nbytes, read_s = time.perf_counter(), 0, 0, 0.0
        try:
            if self._agent is None:
                raise KVABIError("kv_role: this engine is not a kv_consumer (no NIXL agent)")
            if not isinstance(p.handshakes, list) or len(p.handshakes) != len(self._caches):
                got = len(p.handshakes) if isinstance(p.handshakes, list) else "no list"
                raise KVABIError(f"kvabi_handshakes: the peer must serve "
                                 f"{len(self._caches)} KV cache groups, got {got}")
            todo = [(g, part, cache, peer_msg) for g, parts in enumerate(self._caches)
                    for part, cache, peer_msg in _matching_parts(parts, p.handshakes[g], g)]
            for i, (g, part, cache, msg) in enumerate(todo):
                peer = self._peer(msg)
                check_same_scales(self._scales[g], peer.handshake.kv_scales,
                                  f"kvabi_handshakes[{g}].{part}.kv_scales")
                if part.startswith(IMAGE):  # same interior and block size: whole blocks
                    s, d = _block_pairs(p.src_blocks[g], p.dst_blocks[g], self._block_size,
                                        p.start, p.num_tokens)
                else:
                    s, d = paired_slots(p.src_blocks[g], peer.layout.size("N"),
                                        p.dst_blocks[g], cache.layout.size("N"), p.start,
                                        p.num_tokens)
                plan = plan_transfer(peer.layout, cache.layout, s, d)
                r0 = time.perf_counter()
                # the last READ's notification tells the peer it may free the blocks
                last = i == len(todo) - 1
                self._agent.pull_plan(peer, plan, cache, notify=(
                    p.notify if last else f"kvabi.part:{p.notify}:{i}").encode())
                read_s += time.perf_counter() - r0
                regions, nbytes = regions + len(plan), nbytes + plan.nbytes
                self._after_pull(p, g, part, cache, d)
            self.pull_stats.append((p.req_id, time.perf_counter() - t0, regions, nbytes,
                                    read_s))
        except KVABIError as e:
            log.error("KvabiConnector: pull of request %s failed: %s", p.req_id, e)
            for blocks in p.dst_blocks:
                self._load_errors.update(int(b) for b in blocks if b != NULL_BLOCK)
        self._recved.add(p.req_id)

    def _after_pull(self, pull: Pull, group: int, part: str, cache, dst_slots) -> None:
        """Called once a part of a group has arrived (a place for checks; nothing here)."""

    def _save(self, s: HostSave) -> None:
        keys = np.asarray(s.keys, np.int64)
        for g, parts in enumerate(self._caches):
            blocks = np.asarray(s.blocks[g], np.int64)
            keep = blocks != NULL_BLOCK
            if not keep.any():
                continue
            ids = {part: self._pools[g][part].offload(c, blocks[keep])
                   for part, c in _host_parts(parts)}
            self.host_stats["saved"] += int(keep.sum())
            for j, key in enumerate(keys[keep].tolist()):
                self._host_ids[g][key] = {part: int(i[j]) for part, i in ids.items()}
        self._saved.add(s.req_id)

    def _load(self, ld: HostLoad) -> None:
        keys = np.asarray(ld.keys, np.int64)
        for g, parts in enumerate(self._caches):
            blocks = np.asarray(ld.blocks[g], np.int64)
            keep = blocks != NULL_BLOCK
            if not keep.any():
                continue
            held = [self._host_ids[g][k] for k in keys[keep].tolist()]
            self.host_stats["loaded"] += int(keep.sum())
            for part, c in _host_parts(parts):
                self._pools[g][part].onload(c, [h[part] for h in held], blocks[keep])
                self._after_load(ld, g, part, c, blocks[keep])

    def _after_load(self, load: HostLoad, group: int, part: str, cache, blocks) -> None:
        """Called once a part of a group's host blocks are back (nothing here)."""

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        self._finished_seen |= set(finished_req_ids)
        if self._producer and self._agent is not None:
            self._poll_notifications()
        done_send = {r for r in self._sent | self._saved if r in self._finished_seen}
        self._sent -= done_send
        self._saved -= done_send
        self._finished_seen -= done_send
        recved, self._recved = self._recved, set()
        return (done_send or None), (recved or None)

    def _poll_notifications(self) -> None:
        while True:
            try:
                _, msg = self._agent.wait_notification(NOTIFY_PREFIX.encode(), timeout=1e-4)
            except KVABIError:
                return
            rest = msg.decode(errors="replace")[len(NOTIFY_PREFIX):]
            self._sent.add(rest.split(":", 1)[1] if ":" in rest else rest)

    def get_block_ids_with_load_errors(self):
        errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self):
        if getattr(self, "_agent", None) is not None:
            self._agent.close()
            self._agent = None

    # ================================ scheduler side ================================
    def set_xfer_handshake_metadata(self, metadata):
        for m in metadata.values():
            if isinstance(m, KvabiHandshakeMetadata):
                self._handshakes = list(m.handshakes)

    def _remote_prefill(self, request) -> dict | None:
        params = request.kv_transfer_params
        if self._consumer and params and params.get("do_remote_prefill") and \
                params.get("kvabi_handshakes"):
            return params
        return None

    def _host_hit(self, request) -> tuple[list[int], int]:
        """(keys of the prompt's full blocks, blocks restorable from the host tier)."""
        if not self._host_blocks or not self._index or not _host_on(request):
            return [], 0
        prompt = request.prompt_token_ids or []
        # the last prompt token is always computed (its logits start the decode)
        keys = prefix_keys(prompt[:max(len(prompt) - 1, 0)], self._block_size)
        if not keys:
            return keys, 0
        none = (False,) * len(self._groups)
        present = np.array([self._index.get(k, none) for k in keys], bool).T
        return keys, usable_prefix(present, self._need_back)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._remote_prefill(request) is not None:
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        _, k = self._host_hit(request)
        count = k * self._block_size - num_computed_tokens
        return (count, False) if count > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request):
        return tuple(range(len(self._groups)))

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
        keys, k = self._host_hit(request)
        first = k - num_external_tokens // self._block_size
        ids = blocks.get_block_ids()
        none = (False,) * len(self._groups)
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
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params or {}
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED)
        if self._producer and params.get("do_remote_decode"):
            if not normal or not self._handshakes or not any(block_ids):
                return False, None
            return True, {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(map(int, b)) for b in block_ids],
                "remote_num_tokens": int(request.num_computed_tokens),
                "remote_request_id": request.request_id,
                "kvabi_handshakes": list(self._handshakes),
                "kvabi_notify": f"{NOTIFY_PREFIX}{self._engine}:{request.request_id}",
            }
        if self._host_blocks and normal and _host_on(request):
            return self._schedule_save(request, block_ids), None
        return False, None

    def _schedule_save(self, request, block_ids) -> bool:
        toks = request.all_token_ids[:request.num_computed_tokens]
        keys = prefix_keys(toks, self._block_size)
        save_keys, rows = [], [[] for _ in self._groups]
        for i, key in enumerate(keys):
            if key in self._index:
                continue
            row = [int(b[i]) if i < len(b) else NULL_BLOCK for b in block_ids]
            held = np.array([b != NULL_BLOCK for b in row])
            if np.any(self._host_used + held > self._host_blocks):
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
        return bool(self._role == KVConnectorRole.SCHEDULER and self._saves)

    def update_connector_output(self, connector_output):
        for r in connector_output.finished_sending or ():
            self._saving.discard(r)
