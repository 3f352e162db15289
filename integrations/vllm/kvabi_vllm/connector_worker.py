"""KvabiConnector's worker side: describes the cache vLLM hands it with kvabi layouts,
registers it with NIXL, pulls prompts' KV from a prefill engine, saves to and loads from
the host tier, and tells vLLM which transfers finished (it lives in the worker process,
next to the cache)."""
from __future__ import annotations

import logging
import time
import uuid

import numpy as np

from kvabi import KVABIError
from kvabi.transfer import HostPool, plan_transfer

from .connector_config import ConnectorConfig
from .connector_layout import (IMAGE, engine_writer, group_parts, image_part, interior_of,
                               is_kvabi_backend, kvabi_backend_part, part_cache, split_kv,
                               verify_part)
from .connector_meta import (NOTIFY_PREFIX, NULL_BLOCK, HostLoad, HostSave,
                             KvabiConnectorMetadata, KvabiHandshakeMetadata, Pull, paired_slots)

log = logging.getLogger(__name__)


def host_parts(parts):
    """The parts the host tier keeps: the block image where there is one (whole blocks,
    no relayout), else all."""
    image = [(n, c) for n, c in parts if n.startswith(IMAGE)]
    return image or parts


def block_pairs(src, dst, block_size: int, start: int, num_tokens: int):
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


def matching_parts(parts, theirs, g: int):
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


class KvabiConnectorWorker:
    """The worker-side object behind :class:`~kvabi_vllm.connector.KvabiConnector`."""

    def __init__(self, config: ConnectorConfig, vllm_config):
        self.config = config
        self._vllm_config = vllm_config
        self._caches = []
        self._agent = None
        self._own_handshakes: list[str] = []
        self._peers: dict[str, object] = {}
        self._pools: list[HostPool] = []
        self._host_ids: list[dict[int, int]] = []
        self._recved: set[str] = set()
        self._saved: set[str] = set()
        self._sent: set[str] = set()
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()
        #: per pull: (request id, seconds, regions, bytes, seconds in READs), for benchmarks
        self.pull_stats: list[tuple[str, float, int, int]] = []
        #: host tier: blocks saved and loaded (per group, all parts), for tests and benchmarks
        self.host_stats = {"saved": 0, "loaded": 0}

    def register_kv_caches(self, kv_caches):
        """Describe each KV cache group's memory with kvabi layouts (one, or a K and a V
        part), check them against the engine's own write, register them with NIXL for P/D
        and make the host pools."""
        cfg = self.config
        ctx = self._vllm_config.compilation_config.static_forward_context
        layout_name = self._vllm_config.cache_config.kv_cache_layout
        for gi, group in enumerate(cfg.groups):
            names = [n for n in group.layer_names if n in kv_caches]
            tensors = [kv_caches[n] for n in names]
            backend = getattr(ctx.get(names[0]), "attn_backend", None)
            if is_kvabi_backend(backend):  # the plugin's own layout; its backend's write
                part, cache, write = kvabi_backend_part(tensors, self._vllm_config)
                verify_part(cache, write)
                parts = [(part, cache)]
            else:
                interior = interior_of(backend)
                name = f"vllm.{layout_name}.{interior}.g{gi}"
                parts = [(part, part_cache(tensors, layout, off)) for part, layout, off in
                         group_parts(tensors, interior=interior, name=name)]
                if all(n in ctx for n in names):
                    layers = [ctx[n] for n in names]
                    for part, cache in parts:
                        verify_part(cache, engine_writer(layers, tensors, parts, part))
                image = image_part(tensors, interior=interior, name=name)
                if image is not None:  # bytes of verified parts, seen whole
                    parts.append((image[0], part_cache(tensors, image[1], 0)))
            if [n for n, _ in parts if not n.startswith(IMAGE)] == ["kv"]:
                halves = split_kv(parts[0][1])  # for peers that hold K and V apart
                parts += halves or []
            self._caches.append(parts)
        if cfg.producer or cfg.consumer:
            from kvabi.transfer.nixl import NixlAgent

            self._agent = NixlAgent(f"kvabi-{cfg.engine}-{uuid.uuid4().hex[:8]}",
                                    host=cfg.nixl_host)
            for parts in self._caches:
                for _, c in parts:
                    self._agent.register(c)
            if cfg.producer:
                self._own_handshakes = [
                    {part: self._agent.handshake(c, include_metadata=True) for part, c in parts}
                    for parts in self._caches]
        if cfg.host_blocks:
            for parts in self._caches:
                self._pools.append({part: HostPool(c.layout, cfg.host_blocks,
                                                   preset="cross_layer", framework="torch")
                                    for part, c in host_parts(parts)})
                self._host_ids.append({})
        log.info("KvabiConnector: %d KV cache group(s): %s", len(self._caches), "; ".join(
            f"{c.layout.name} {c.layout.order} N={c.layout.size('N')}"
            for parts in self._caches for _, c in parts))

    def part_layouts(self) -> list[dict[str, str]]:
        """Per KV cache group, each part's layout name (what this engine serves and reads)."""
        return [{part: c.layout.name for part, c in parts} for parts in self._caches]

    def get_handshake_metadata(self):
        if not self._own_handshakes:
            return None
        return KvabiHandshakeMetadata(handshakes=list(self._own_handshakes))

    def start_load_kv(self, meta) -> None:
        """The step's work from the scheduler side: pulls, then host saves and loads."""
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
        bs = self.config.block_size
        try:
            if self._agent is None:
                raise KVABIError("kv_role: this engine is not a kv_consumer (no NIXL agent)")
            if not isinstance(p.handshakes, list) or len(p.handshakes) != len(self._caches):
                got = len(p.handshakes) if isinstance(p.handshakes, list) else "no list"
                raise KVABIError(f"kvabi_handshakes: the peer must serve "
                                 f"{len(self._caches)} KV cache groups, got {got}")
            todo = [(g, part, cache, peer_msg) for g, parts in enumerate(self._caches)
                    for part, cache, peer_msg in matching_parts(parts, p.handshakes[g], g)]
            for i, (g, part, cache, msg) in enumerate(todo):
                peer = self._peer(msg)
                if part.startswith(IMAGE):  # same interior and block size: whole blocks
                    s, d = block_pairs(p.src_blocks[g], p.dst_blocks[g], bs, p.start,
                                       p.num_tokens)
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
                   for part, c in host_parts(parts)}
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
            for part, c in host_parts(parts):
                self._pools[g][part].onload(c, [h[part] for h in held], blocks[keep])
                self._after_load(ld, g, part, c, blocks[keep])

    def _after_load(self, load: HostLoad, group: int, part: str, cache, blocks) -> None:
        """Called once a part of a group's host blocks are back (nothing here)."""

    def get_finished(self, finished_req_ids):
        self._finished_seen |= set(finished_req_ids)
        if self.config.producer and self._agent is not None:
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
        if self._agent is not None:
            self._agent.close()
            self._agent = None
