"""The kit's reference P/D engine: kvabi.pd over numpy caches of a chosen preset, block size
and tensor-parallel size (one cache side per rank, one front), in this process.  It is the
honest (or, with ``fault``, the hostile) peer the kit runs against an engine, and an
:class:`~.engine.EngineUnderTest` itself (``kvabi conformance --pd reference``).

As a producer it fills each prompt's KV with values drawn from the prompt's tokens (the same
on every rank's shard), lists the null block where a sliding window allows it, and holds
the blocks until they are reported sent.  As a consumer it allocates blocks, pulls and
snapshots the KV it received (:func:`~.values.kv_values`) when its cache sides say so.

Faults of a hostile producer (``fault``): ``corrupt`` (bytes changed after the record was
written), ``lie_tokens``, ``lie_blocks``, ``lie_checksums``, ``lie_layout`` (a record that
vouches for other tokens, blocks, KV or layouts than the answer), ``frozen`` (the record is
never written), ``dying`` (the agent is gone after the answer).

Faults planted in its adapter (``planted``: what the kit must catch when this engine is the
one under test): ``swapped_kv`` (the adapter states keys where the engine writes values),
``shifted_blocks`` (it tells kvabi other destination blocks than the request's),
``early_free`` (it frees a granted request's blocks at once).
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import json
import time

import attrs
import numpy as np

from ...memory.cache import KVCache
from ...layout.descriptor import Layout
from ...pd import ASK, CacheGroup, CacheSide, EngineCaches, Front, PDSettings, with_shard
from ...pd.record import GrantRecord
from ...pd.slots import NULL, null_allowed, token_slots
from ...model.shard import Shard
from ...model.spec import KVSpec
from .engine import EngineUnderTest, ModelFacts, Outcome
from .values import kv_values, merge

FAULTS = ("corrupt", "lie_tokens", "lie_blocks", "lie_checksums", "lie_layout", "frozen",
          "dying")
PLANTED = ("swapped_kv", "shifted_blocks", "early_free")
#: seconds a decode waits beyond the pull deadline for the cache sides' answer
SLACK = 10.0


class ReferenceEngine(EngineUnderTest):
    """A reference engine of ``facts`` in layout ``preset`` (any ``Layout.preset`` name)
    with ``block_size`` tokens a block (default the facts'), ``tp`` ranks and
    ``num_blocks`` blocks per group."""

    name = "reference"

    def __init__(self, facts: ModelFacts | None = None, *, preset: str = "vllm.LBHNC",
                 block_size: int | None = None, tp: int = 1, num_blocks: int = 96,
                 seed: int = 0, fault: str | None = None, label: str = "reference",
                 after_pull=None, planted: str | None = None):
        facts = facts or ModelFacts()
        self._facts = attrs.evolve(facts, block_size=block_size or facts.block_size,
                                   tp_size=tp)
        self.preset, self.tp, self.num_blocks, self.seed = preset, tp, num_blocks, seed
        if fault not in (None,) + FAULTS or planted not in (None,) + PLANTED:
            raise ValueError(f"fault: one of {FAULTS}, planted: one of {PLANTED}")
        self.fault, self.label, self._after_pull = fault, label, after_pull
        self.planted = planted
        self.name = f"{label}({preset}, {self._facts.block_size}-token blocks, TP {tp}" + \
            "".join(f", {x}" for x in (fault, planted) if x) + ")"
        self._sides: list[CacheSide] = []
        self._front: Front | None = None
        self._ids = itertools.count()

    # -- life ------------------------------------------------------------------------------
    def facts(self) -> ModelFacts:
        return self._facts

    def start(self, role: str, settings: PDSettings) -> None:
        f = self._facts
        self.settings = attrs.evolve(settings, role=role, model_id=f.model_id)
        bs = f.block_size
        ranks, self._own = [], []
        for r in range(self.tp):
            heads = len(Shard.tp(r, self.tp, f.num_kv_heads).heads)
            groups, own = [], []
            for w in f.windows:
                spec = KVSpec("sliding_window" if w else "full", block_size=bs,
                              num_kv_heads=heads, head_dim=f.head_dim, dtype=f.dtype,
                              **({"window": w} if w else {}))
                lay = Layout.preset(self.preset, spec, num_blocks=self.num_blocks,
                                    num_layers=f.num_layers)
                cache = with_shard(KVCache.allocate(lay, "numpy"), r, self.tp, f.num_kv_heads)
                own.append(cache)  # as the engine's kernels place its bytes
                served = KVCache.wrap(self._adapter_layout(cache.layout), list(cache))
                groups.append(CacheGroup.of(served, window=w))
            self._own.append(own)
            ranks.append(EngineCaches(groups, block_size=bs, max_tokens=f.max_tokens,
                                      engine_id=self.label, rank=r, tp_size=self.tp,
                                      identity=f"{self.label}|{f.dtype}"))
        self._sides = [CacheSide(self.settings, c, label=self.label, after_pull=self._after_pull)
                       for c in ranks]
        self._front = Front(self.settings, block_size=bs, windows=f.windows,
                            engine_id=self.label, label=self.label)
        self._front.serve([s.served() for s in self._sides])
        self._free = [collections.deque(range(self.num_blocks)) for _ in f.windows]
        self._held: dict[str, list] = {}        # producer: request -> blocks (until sent)
        self._by_nonce: dict[str, tuple] = {}   # producer: nonce -> (request, n, blocks)
        self._prompts: dict[str, list] = {}     # producer: request -> its prompt
        self._sent_by: collections.Counter = collections.Counter()
        self._pending: dict[str, dict] = {}     # consumer: request -> what it waits for
        self._done: dict[str, tuple] = {}       # consumer: request -> (failed reason, ranks)
        self._install_fault()

    def stop(self) -> None:
        for s in self._sides:
            s.close()
        self._sides = []

    # -- memory ----------------------------------------------------------------------------
    def _alloc(self, g: int, count: int) -> list:
        free = self._free[g]
        if len(free) < count:
            raise RuntimeError(f"{self.name}: out of blocks")
        return [free.popleft() for _ in range(count)]

    def _release(self, blocks) -> None:
        for g, ids in enumerate(blocks):
            self._free[g].extend(int(b) for b in ids if b != NULL)

    def _truth(self, prompt, g: int, n: int) -> np.ndarray:
        """The KV of ``prompt``'s first ``n`` positions in group ``g``: float32
        [n, layers, 2, heads, dim], drawn from the prompt (the same on every rank)."""
        f = self._facts
        digest = hashlib.blake2b(np.asarray(prompt[:n], np.int64).tobytes() +
                                 bytes([g]), digest_size=8).digest()
        rng = np.random.default_rng([self.seed, int.from_bytes(digest, "little")])
        return rng.standard_normal((n, f.num_layers, 2, f.num_kv_heads, f.head_dim)) \
            .astype(np.float32)

    def _fill(self, prompt, blocks) -> None:
        bs = self._facts.block_size
        n = len(prompt)
        for g, ids in enumerate(blocks):
            kv = self._truth(prompt, g, n)
            slots = token_slots(ids, bs, 0, n)
            keep = np.flatnonzero(slots >= 0)
            for own in self._own:
                cache = own[g]
                heads = list(cache.layout.shard.heads) if cache.layout.shard else \
                    list(range(self._facts.num_kv_heads))
                for layer in range(self._facts.num_layers):
                    for k in range(2):
                        view = cache.kv_view(layer, k)  # [B, N, H, D]
                        s = slots[keep]
                        view[s // bs, s % bs] = kv[keep][:, layer, k][:, heads] \
                            .astype(view.dtype)

    def _values(self, blocks, start: int, n: int) -> list:
        """Per group, the KV (by global head) of positions ``start .. n-1`` in ``blocks``
        (positions of a null block: not held)."""
        bs = self._facts.block_size
        out = []
        for g, ids in enumerate(blocks):
            slots = token_slots(ids, bs, start, n - start)
            out.append(merge(kv_values(own[g], slots) for own in self._own))
        return out

    # -- the steps -------------------------------------------------------------------------
    def _step(self) -> None:
        work = self._front.take_work()
        results = []
        for side in self._sides:
            side.apply(work)
            results.append(side.results(finished=set(self._held)))
        sent = set()
        for res in results:
            for r in res.sent:
                self._sent_by[r] += 1
                if self._sent_by[r] == len(self._sides):
                    sent.add(r)
                    del self._sent_by[r]
        for r in sent:
            self._release(self._held.pop(r, []))
        self._front.sent(sent)
        for res in results:
            for r in res.received:
                reason, count = self._done.get(r, (None, 0))
                self._done[r] = (reason or res.failed.get(r), count + 1)

    def step(self, seconds: float = 0.0) -> None:
        t0 = time.monotonic()
        while True:
            self._step()
            if time.monotonic() - t0 >= seconds:
                return
            time.sleep(0.01)

    # -- producer ------------------------------------------------------------------------
    def prefill(self, prompts: list) -> list:
        bs, out = self._facts.block_size, []
        for prompt in prompts:
            rid = f"{self.label}-{next(self._ids)}"
            n = len(prompt)
            blocks = []
            for g, w in enumerate(self._facts.windows):
                drop = null_allowed(w, bs, n)
                ids = self._alloc(g, int((~drop).sum()))
                row = np.full(drop.size, NULL, np.int64)
                row[~drop] = ids
                blocks.append(row.tolist())
            self._fill(prompt, blocks)
            self._prompts[rid] = list(prompt)
            hold, ans = self._front.finished(rid, dict(ASK), normal=True, tokens=list(prompt),
                                             num_computed=n, blocks=blocks)
            if hold and self.planted == "early_free":  # the fault: freed at once, reused next
                for g, ids in enumerate(blocks):
                    self._free[g].extendleft(int(b) for b in ids if b != NULL)
                self._by_nonce[ans["kvabi_grant"]["nonce"]] = (rid, n, blocks)
            elif hold:
                self._held[rid] = blocks
                self._by_nonce[ans["kvabi_grant"]["nonce"]] = (rid, n, blocks)
            else:
                self._release(blocks)
            out.append(ans)
        if self.fault == "dying":  # gone: no record, no agent answering (metadata to fetch)
            for side in self._sides:
                side.close()
            return [_without_metadata(a) for a in out]
        self._step()  # the records are written
        return out

    def kv(self, answer: dict) -> list:
        """What the engine computed for the request (its truth, not its blocks now), at the
        positions it holds."""
        from ...util.dtypes import numpy_dtype

        rid, n, blocks = self._by_nonce[answer["kvabi_grant"]["nonce"]]
        prompt = self._prompts[rid]
        dt = numpy_dtype(self._facts.dtype)
        out = []
        for g, ids in enumerate(blocks):
            kv = self._truth(prompt, g, n).astype(dt)  # [n, layers, 2, heads, dim]
            held = token_slots(ids, self._facts.block_size, 0, n) >= 0
            raw = kv.view(np.uint8).reshape(kv.shape[:4] + (-1,))
            raw[~held] = 0
            out.append({"_held": held, **{name: {h: raw[:, :, k, h] for h in
                                                 range(self._facts.num_kv_heads)}
                                          for k, name in enumerate(("key", "value"))}})
        return out

    # -- consumer ------------------------------------------------------------------------
    def decode(self, requests: list) -> dict:
        bs, out, t0 = self._facts.block_size, {}, time.monotonic()
        for rid, prompt, params in requests:
            count, _ = self._front.matched(rid, params, prompt, 0)
            blocks = [self._alloc(g, -(-(len(prompt) + 1) // bs))
                      for g in range(len(self._facts.windows))]
            told = blocks if self.planted != "shifted_blocks" else \
                [[b + 1 for b in ids] for ids in blocks]  # the fault: other blocks
            self._front.allocated(rid, params, prompt, told, count)
            self._pending[rid] = {"prompt": prompt, "params": params, "blocks": blocks,
                                  "pulled": count}
            if count == 0:  # nothing to receive: a plain request
                out[rid] = Outcome(None, None, 0.0)
        wait = self.settings.pull_timeout_s + SLACK
        while any(r not in out for r in self._pending) and time.monotonic() - t0 < wait:
            self._step()
            for rid, p in self._pending.items():
                got = self._done.get(rid)
                if rid in out or got is None or got[1] < len(self._sides):
                    continue
                reason = got[0]
                kv = None if reason is not None else self._values(p["blocks"], 0, p["pulled"])
                out[rid] = Outcome(reason, kv, time.monotonic() - t0)
            time.sleep(0.005)
        for rid, p in self._pending.items():
            out.setdefault(rid, Outcome(f"kit: no answer within {wait:g} s"))
            self._done.pop(rid, None)
            self._front.finished(rid, p["params"], normal=out[rid].reason is None,
                                 tokens=p["prompt"], num_computed=len(p["prompt"]),
                                 blocks=p["blocks"])
            self._release(p["blocks"])
        self._pending = {}
        return out

    # -- what it holds -----------------------------------------------------------------------
    def tables(self) -> dict:
        out = dict(self._front.table_sizes())
        for side in self._sides:
            for k, v in side.table_sizes().items():
                out[k] = out.get(k, 0) + v
        out["held_requests"] = len(self._held)
        return out

    def blocks(self) -> tuple:
        return sum(len(f) for f in self._free), self.num_blocks * len(self._free)

    # -- what its adapter states -----------------------------------------------------------
    def _adapter_layout(self, layout):
        """The layout the adapter serves for memory the engine lays out as ``layout``."""
        if self.planted != "swapped_kv":
            return layout
        swap = {"key": "value", "value": "key"}
        form = layout.component_form()
        comps = [attrs.evolve(c, name=swap.get(c.name, c.name)) for c in form.components]
        return Layout(sizes={a: form.size(a) for a in ("L", "B", "N", "H")}, components=comps,
                      plane_bytes=form.plane_nbytes, name=f"{layout.name}.swapped",
                      shard=layout.shard)

    # -- a hostile producer --------------------------------------------------------------------
    def _install_fault(self) -> None:
        if self.fault is None or not self._sides:
            return
        if self.fault not in FAULTS:
            raise ValueError(f"fault: one of {FAULTS}, got {self.fault!r}")
        for side in self._sides:
            if side.producer is None:
                continue
            prod = side.producer
            publish, write = prod.publish, prod.table.write
            if self.fault == "frozen":
                prod.publish = lambda g: None
            elif self.fault == "corrupt":
                def corrupt(g, publish=publish, side=side):
                    publish(g)
                    slot = int(token_slots(g.blocks[0], self._facts.block_size, 0, 1)[0])
                    view = side.caches.groups[0].kv.kv_view(0, 0)
                    bs = self._facts.block_size
                    view[slot // bs, slot % bs] += 1
                prod.publish = corrupt
            elif self.fault.startswith("lie_"):
                def lying(slot, record, req_id, deadline, write=write, kind=self.fault):
                    record = attrs.evolve(record, **_lie(kind, record))
                    write(slot, record, req_id, deadline)
                prod.table.write = lying


def _without_metadata(answer):
    """``answer`` with its handshakes stating no NIXL metadata (a peer fetches it from the
    agent's address)."""
    if answer is None:
        return None

    def strip(m):
        d = json.loads(m)
        d.pop("metadata", None)
        return json.dumps(d)

    def place(v):
        return [strip(m) for m in v] if isinstance(v, list) else strip(v)
    out = dict(answer)
    out["kvabi_grants"] = place(answer["kvabi_grants"])
    out["kvabi_handshakes"] = [{k: place(v) for k, v in g.items()}
                               for g in answer["kvabi_handshakes"]]
    return out


def _lie(kind: str, rec: GrantRecord) -> dict:
    if kind == "lie_tokens":
        return {"tokens": bytes(16)}
    if kind == "lie_blocks":
        return {"blocks": tuple(np.where(b >= 0, b + 1, b) for b in rec.blocks)}
    if kind == "lie_checksums":
        return {"checksums": tuple(c ^ np.uint32(1) for c in rec.checksums)}
    return {"parts": tuple(tuple(attrs.evolve(p, layout=bytes(16)) for p in ps)
                           for ps in rec.parts)}


__all__ = ["FAULTS", "ReferenceEngine"]
