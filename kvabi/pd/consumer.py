"""A consumer rank's cache side (``specs/pd.md`` sections 6.2, 6.3 and 7): pulls requests'
prompt KV from producers, off the engine's step, each within ``pull_timeout_s``.

A pull believes nothing its parameters claim until each producer rank's own grant record
confirms it: the record must hold this request's nonce, live, for this request's prompt
tokens and block ids, and each pulled part's layout fingerprint, planes digest and
handshake digest must equal those of the messages it was given; after the READs every
token's checksum must equal the producer's.  Only then does the engine learn that the
tokens arrived; otherwise it learns that the pull failed, with the reason.

Under tensor parallelism this rank binds to the record of every producer rank, negotiates
once per producer group (``kvabi.transfer.negotiate``: ranks swapped, a rank lying about
its heads, another model, dtype or head dim are refused by field before any byte moves),
and pulls the heads it holds from the producer ranks that hold them (one READ per rank
read).  Its last READ's notification names the slot, the nonce, its rank and its TP size,
and reaches every producer rank; a pull that fails after a producer rank's record bound
the grant to this request still tells that rank, and one refused before tells none.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time

import numpy as np

from ..memory.cache import KVCache
from ..util.errors import KVABIError
from ..model.shard import shard_of
from ..transfer import negotiate, plan_block_transfer, plan_shard_transfer, plan_transfer
from ..transfer.handshake import parse_handshake
from ..transfer.kv_scales import check_same_scales
from .digests import head_checksums
from .engine import EngineCaches
from .notify import notify_message
from .parts import is_image, kv_part, matching_parts
from .peers import Peers
from .pulls import GRACE, Puller
from .record import (LIVE, MAX_SLOT_BYTES, STATES, GrantRecord, PartClaim, decode, part_claim,
                     read_header, table_layout)
from .settings import PDSettings
from .slots import block_pairs, paired_slots, token_slots
from .work import PullWork

#: seconds between reads of a grant record the producer has not written yet
GRANT_POLL_S = 0.005
#: grants this engine pulled, remembered to refuse a replay to it
USED_GRANTS = 65536
#: producer groups whose negotiation is kept (producers come and go)
NEGOTIATIONS = 256


class Consumer:
    """Pulls into ``caches`` (registered with ``agent``).  ``after_pull(work, group, part,
    cache, dst_slots)`` (optional) is called once each part of a group arrived, before the
    checksums (a negative control corrupts bytes there)."""

    def __init__(self, agent, caches: EngineCaches, settings: PDSettings, *,
                 after_pull=None, log: logging.Logger | None = None,
                 label: str = "kvabi.pd", settings_at: str = ""):
        self._agent = agent
        self._groups = caches.groups
        self._block_size = caches.block_size
        self._tp = (caches.rank, caches.tp_size)
        self._model_id = settings.model_id
        self._after_pull = after_pull
        self._log = log or logging.getLogger("kvabi.pd")
        self._label = label
        self._peers = Peers(agent, settings.max_peers)
        self._used = collections.OrderedDict()   # grant nonces pulled here -> request id
        self._used_lock = threading.Lock()
        # digest of (group, part, the producer ranks' messages) -> Negotiation
        self._negotiated: collections.OrderedDict = collections.OrderedDict()
        self._negotiate_lock = threading.Lock()
        self._local_hs: dict = {}  # (group, part) -> this rank's parsed handshake
        self._puller = Puller(self._pull, settings.max_pulls, settings.pull_timeout_s,
                              settings.pull_threads, settings_at=settings_at)
        #: per pull: (request id, seconds, regions, bytes, seconds in READs, seconds to the
        #: grant records checked, seconds of the checksums), for benchmarks
        self.pull_stats: collections.deque = collections.deque(maxlen=4096)
        #: per pull (seconds, seconds in READs, bytes, regions, relayouted), drained by the
        #: engine's statistics (pull threads append, the engine's thread takes)
        self.figures: collections.deque = collections.deque(maxlen=4096)

    def submit(self, work: PullWork) -> str | None:
        """Queue a pull; the reason it is refused (too many), or None."""
        return self._puller.submit(work.req_id, work)

    def collect(self) -> list[tuple[str, str | None]]:
        """(request id, None or the reason) of the pulls that ended (or were given up)."""
        return self._puller.collect()

    def running(self) -> int:
        """Pulls queued or running."""
        return len(self._puller)

    @property
    def ended(self):
        """An event set when a pull ends (cleared by :meth:`collect`)."""
        return self._puller.ended

    def next_deadline(self) -> float | None:
        """The earliest deadline of a pull queued or running (None: none)."""
        return self._puller.next_deadline()

    def table_sizes(self) -> dict[str, int]:
        return {"pulls": len(self._puller), "peers": len(self._peers),
                "pull_stats": len(self.pull_stats), "used_grants": len(self._used)}

    def stop(self) -> None:
        self._puller.stop()

    # -- one pull (on a pull thread) -----------------------------------------------------
    def _pull(self, job) -> None:
        """One request's pull; KVABIError with the reason."""
        job.tables, job.notified = [], False
        try:
            self._pull_checked(job)
        except BaseException:
            if job.tables and not job.notified:
                self._tell_done(job)
            raise
        finally:
            self._peers.release(job)

    def _pull_checked(self, job) -> None:
        p: PullWork = job.work
        r = p.remote
        t0, regions, nbytes, read_s = time.perf_counter(), 0, 0, 0.0
        if len(r.handshakes) != len(self._groups):
            raise KVABIError(f"kvabi_handshakes: the peer must serve {len(self._groups)} KV "
                             f"cache groups, got {len(r.handshakes)}")
        multi = r.ranks > 1
        rank_of = (lambda i: f"[{i}]") if multi else (lambda i: "")
        who = (lambda i: f" (producer rank {i})") if multi else (lambda i: "")
        # every producer rank's record binds the grant to this request (its nonce, live,
        # for this prompt and these blocks); from then on a failure still tells that rank,
        # and nothing earlier does (another request's parameters must free nothing)
        recs = {}
        for i, msg in enumerate(r.grants):
            peer = self._peers.get(msg, job)
            recs[i] = rec = self._read_grant(peer, r, job, who(i))
            _check_record(rec, r, who(i))
            if i == 0:  # a second pull of this grant on this engine stops here
                self._use(r.nonce, p.req_id)
            job.tables.append((i, peer))
            _check_rank(rec, r, i)
        grant_s = time.perf_counter() - t0
        todo = []  # (group, part, own cache, producer ranks' peers, sharded)
        for g, grp in enumerate(self._groups):
            sharded = self._sharded(r, g)
            lays = r.layouts[g]
            usable = (lambda name, cache, lays=lays: cache.layout.is_axis_form and all(
                x.is_axis_form for x in lays[name])) if sharded else None
            for part, cache, msgs in matching_parts(grp.parts, r.handshakes[g], g, usable):
                todo.append((g, part, cache, [self._peers.get(m, job) for m in msgs],
                             sharded))
        # every producer rank's handshake of every part read states what that rank's
        # record vouches for (the negotiation and the plans use all of them), and its
        # scales are this cache's, before anything is negotiated or read
        for g, part, _, peers, _ in todo:
            for i, peer in enumerate(peers):
                _check_claim(recs[i], g, part, peer, rank_of(i))
                check_same_scales(self._groups[g].kv_scales, peer.handshake.kv_scales,
                                  f"kvabi_handshakes[{g}].{part}{rank_of(i)}.kv_scales")
        # negotiated before any KV moves: which producer ranks hold this rank's heads
        runs, heads = {}, {}
        for g, part, cache, peers, _ in todo:
            got = self._negotiate(g, part, cache, peers)
            runs.setdefault(g, got.runs)
            heads.setdefault(g, [shard_of(x.layout).heads for x in peers])
        bs = self._block_size
        note = notify_message(r.slot, r.nonce, *self._tp)
        for n, (g, part, cache, peers, sharded) in enumerate(todo):
            if is_image(part):  # same interior and block size: whole blocks
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
                                            guard=job.commit,
                                            kv_scales=self._groups[g].kv_scales)
            else:
                plan = plan_transfer(peers[0].layout, cache.layout, s, d)
                self._agent.pull_plan(peers[0], plan, cache, notify=note if last else b"",
                                      timeout=job.left(), staged=True, guard=job.commit)
            job.notified = last
            read_s += time.perf_counter() - r0
            regions, nbytes = regions + len(plan), nbytes + plan.nbytes
            if self._after_pull is not None:
                self._after_pull(p, g, part, cache, d)
        v0 = time.perf_counter()
        self._verify(p, recs, runs, heads)
        t1 = time.perf_counter()
        self.pull_stats.append((p.req_id, t1 - t0, regions, nbytes, read_s, grant_s, t1 - v0))
        self.figures.append((t1 - t0, read_s, nbytes, regions,
                             any(not is_image(t[1]) for t in todo)))

    def _read_grant(self, peer, remote, job, who: str = "") -> GrantRecord:
        """The producer's record for this grant, once it is written (a grant may be written
        after its answer left); KVABIError naming why it cannot be used.  ``who``: which
        producer rank (for the message, under TP)."""
        lay = peer.layout
        if lay.size("D") > MAX_SLOT_BYTES or lay.num_blocks <= remote.slot:
            raise KVABIError(f"kvabi_grants{who}: a table of {lay.num_blocks} slots of "
                             f"{lay.size('D')} bytes (at most {MAX_SLOT_BYTES} a slot)")
        local = KVCache.allocate(table_layout(1, lay.size("D")), "numpy")
        plan = plan_block_transfer(lay, local.layout, [remote.slot], [0])
        why = "the producer published no grant with this nonce"
        t0, left = time.monotonic(), job.left()
        while True:
            self._agent.pull_plan(peer, plan, local, timeout=left, notify=b"", staged=True)
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
            # a record is written a step after its request finished: read again, until the
            # pull's own stages must stop (Job.left), then say why with this field
            time.sleep(GRANT_POLL_S)
            now = time.monotonic()
            left = job.deadline - GRACE - now
            if left <= GRANT_POLL_S or job.commit.abandoned:
                raise KVABIError(f"kvabi_grant: slot {remote.slot}: {why} (read for "
                                 f"{now - t0:.1f} s, until pull_timeout_s){who}")

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

    def _sharded(self, remote, g: int) -> bool:
        """Whether group ``g`` is read between shardings: several producer ranks, or one
        holding other heads than this rank."""
        if remote.ranks > 1:
            return True
        theirs = next(lays[0] for name, lays in remote.layouts[g].items() if not is_image(name))
        a, b = shard_of(theirs), shard_of(self._groups[g].kv.layout)
        return (a.heads, a.of) != (b.heads, b.of)

    def _local_handshake(self, g: int, part: str, cache):
        hs = self._local_hs.get((g, part))
        if hs is None:
            hs = self._local_hs[(g, part)] = parse_handshake(
                self._agent.handshake(cache, model=self._model_id))
        return hs

    def _negotiate(self, g: int, part: str, cache, peers):
        """How this rank reads ``part`` of group ``g`` from the producer ranks ``peers``,
        once per producer group, with the kind and cost logged once; KVABIError naming the
        field before any byte moves."""
        key = hashlib.blake2b(repr((g, part, [p.handshake.fingerprint for p in peers],
                                    [p.name for p in peers],
                                    [p.handshake.model for p in peers])).encode(),
                              digest_size=16).digest()
        with self._negotiate_lock:  # once per producer group, whatever the pull threads
            if key in self._negotiated:
                self._negotiated.move_to_end(key)
                return self._negotiated[key]
            mine = self._local_handshake(g, part, cache)
            try:
                got = negotiate(mine, [p.handshake for p in peers])
            except KVABIError as e:  # data that differ (Refused), or the producer group
                # itself: ranks swapped, heads lied
                raise KVABIError(f"kvabi_handshakes[{g}].{part}: {e}") from None
            cost = got.cost()
            self._log.info("%s: group %d part %s (rank %d of %d) reads producer ranks %s of "
                           "%d: %s%s, %d regions and %d staging bytes per block", self._label,
                           g, part, self._tp[0], self._tp[1], list(got.sources), len(peers),
                           got.kind, f" ({', '.join(got.differences)})" if got.differences
                           else "", cost.regions, cost.staging_bytes)
            self._negotiated[key] = got
            while len(self._negotiated) > NEGOTIATIONS:
                self._negotiated.popitem(last=False)
        return got

    def _tell_done(self, job) -> None:
        """A pull that failed after binding tells every producer rank whose record bound
        the grant to this request that this rank is done (a plain notification); a rank
        that does not answer is left to its hold_timeout_s."""
        r = job.work.remote
        note = notify_message(r.slot, r.nonce, *self._tp)
        for i, peer in job.tables:
            try:
                self._agent.notify(peer, note)
            except KVABIError as e:
                self._log.warning("%s: could not tell producer rank %d that request %s is "
                                  "done: %s", self._label, i, job.req_id, e)

    def _verify(self, p: PullWork, recs: dict, runs: dict, held: dict) -> None:
        """Every pulled token's checksum, per KV head this rank holds, equals the one the
        producer rank it was read from computed for that global head.  ``runs``: per group,
        which producer rank each local head came from (None: all from rank 0); ``held``:
        per group, the global heads each producer rank's layout holds (layouts its record
        vouched for)."""
        bs, rbs = self._block_size, p.remote.block_size
        for g, grp in enumerate(self._groups):
            src = token_slots(p.remote.blocks[g], rbs, p.start, p.num_tokens)
            dst = token_slots(p.dst_blocks[g], bs, p.start, p.num_tokens)
            keep = np.flatnonzero((src >= 0) & (dst >= 0))
            cache = kv_part(grp.parts)
            mine = head_checksums(cache, dst[keep])
            heads = shard_of(cache.layout).heads
            src_of = np.zeros(len(heads), np.int64)
            for run in runs.get(g) or ():
                src_of[run.dst_first:run.dst_first + run.count] = run.source
            for j, h in enumerate(heads):
                i = int(src_of[j])
                theirs = held[g][i]
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


def _check_record(rec: GrantRecord, remote, who: str = "") -> None:
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


def _check_rank(rec: GrantRecord, remote, rank: int) -> None:
    """The record at position ``rank`` of the parameters' grant tables was written by that
    producer rank, of the size they list (the order and count of the producer's ranks,
    which negotiation and the plans use, are the producer's)."""
    if (rec.rank, rec.ranks) != (rank, remote.ranks):
        field = f"kvabi_grants[{rank}]" if remote.ranks > 1 else "kvabi_grants"
        raise KVABIError(f"{field}: the record there was written by producer rank "
                         f"{rec.rank} of {rec.ranks}, the parameters list it as rank {rank} "
                         f"of {remote.ranks}")


def _check_claim(rec: GrantRecord, g: int, part: str, peer, rank: str = "") -> None:
    """The handshake of ``part`` the parameters gave states what the producer's record
    vouches for: layout, planes, scales and model (KVABIError naming the first field that
    differs)."""
    claim = next((c for c in rec.parts[g] if c.name == part), None)
    field = f"kvabi_handshakes[{g}].{part}{rank}"
    if claim is None:
        raise KVABIError(f"{field}: the producer serves no such part")
    given = part_claim(part, peer.handshake)
    for attr, sub, what in PartClaim.FIELDS:
        if getattr(claim, attr) != getattr(given, attr):
            raise KVABIError(f"{field}{sub}: {what}")


__all__ = ["Consumer", "GRANT_POLL_S", "NEGOTIATIONS", "USED_GRANTS"]
