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

Under tensor parallelism every worker is one rank: its layouts state its shard of the
model's KV heads (:func:`~kvabi_vllm.connector_layout.with_shard`), a producer rank writes
its own grant record, and a decode rank pulls the heads it holds from the producer ranks
that hold them (``kvabi.transfer.plan_shard_transfer``, one READ per producer rank read),
after negotiating once per producer group (``kvabi.transfer.negotiate``: ranks swapped, a
rank lying about its heads, another model, dtype or head dim are refused by field before
any byte moves).  Its final notification names the slot, the nonce, its rank and its TP
size, and reaches every producer rank; a pull that fails after a producer rank's
record bound the grant to this request still tells every rank whose record did, so that
none holds blocks for it (a pull refused before, e.g. with another request's parameters,
frees nothing).
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
from kvabi.model.shard import shard_of
from kvabi.transfer import (HostPool, negotiate, plan_block_transfer,
                            plan_shard_transfer, plan_transfer)
from kvabi.transfer.handshake import parse_handshake
from kvabi.transfer.kv_scales import check_same_scales

from .connector_checksum import head_checksums, layout_fingerprint, planes_digest
from .connector_config import ConnectorConfig
from .connector_fixes import with_fix
from .connector_grants import (LIVE, PENDING, STATES, GrantRecord, GrantTable, PartClaim,
                               decode, notify_message, parse_notification, read_header,
                               record_bytes, table_layout)
from .connector_layout import (IMAGE, KT_V, engine_writer, group_parts, image_part,
                               interior_of, is_kvabi_backend, kvabi_backend_part, kt_v_halves,
                               part_cache, split_kv, tp_shard_info, verify_part, with_shard)
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
#: producer groups whose negotiation is kept (producers come and go)
NEGOTIATIONS = 256


def host_parts(parts):
    """The parts the host tier keeps: the block image where there is one (whole blocks,
    no relayout), else all."""
    image = [(n, c) for n, c in parts if n.startswith(IMAGE)]
    return image or parts


def kv_part(parts):
    """The part of a group holding its keys and values in one layout (``kv``, its shard
    stated): what checksums sum."""
    return dict(parts)["kv"]


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


def matching_parts(parts, theirs, g: int, usable=None):
    """[(part, own cache, peer's message)] to pull for group ``g``: the block image when the
    peer serves the same one (same interior, block size, head dim), else every other part,
    which the peer must serve too; ``usable(part, own cache)`` (optional) leaves out parts
    that cannot be planned (between shardings: component layouts).  A message may be a
    tuple of messages (one per producer rank)."""
    if not isinstance(theirs, dict) or not all(
            isinstance(k, str) and (isinstance(v, str) or isinstance(v, tuple))
            for k, v in theirs.items()):
        raise KVABIError(f"kvabi_handshakes[{g}]: must be an object of part -> message")
    ok = usable or (lambda name, cache: True)
    for name, cache in parts:
        if name.startswith(IMAGE) and name in theirs and ok(name, cache):
            return [(name, cache, theirs[name])]
    mine = dict((n, c) for n, c in parts if not n.startswith(IMAGE))
    served = sorted(k for k in theirs if not k.startswith(IMAGE))
    for want in (("kv",), ("k", "v")):  # one K/V layout each, else keys and values apart
        if all(w in mine and w in theirs and ok(w, mine[w]) for w in want):
            return [(w, mine[w], theirs[w]) for w in want]
    why = " in the axis form" if usable is not None else ""
    raise KVABIError(f"kvabi_handshakes[{g}]: the peer serves parts {served}, this engine "
                     f"{sorted(mine)}: no pair to copy between{why}")


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
        # digest of (group, part, the producer ranks' messages) -> Negotiation
        self._negotiated: collections.OrderedDict = collections.OrderedDict()
        self._negotiate_lock = threading.Lock()
        self._local_hs: dict = {}  # (group, part) -> this rank's parsed handshake
        self._tp = (0, 1, config.num_kv_heads)  # (rank, TP size, the model's KV heads)
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
        self._tp = tp_shard_info(self._vllm_config, cfg.num_kv_heads or None)
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
                if interior == KT_V:  # the kv part's components in the axis form
                    parts += [(part, part_cache(tensors, lay, off)) for part, lay, off in
                              kt_v_halves(tensors, name=name, dtype=kv_dtype)]
            if [n for n, _ in parts if not n.startswith(IMAGE)] == ["kv"]:
                halves = split_kv(parts[0][1])  # for peers that hold K and V apart
                parts += halves or []
            # under TP every layout says which of the model's heads this rank holds
            self._caches.append([(n, with_shard(c, self._tp)) for n, c in parts])
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
            {part: self._agent.handshake(c, include_metadata=True, kv_scales=sc,
                                         model=cfg.model_id)
             for part, c in parts} for parts, sc in zip(self._caches, self._scales)]
        self._claims = [tuple(PartClaim(part, layout_fingerprint(c.layout),
                                        planes_digest(parse_handshake(msgs[part])))
                              for part, c in parts)
                        for parts, msgs in zip(self._caches, self._own_handshakes)]
        heads = max(kv_part(parts).layout.size("H") for parts in self._caches)
        size = record_bytes(len(self._caches), max(cfg.max_model_len, 1), cfg.block_size,
                            heads)
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
        sums = [head_checksums(kv_part(parts), token_slots(b, bs, 0, g.num_tokens))
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
            if req_id is PENDING:  # other decode ranks still read
                continue
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

    def _read_grant(self, peer, remote, job, who: str = "") -> GrantRecord:
        """The producer's record for this grant, once it is written (a grant is written the
        step after its request finished); KVABIError naming why it cannot be used.
        ``who``: which producer rank (for the message, under TP)."""
        lay = peer.layout
        if lay.size("D") > MAX_RECORD or lay.num_blocks <= remote.slot:
            raise KVABIError(f"kvabi_grants{who}: a table of {lay.num_blocks} slots of "
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
                                     f"or hold_timeout_s passed on the producer){who}")
                try:
                    return decode(row)
                except KVABIError as e:  # read while being written? read again
                    why = str(e).removeprefix("kvabi_grant: ")
            elif head is not None and head[0] == LIVE:
                raise KVABIError(f"kvabi_grant: slot {remote.slot} holds another request's "
                                 f"grant (forged or replayed parameters){who}")
            if time.monotonic() + GRANT_POLL_S >= job.deadline:
                raise KVABIError(f"kvabi_grant: slot {remote.slot}: {why} (until "
                                 f"pull_timeout_s passed){who}")
            time.sleep(GRANT_POLL_S)

    def _check_record(self, rec: GrantRecord, remote, who: str = "") -> None:
        if rec.tokens != remote.tokens:
            raise KVABIError(f"kvabi_grant: issued for other tokens than this request's prompt "
                             f"(another request's grant){who}")
        if rec.num_tokens != remote.num_tokens:
            raise KVABIError(f"remote_num_tokens: {remote.num_tokens}, the producer holds "
                             f"{rec.num_tokens} for this grant{who}")
        if len(rec.blocks) != len(remote.blocks):
            raise KVABIError(f"kvabi_grant: {len(rec.blocks)} KV cache groups, this engine "
                             f"has {len(remote.blocks)}{who}")
        for g, (mine, theirs) in enumerate(zip(remote.blocks, rec.blocks)):
            if not np.array_equal(mine, theirs):
                raise KVABIError(f"remote_block_ids[{g}]: not the blocks the producer holds "
                                 f"for this grant{who}")

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
    def _check_claim(rec: GrantRecord, g: int, part: str, peer, rank: str = "") -> None:
        claim = next((c for c in rec.parts[g] if c.name == part), None)
        field = f"kvabi_handshakes[{g}].{part}{rank}"
        if claim is None:
            raise KVABIError(f"{field}: the producer serves no such part")
        if claim.layout != layout_fingerprint(peer.layout):
            raise KVABIError(f"{field}: its layout is not the one the producer registered "
                             "(fingerprint differs)")
        if claim.planes != planes_digest(peer.handshake):
            raise KVABIError(f"{field}: its planes (agent, addresses, sizes) are not the ones "
                             "the producer registered")

    # -- decode side under tensor parallelism --------------------------------------------
    def _sharded(self, remote, g: int) -> bool:
        """Whether group ``g`` is read between shardings: several producer ranks, or one
        holding other heads than this rank."""
        if remote.ranks > 1:
            return True
        theirs = next(lays[0] for name, lays in remote.layouts[g].items()
                      if not name.startswith(IMAGE))
        mine = kv_part(self._caches[g]).layout
        a, b = shard_of(theirs), shard_of(mine)
        return (a.heads, a.of) != (b.heads, b.of)

    def _local_handshake(self, g: int, part: str, cache):
        hs = self._local_hs.get((g, part))
        if hs is None:
            hs = self._local_hs[(g, part)] = parse_handshake(
                self._agent.handshake(cache, model=self.config.model_id))
        return hs

    def _negotiate(self, g: int, part: str, cache, peers):
        """How this rank reads ``part`` of group ``g`` from the producer ranks ``peers``
        (``kvabi.transfer.negotiate``: model identity, ABI, dtype, head dim, KV heads and
        layers compared at once, the producer group's shards checked), once per producer
        group, with the kind and cost logged once: a Negotiation (component layouts are
        negotiated component by component).  KVABIError naming the field before any byte
        moves."""
        key = hashlib.blake2b(repr((g, part, [p.handshake.fingerprint for p in peers],
                                    [p.name for p in peers],
                                    [p.handshake.model for p in peers])).encode(),
                              digest_size=16).digest()
        with self._negotiate_lock:  # once per producer group, whatever the pull threads
            if key in self._negotiated:
                self._negotiated.move_to_end(key)
                return self._negotiated[key]
            got = self._negotiate_once(g, part, cache, peers)
            self._negotiated[key] = got
            while len(self._negotiated) > NEGOTIATIONS:
                self._negotiated.popitem(last=False)
        return got

    def _negotiate_once(self, g: int, part: str, cache, peers):
        mine = self._local_handshake(g, part, cache)
        try:
            got = negotiate(mine, [p.handshake for p in peers])
        except KVABIError as e:  # data that differ (Refused), or the producer group itself:
            # ranks swapped, heads lied
            raise KVABIError(f"kvabi_handshakes[{g}].{part}: {e}") from None
        cost = got.cost()
        log.info("KvabiConnector: group %d part %s (rank %d of %d) reads producer ranks %s "
                 "of %d: %s%s, %d regions and %d staging bytes per block", g, part,
                 self._tp[0], self._tp[1], list(got.sources), len(peers), got.kind,
                 f" ({', '.join(got.differences)})" if got.differences else "",
                 cost.regions, cost.staging_bytes)
        return got

    def _tell_done(self, job) -> None:
        """A pull that failed after binding tells every producer rank whose record bound
        the grant to this request that this rank is done (a plain notification), so that
        none holds the request's blocks for it; a rank that does not answer, or whose
        record did not bind, is left to its hold_timeout_s."""
        r = job.work.remote
        note = notify_message(r.slot, r.nonce, self._tp[0], self._tp[1])
        for i, peer in job.tables:
            try:
                self._agent.notify(peer, note)
            except KVABIError as e:
                log.warning("KvabiConnector: could not tell producer rank %d that request %s "
                            "is done: %s", i, job.req_id, e)

    def _pull(self, job) -> None:
        """One request's pull (see the module docstring); KVABIError with the reason."""
        job.tables, job.notified = [], False
        try:
            self._pull_checked(job)
        except BaseException:
            if job.tables and not job.notified:
                self._tell_done(job)
            raise
        finally:
            self._release_peers(job)

    def _pull_checked(self, job) -> None:
        p: PullWork = job.work
        r = p.remote
        t0, regions, nbytes, read_s = time.perf_counter(), 0, 0, 0.0
        if len(r.handshakes) != len(self._caches):
            raise KVABIError(f"kvabi_handshakes: the peer must serve {len(self._caches)} KV "
                             f"cache groups, got {len(r.handshakes)}")
        multi = r.ranks > 1
        rank_of = (lambda i: f"[{i}]") if multi else (lambda i: "")
        who = (lambda i: f" (producer rank {i})") if multi else (lambda i: "")
        # every producer rank's record binds the grant to this request (its nonce, live,
        # for this prompt and these blocks); from then on a failure still tells that rank,
        # and nothing earlier does (another request's parameters must free nothing)
        recs = {}
        for i, msg in enumerate(r.grants):
            peer = self._peer(msg, job)
            recs[i] = rec = self._read_grant(peer, r, job, who(i))
            self._check_record(rec, r, who(i))
            if i == 0:  # a second pull of this grant on this engine stops here
                self._use(r.nonce, p.req_id)
            job.tables.append((i, peer))
        grant_s = time.perf_counter() - t0
        todo = []  # (group, part, own cache, producer ranks' peers, sharded)
        for g, parts in enumerate(self._caches):
            sharded = self._sharded(r, g)
            lays = r.layouts[g]
            usable = (lambda name, cache, lays=lays: cache.layout.is_axis_form and all(
                x.is_axis_form for x in lays[name])) if sharded else None
            for part, cache, msgs in matching_parts(parts, r.handshakes[g], g, usable):
                todo.append((g, part, cache, [self._peer(m, job) for m in msgs], sharded))
        # negotiated before any KV moves: which producer ranks hold this rank's heads
        runs, reads = {}, []
        for g, part, cache, peers, _ in todo:
            got = self._negotiate(g, part, cache, peers)
            runs.setdefault(g, got.runs)
            reads.append(got.sources)
        for (g, part, _, peers, _), read in zip(todo, reads):
            for i in read:
                self._check_claim(recs[i], g, part, peers[i], rank_of(i))
                check_same_scales(self._scales[g], peers[i].handshake.kv_scales,
                                  f"kvabi_handshakes[{g}].{part}{rank_of(i)}.kv_scales")
        bs = self.config.block_size
        note = notify_message(r.slot, r.nonce, self._tp[0], self._tp[1])
        for n, (g, part, cache, peers, sharded) in enumerate(todo):
            if part.startswith(IMAGE):  # same interior and block size: whole blocks
                s, d = block_pairs(r.blocks[g], p.dst_blocks[g], bs, p.start, p.num_tokens)
            else:
                s, d = paired_slots(r.blocks[g], peers[0].layout.size("N"), p.dst_blocks[g],
                                    cache.layout.size("N"), p.start, p.num_tokens)
            # the last READ's notification tells every producer rank it may free the blocks
            last = n == len(todo) - 1
            r0 = time.perf_counter()
            if sharded:  # this rank's heads from the producer ranks holding them
                plan = plan_shard_transfer([x.layout for x in peers], cache.layout, s, d)
                self._agent.pull_shard_plan(peers, plan, cache, notify=note if last else b"",
                                            timeout=job.left(), staged=True,
                                            guard=job.commit, kv_scales=self._scales[g])
            else:
                plan = plan_transfer(peers[0].layout, cache.layout, s, d)
                self._agent.pull_plan(peers[0], plan, cache, notify=note if last else b"",
                                      timeout=job.left(), staged=True, guard=job.commit)
            job.notified = last
            read_s += time.perf_counter() - r0
            regions, nbytes = regions + len(plan), nbytes + plan.nbytes
            self._after_pull(p, g, part, cache, d)
        v0 = time.perf_counter()
        self._verify(p, recs, runs)
        t1 = time.perf_counter()
        self.pull_stats.append((p.req_id, t1 - t0, regions, nbytes, read_s, grant_s, t1 - v0))
        self._stat_pulls.append((t1 - t0, read_s, nbytes, regions,
                                 any(not t[1].startswith(IMAGE) for t in todo)))

    def _verify(self, p: PullWork, recs: dict, runs: dict) -> None:
        """Every pulled token's checksum, per KV head this rank holds, equals the one the
        producer rank it was read from computed for that global head (before any token is
        generated from it: vLLM learns the load finished only after this).  ``runs``: per
        group, which producer rank each local head came from (None: all from rank 0)."""
        bs, rbs = self.config.block_size, p.remote.block_size
        for g, parts in enumerate(self._caches):
            src = token_slots(p.remote.blocks[g], rbs, p.start, p.num_tokens)
            dst = token_slots(p.dst_blocks[g], bs, p.start, p.num_tokens)
            keep = np.flatnonzero((src >= 0) & (dst >= 0))
            cache = kv_part(parts)
            mine = head_checksums(cache, dst[keep])
            heads = shard_of(cache.layout).heads
            src_of = np.zeros(len(heads), np.int64)
            for run in runs.get(g) or ():
                src_of[run.dst_first:run.dst_first + run.count] = run.source
            for j, h in enumerate(heads):
                i = int(src_of[j])
                theirs = self._their_heads(p.remote, g, i)
                sums = recs[i].checksums[g]
                if sums.shape[1] != len(theirs) or h not in theirs:
                    raise KVABIError(f"kvabi_grant: the producer rank {i} record sums "
                                     f"{sums.shape[1]} heads, its layout holds "
                                     f"{list(theirs)} (global head {h} of this rank)")
                want = sums[p.start + keep, theirs.index(h)]
                bad = np.flatnonzero(mine[:, j] != want)
                if bad.size:
                    pos = p.start + int(keep[bad[0]])
                    raise KVABIError(f"kvabi_grant: the KV read for token {pos} of group {g} "
                                     f"is not what the producer computed (global head {h}: "
                                     f"checksum differs; {bad.size} tokens differ)")

    @staticmethod
    def _their_heads(remote, g: int, rank: int) -> tuple:
        """The global heads producer rank ``rank`` holds in group ``g`` (its layouts state
        them; the grant record's part claims vouch for the layouts)."""
        lays = next(v for name, v in remote.layouts[g].items() if not name.startswith(IMAGE))
        return shard_of(lays[rank]).heads

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


__all__ = ["KvabiConnectorWorker", "block_pairs", "host_parts", "kv_part", "matching_parts"]
