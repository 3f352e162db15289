"""KvabiConnector's worker side: describes the cache vLLM hands it with kvabi layouts,
registers it with NIXL, publishes grants (prefill side) and pulls prompts' KV from a
prefill engine off the engine's thread (decode side), saves to and loads from the host
tier, and tells vLLM which transfers finished or failed (it lives in the worker process,
next to the cache).

A pull (:meth:`KvabiConnectorWorker._pull`, on a pull thread) believes nothing its
parameters claim until the producer's own grant record confirms it: the record must hold
this request's grant nonce, live, for this request's prompt tokens and block ids, and the
fingerprint of each part's layout and the digest of its planes must equal those of the
handshakes it was given; after the READs every token's checksum must equal the
producer's.  Only then does vLLM learn that the load finished; otherwise it learns that it
failed, with the reason in the log and in :attr:`KvabiConnectorWorker.refusals`.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
import uuid

import numpy as np

from kvabi import KVABIError, KVCache
from kvabi.transfer import HostPool, plan_block_transfer, plan_transfer
from kvabi.transfer.handshake import parse_handshake
from kvabi.transfer.kv_scales import check_same_scales

from .connector_checksum import layout_fingerprint, planes_digest, token_checksums
from .connector_config import ConnectorConfig
from .connector_fixes import with_fix
from .connector_grants import (LIVE, STATES, GrantRecord, GrantTable, PartClaim, decode,
                               notify_message, parse_notification, read_header, record_bytes,
                               table_layout)
from .connector_layout import (IMAGE, engine_writer, group_parts, image_part, interior_of,
                               is_kvabi_backend, kvabi_backend_part, part_cache, split_kv,
                               verify_part)
from .connector_meta import (NULL_BLOCK, HostLoad, HostSave, KvabiConnectorMetadata,
                             KvabiHandshakeMetadata, PullWork, paired_slots, token_slots)
from .connector_pulls import Puller
from .connector_stats import KvabiConnectorStats
from .kv_quant import FP8

log = logging.getLogger(__name__)

#: largest grant record a decode engine reads from a producer (bytes)
MAX_RECORD = 64 * 2**20
#: seconds between reads of a grant record the producer has not written yet
GRANT_POLL_S = 0.005
#: grants this engine pulled, remembered to refuse a replay to it
USED_GRANTS = 65536


def host_parts(parts):
    """The parts the host tier keeps: the block image where there is one (whole blocks,
    no relayout), else all."""
    image = [(n, c) for n, c in parts if n.startswith(IMAGE)]
    return image or parts


def token_parts(parts):
    """(key view, value view) per layer of a group, from its token parts (``kv``, or
    ``k`` and ``v``), for checksums."""
    by = dict(parts)
    if "kv" in by:
        c = by["kv"]
        return [(c.kv_view(i, 0), c.kv_view(i, 1)) for i in range(c.layout.num_layers)]
    k, v = by["k"], by["v"]
    return [(k.kv_view(i, 0), v.kv_view(i, 0)) for i in range(k.layout.num_layers)]


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
        self._scales: list = []  # per group: per layer (k_scale, v_scale), or None
        self._agent = None
        self._own_handshakes: list[dict[str, str]] = []
        self._grants: GrantTable | None = None
        self._grants_msg = ""
        self._claims: list[tuple[PartClaim, ...]] = []
        # digest of a message -> [connected Peer, pulls using it]; pull threads share it
        self._peers = collections.OrderedDict()
        self._peers_lock = threading.Lock()
        self._used = collections.OrderedDict()   # grant nonces pulled here -> request id
        self._used_lock = threading.Lock()
        self._puller = Puller(self._pull, config.max_pulls, config.pull_timeout_s,
                              config.pull_threads) if config.consumer else None
        self._pools: list = []
        self._host_ids: list[dict[bytes, dict]] = []
        self._host_seed = b""
        self._refused: list[tuple[str, str]] = []   # refused where they entered
        self._saved: set[str] = set()                # host saves done, blocks not yet freed
        self._sent: set[str] = set()                 # grants read, blocks not yet freed
        self._finished: set[str] = set()             # of those, ids vLLM said finished
        #: per pull: (request id, seconds, regions, bytes, seconds in READs, seconds to the
        #: grant record checked, seconds of the checksums), for benchmarks
        self.pull_stats: collections.deque = collections.deque(maxlen=4096)
        #: host tier: blocks saved and loaded (per group, all parts), for tests and benchmarks
        self.host_stats = {"saved": 0, "loaded": 0, "evicted": 0}
        #: notifications a producer ignored (not a live grant's slot and nonce)
        self.ignored_notifications = 0
        #: (request id, reason) of the latest failed loads
        self.refusals: collections.deque = collections.deque(maxlen=256)
        #: this interval's pulls and refusals, drained by vLLM (kv_connector_stats); pull
        #: threads queue their figures, the engine thread moves them in
        self.transfer_stats = KvabiConnectorStats()
        self._stat_pulls: collections.deque = collections.deque(maxlen=4096)

    # -- start ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        """Describe each KV cache group's memory with kvabi layouts (one, or a K and a V
        part), check them against the engine's own write, register them with NIXL for P/D
        and make the host pools."""
        cfg = self.config
        ctx = self._vllm_config.compilation_config.static_forward_context
        layout_name = self._vllm_config.cache_config.kv_cache_layout
        kv_dtype = FP8.get(self._vllm_config.cache_config.cache_dtype)  # fp8: codes
        for gi, group in enumerate(cfg.groups):
            names = [n for n in group.layer_names if n in kv_caches]
            tensors = [kv_caches[n] for n in names]
            # per-tensor scales are layer state: they travel in the handshake
            self._scales.append(None if kv_dtype is None else [
                (ctx[n]._k_scale_float, ctx[n]._v_scale_float) for n in names])
            backend = getattr(ctx.get(names[0]), "attn_backend", None)
            if is_kvabi_backend(backend):  # the plugin's own layout; its backend's write
                part, cache, write = kvabi_backend_part(tensors, self._vllm_config)
                verify_part(cache, write)
                parts = [(part, cache)]
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
        if cfg.producer or cfg.consumer:
            self._start_nixl()
        if cfg.host_blocks:
            seed = hashlib.blake2b(cfg.model.encode(), digest_size=16)
            for parts in self._caches:
                self._pools.append({part: HostPool(c.layout, cfg.host_blocks,
                                                   preset="cross_layer", framework="torch")
                                    for part, c in host_parts(parts)})
                self._host_ids.append({})
                for part, c in host_parts(parts):
                    seed.update(part.encode() + layout_fingerprint(c.layout))
            self._host_seed = seed.digest()
        log.info("KvabiConnector: %d KV cache group(s): %s", len(self._caches), "; ".join(
            f"{c.layout.name} {c.layout.order or c.layout.component_names} "
            f"N={c.layout.size('N')}"
            for parts in self._caches for _, c in parts))

    def _start_nixl(self) -> None:
        from kvabi.transfer.nixl import NixlAgent

        cfg = self.config
        self._agent = NixlAgent(f"kvabi-{cfg.engine}-{uuid.uuid4().hex[:8]}",
                                host=cfg.nixl_host)
        for parts in self._caches:
            for _, c in parts:
                self._agent.register(c)
        if not cfg.producer:
            return
        self._own_handshakes = [
            {part: self._agent.handshake(c, include_metadata=True, kv_scales=sc)
             for part, c in parts} for parts, sc in zip(self._caches, self._scales)]
        self._claims = [tuple(PartClaim(part, layout_fingerprint(c.layout),
                                        planes_digest(parse_handshake(msgs[part])))
                              for part, c in parts)
                        for parts, msgs in zip(self._caches, self._own_handshakes)]
        size = record_bytes(len(self._caches), max(cfg.max_model_len, 1), cfg.block_size)
        self._grants = GrantTable(cfg.max_held, size)
        self._agent.register(self._grants.cache)
        self._grants_msg = self._agent.handshake(self._grants.cache, include_metadata=True)

    def part_layouts(self) -> list[dict[str, str]]:
        """Per KV cache group, each part's layout name (what this engine serves and reads)."""
        return [{part: c.layout.name for part, c in parts} for parts in self._caches]

    def get_handshake_metadata(self):
        if not (self._own_handshakes or self._host_seed):
            return None
        return KvabiHandshakeMetadata(handshakes=list(self._own_handshakes),
                                      grants=self._grants_msg, host_seed=self._host_seed)

    # -- each step ---------------------------------------------------------------------------
    def start_load_kv(self, meta) -> None:
        """The step's work from the scheduler side, in its order."""
        if not isinstance(meta, KvabiConnectorMetadata):
            return
        self._refused += [(f.req_id, f.reason) for f in meta.fails]
        for p in meta.pulls:
            why = self._puller.submit(p.req_id, p) if self._puller is not None else \
                "kv_role: this engine is not a kv_consumer"
            if why is not None:
                self._refused.append((p.req_id, why))
        for g in meta.grants:
            self._publish(g)
        for ld in meta.loads:
            self._load(ld)
        for key in meta.evicts:
            self._evict(key)
        for s in meta.saves:
            self._save(s)

    def get_transfer_results(self, finished_req_ids):
        """(finished sending, finished receiving, failed receiving) request ids: grants
        read by a decode engine or expired, host saves done; pulls that ended (a failed
        one is in both receiving sets, as vLLM expects)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import \
            KVConnectorTransferResults

        if self._grants is not None:
            self._poll_notifications()
            self._sent.update(self._grants.expire())
        # vLLM frees blocks for ids it has told this side finished (this step or before);
        # ids of no interest here are not kept
        pending = self._sent | self._saved
        held = {r for r, _, _ in self._grants.live.values()} if self._grants else set()
        self._finished |= set(finished_req_ids) & (pending | held)
        done = pending & self._finished
        self._finished -= done
        self._sent -= done
        self._saved -= done
        ended = self._puller.collect() if self._puller is not None else []
        ended += [(r, why) for r, why in self._refused]
        self._refused = []
        failed = set()
        for req_id, why in ended:
            if why is not None:
                log.error("KvabiConnector: load of request %s failed: %s", req_id,
                          with_fix(str(why)))
                self.refusals.append((req_id, why))
                self.transfer_stats.record_refusal(str(why))
                failed.add(req_id)
        return KVConnectorTransferResults(finished_sending=done,
                                          finished_recving={r for r, _ in ended},
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids):
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def kv_connector_stats(self) -> KvabiConnectorStats | None:
        """This interval's transfer figures (None when there are none)."""
        while self._stat_pulls:
            secs, read_s, nbytes, regions, relayout = self._stat_pulls.popleft()
            self.transfer_stats.record_pull(secs, read_s, nbytes, regions, relayout=relayout)
        return None if self.transfer_stats.is_empty() else self.transfer_stats.take()

    def get_block_ids_with_load_errors(self):
        return set()  # failed loads are reported per request (failed_recving)

    # -- prefill side: grants -------------------------------------------------------------
    def _publish(self, g) -> None:
        """Write grant ``g``'s record: what the producer holds, and a checksum per token."""
        bs = self.config.block_size
        sums = [token_checksums(token_parts(parts), token_slots(b, bs, 0, g.num_tokens), bs)
                for parts, b in zip(self._caches, g.blocks)]
        record = GrantRecord(LIVE, g.nonce, g.num_tokens, g.tokens,
                             tuple(np.asarray(b, np.int64) for b in g.blocks),
                             tuple(self._claims), tuple(sums))
        self._grants.write(g.slot, record, g.req_id,
                           time.monotonic() + self.config.hold_timeout_s)

    def _poll_notifications(self) -> None:
        for sender, msg in self._agent.drain_notifications():
            got = parse_notification(msg)
            req_id = None if got is None else self._grants.release(*got)
            if req_id is not None:
                self._sent.add(req_id)
            elif msg:  # empty: a grant record read
                self.ignored_notifications += 1
                if self.ignored_notifications <= 16 or self.ignored_notifications % 1024 == 0:
                    log.warning("KvabiConnector: ignored a notification from %s that names "
                                "no live grant (%d so far)", sender,
                                self.ignored_notifications)

    # -- decode side: pulls (on a pull thread) ---------------------------------------------
    def _peer(self, message: str, job):
        """The peer of a handshake message, connected once and shared by the pull threads
        (held by ``job`` until :meth:`_release_peers`); the least recently used peers no
        pull holds are forgotten past ``max_peers``."""
        key = hashlib.blake2b(message.encode(), digest_size=16).digest()
        with self._peers_lock:
            held = self._peers.get(key)
            if held is not None:
                held[1] += 1
                self._peers.move_to_end(key)
        if held is None:
            peer = self._agent.connect(message, timeout=job.left())  # outside the lock
            with self._peers_lock:
                held = self._peers.get(key)
                if held is None:
                    held = self._peers[key] = [peer, 1]
                else:  # another thread connected it meanwhile
                    held[1] += 1
                    self._agent.disconnect(peer)
                self._evict_peers()
        job.peers.append(key)
        return held[0]

    def _evict_peers(self) -> None:
        idle = [k for k, (_, n) in self._peers.items() if n == 0]
        for k in idle[:max(len(self._peers) - self.config.max_peers, 0)]:
            self._agent.disconnect(self._peers.pop(k)[0])

    def _release_peers(self, job) -> None:
        with self._peers_lock:
            for key in job.peers:
                if key in self._peers:
                    self._peers[key][1] -= 1
            job.peers = []
            self._evict_peers()

    def _read_grant(self, peer, remote, job) -> GrantRecord:
        """The producer's record for this grant, once it is written (a grant is written the
        step after its request finished); KVABIError naming why it cannot be used."""
        lay = peer.layout
        if lay.size("D") > MAX_RECORD or lay.num_blocks <= remote.slot:
            raise KVABIError(f"kvabi_grants: a table of {lay.num_blocks} slots of "
                             f"{lay.size('D')} bytes (at most {MAX_RECORD} a slot)")
        local = KVCache.allocate(table_layout(1, lay.size("D")), "numpy")
        plan = plan_block_transfer(lay, local.layout, [remote.slot], [0])
        why = "the producer published no grant with this nonce"
        while True:
            self._agent.pull_plan(peer, plan, local, timeout=job.left(), notify=b"",
                                  staged=True)
            row = local[0].reshape(-1).view(np.uint8)
            head = read_header(row)
            if head is not None and head[1] == remote.nonce:
                if head[0] != LIVE:
                    raise KVABIError(f"kvabi_grant: {STATES.get(head[0], 'closed')} (a replay, "
                                     f"or hold_timeout_s passed on the producer)")
                try:
                    return decode(row)
                except KVABIError as e:  # read while being written? read again
                    why = str(e).removeprefix("kvabi_grant: ")
            elif head is not None and head[0] == LIVE:
                raise KVABIError(f"kvabi_grant: slot {remote.slot} holds another request's "
                                 "grant (forged or replayed parameters)")
            if time.monotonic() + GRANT_POLL_S >= job.deadline:
                raise KVABIError(f"kvabi_grant: slot {remote.slot}: {why} (until "
                                 f"pull_timeout_s passed)")
            time.sleep(GRANT_POLL_S)

    def _check_record(self, rec: GrantRecord, remote) -> None:
        if rec.tokens != remote.tokens:
            raise KVABIError("kvabi_grant: issued for other tokens than this request's prompt "
                             "(another request's grant)")
        if rec.num_tokens != remote.num_tokens:
            raise KVABIError(f"remote_num_tokens: {remote.num_tokens}, the producer holds "
                             f"{rec.num_tokens} for this grant")
        if len(rec.blocks) != len(remote.blocks):
            raise KVABIError(f"kvabi_grant: {len(rec.blocks)} KV cache groups, this engine "
                             f"has {len(remote.blocks)}")
        for g, (mine, theirs) in enumerate(zip(remote.blocks, rec.blocks)):
            if not np.array_equal(mine, theirs):
                raise KVABIError(f"remote_block_ids[{g}]: not the blocks the producer holds "
                                 "for this grant")

    def _use(self, nonce: bytes, req_id: str) -> None:
        """Remember a grant this request may use (its record names this request's tokens);
        KVABIError when a request pulled it here before (a replay)."""
        with self._used_lock:
            other = self._used.get(nonce)
            if other is not None:
                raise KVABIError(f"kvabi_grant: already used by request {other} on this "
                                 "engine (a replay)")
            self._used[nonce] = req_id
            if len(self._used) > USED_GRANTS:
                self._used.popitem(last=False)

    @staticmethod
    def _check_claim(rec: GrantRecord, g: int, part: str, peer) -> None:
        claim = next((c for c in rec.parts[g] if c.name == part), None)
        field = f"kvabi_handshakes[{g}].{part}"
        if claim is None:
            raise KVABIError(f"{field}: the producer serves no such part")
        if claim.layout != layout_fingerprint(peer.layout):
            raise KVABIError(f"{field}: its layout is not the one the producer registered "
                             "(fingerprint differs)")
        if claim.planes != planes_digest(peer.handshake):
            raise KVABIError(f"{field}: its planes (agent, addresses, sizes) are not the ones "
                             "the producer registered")

    def _pull(self, job) -> None:
        """One request's pull (see the module docstring); KVABIError with the reason."""
        try:
            self._pull_checked(job)
        finally:
            self._release_peers(job)

    def _pull_checked(self, job) -> None:
        p: PullWork = job.work
        r = p.remote
        t0, regions, nbytes, read_s = time.perf_counter(), 0, 0, 0.0
        if len(r.handshakes) != len(self._caches):
            raise KVABIError(f"kvabi_handshakes: the peer must serve {len(self._caches)} KV "
                             f"cache groups, got {len(r.handshakes)}")
        rec = self._read_grant(self._peer(r.grants, job), r, job)
        self._check_record(rec, r)
        self._use(r.nonce, p.req_id)
        grant_s = time.perf_counter() - t0
        todo = [(g, part, cache, msg) for g, parts in enumerate(self._caches)
                for part, cache, msg in matching_parts(parts, r.handshakes[g], g)]
        peers = []
        for g, part, _, msg in todo:
            peer = self._peer(msg, job)
            self._check_claim(rec, g, part, peer)
            check_same_scales(self._scales[g], peer.handshake.kv_scales,
                              f"kvabi_handshakes[{g}].{part}.kv_scales")
            peers.append(peer)
        bs = self.config.block_size
        for i, ((g, part, cache, _), peer) in enumerate(zip(todo, peers)):
            if part.startswith(IMAGE):  # same interior and block size: whole blocks
                s, d = block_pairs(r.blocks[g], p.dst_blocks[g], bs, p.start, p.num_tokens)
            else:
                s, d = paired_slots(r.blocks[g], peer.layout.size("N"), p.dst_blocks[g],
                                    cache.layout.size("N"), p.start, p.num_tokens)
            plan = plan_transfer(peer.layout, cache.layout, s, d)
            r0 = time.perf_counter()
            # the last READ's notification tells the producer it may free the blocks
            note = notify_message(r.slot, r.nonce) if i == len(todo) - 1 else b""
            self._agent.pull_plan(peer, plan, cache, notify=note, timeout=job.left(),
                                  staged=True, guard=job.commit)
            read_s += time.perf_counter() - r0
            regions, nbytes = regions + len(plan), nbytes + plan.nbytes
            self._after_pull(p, g, part, cache, d)
        v0 = time.perf_counter()
        self._verify(p, rec)
        t1 = time.perf_counter()
        self.pull_stats.append((p.req_id, t1 - t0, regions, nbytes, read_s, grant_s, t1 - v0))
        self._stat_pulls.append((t1 - t0, read_s, nbytes, regions,
                                 any(not part.startswith(IMAGE) for _, part, _, _ in todo)))

    def _verify(self, p: PullWork, rec: GrantRecord) -> None:
        """Every pulled token's checksum equals the producer's (before any token is
        generated from it: vLLM learns the load finished only after this)."""
        bs, rbs = self.config.block_size, p.remote.block_size
        for g, parts in enumerate(self._caches):
            src = token_slots(p.remote.blocks[g], rbs, p.start, p.num_tokens)
            dst = token_slots(p.dst_blocks[g], bs, p.start, p.num_tokens)
            keep = (src >= 0) & (dst >= 0)
            mine = token_checksums(token_parts(parts), dst[keep], bs)
            theirs = rec.checksums[g][p.start + np.flatnonzero(keep)]
            bad = np.flatnonzero(mine != theirs)
            if bad.size:
                pos = p.start + int(np.flatnonzero(keep)[bad[0]])
                raise KVABIError(f"kvabi_grant: the KV read for token {pos} of group {g} is "
                                 f"not what the producer computed (checksum differs; "
                                 f"{bad.size} tokens differ)")

    def _after_pull(self, pull: PullWork, group: int, part: str, cache, dst_slots) -> None:
        """Called once a part of a group has arrived (a place for checks; nothing here)."""

    # -- host tier ------------------------------------------------------------------------
    def _save(self, s: HostSave) -> None:
        for g, parts in enumerate(self._caches):
            blocks = np.asarray(s.blocks[g], np.int64)
            keep = blocks != NULL_BLOCK
            if not keep.any():
                continue
            ids = {part: self._pools[g][part].offload(c, blocks[keep])
                   for part, c in host_parts(parts)}
            self.host_stats["saved"] += int(keep.sum())
            for j, key in enumerate(k for k, kp in zip(s.keys, keep) if kp):
                self._host_ids[g][key] = {part: int(i[j]) for part, i in ids.items()}
        self._saved.add(s.req_id)

    def _evict(self, key: bytes) -> None:
        for g, held in enumerate(self._host_ids):
            ids = held.pop(key, None)
            if ids is not None:
                for part, i in ids.items():
                    self._pools[g][part].free([i])
                self.host_stats["evicted"] += 1

    def _load(self, ld: HostLoad) -> None:
        for g, parts in enumerate(self._caches):
            blocks = np.asarray(ld.blocks[g], np.int64)
            keep = blocks != NULL_BLOCK
            if not keep.any():
                continue
            held = [self._host_ids[g][k] for k, kp in zip(ld.keys, keep) if kp]
            self.host_stats["loaded"] += int(keep.sum())
            for part, c in host_parts(parts):
                self._pools[g][part].onload(c, [h[part] for h in held], blocks[keep])
                self._after_load(ld, g, part, c, blocks[keep])

    def _after_load(self, load: HostLoad, group: int, part: str, cache, blocks) -> None:
        """Called once a part of a group's host blocks are back (nothing here)."""

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table (for tests and monitoring)."""
        return {"pulls": len(self._puller) if self._puller is not None else 0,
                "peers": len(self._peers), "saved": len(self._saved), "sent": len(self._sent),
                "finished": len(self._finished),
                "grants": len(self._grants.live) if self._grants is not None else 0,
                "host_blocks": sum(len(h) for h in self._host_ids),
                "pull_stats": len(self.pull_stats), "refusals": len(self.refusals),
                "used_grants": len(self._used)}

    def shutdown(self):
        if self._puller is not None:
            self._puller.stop()
        if self._agent is not None:
            self._agent.close()
            self._agent = None


__all__ = ["KvabiConnectorWorker", "block_pairs", "host_parts", "matching_parts",
           "token_parts"]
