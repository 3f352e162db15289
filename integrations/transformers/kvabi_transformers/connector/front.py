"""The connector of one continuous-batching run: kvabi.pd's
:class:`~kvabi.pd.Endpoint` (front and cache side in this process) driven from
transformers' generation loop, with the engine facts kvabi.pd asks for.

Every call but :meth:`TransformersConnector.take_answer` comes from the generation loop's thread,
which alone changes the scheduler and the allocator: a request enters
(:meth:`~TransformersConnector.enter`, from ``Scheduler.add_waiting_request``), the loop
steps (:meth:`~TransformersConnector.step`, before each batch is scheduled), a request ends
(:meth:`~TransformersConnector.finish`, from ``Scheduler.finish_request``) or is cancelled
(:meth:`~TransformersConnector.cancel`).  Pulls run on kvabi.pd's threads; their results
are taken at the next step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid

from kvabi import KVABIError
from kvabi.pd import Endpoint

from .caches import SessionCaches
from .consumer import Consumer
from .producer import Producer

log = logging.getLogger("kvabi_transformers.pd")

#: configuration keys that say where a checkpoint sits, not what the model is
NOT_IDENTITY = ("_name_or_path", "transformers_version")


def model_identity(config) -> str:
    """The model's identity in this engine's handshakes (a consumer refuses a producer
    serving another model): ``config:`` and a digest of the model's configuration as its
    checkpoint states it (not as loaded: ``dtype`` follows the engine's choice, and the dtype
    is negotiated on its own), without where it was loaded from: the digest vLLM's
    KvabiConnector states for one checkpoint."""
    from pathlib import Path

    path = getattr(config, "_name_or_path", "") or ""
    if path and (Path(path) / "config.json").is_file():
        config = type(config).from_pretrained(path)
    cfg = config.to_dict()
    for k in NOT_IDENTITY:
        cfg.pop(k, None)
    text = json.dumps(cfg, sort_keys=True, default=str)
    return "config:" + hashlib.sha256(text.encode()).hexdigest()[:32]


class Incoming:
    """kv_transfer_params given with ``add_request`` (any thread), until their request
    enters the generation loop (bounded: the caller takes back those it did not add)."""

    def __init__(self):
        self._params: dict[str, object] = {}
        self._lock = threading.Lock()

    def put(self, rid: str, params) -> None:
        with self._lock:
            self._params[rid] = params

    def pop(self, rid: str):
        with self._lock:
            return self._params.pop(rid, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._params)


class TransformersConnector:
    """P/D for one paged cache (``cache``, a KvabiPagedCache) and its scheduler, under
    ``options`` (:class:`~.settings.PDOptions`); ``router``: the manager's output router
    (failed requests are delivered through it); ``incoming``: the manager's
    :class:`Incoming`."""

    def __init__(self, cache, options, *, model_config, router, incoming):
        self.cache = cache
        self.options = options
        self.router = router
        self.scheduler = None  # set by the scheduler that drives it
        self.caches = SessionCaches(cache.kvabi)
        s = options.settings
        if s.model_id is None:
            import attrs

            s = attrs.evolve(s, model_id=model_identity(model_config))
        self.settings = s
        session = cache.kvabi
        longest = options.max_model_len or int(getattr(model_config, "max_position_embeddings",
                                                       0) or 0)
        capacity = session.num_blocks * session.block_size
        self.engine_id = options.engine_id or f"tf{uuid.uuid4().hex[:8]}"
        self.endpoint = Endpoint(s, self.caches.engine_caches(
            engine_id=self.engine_id, max_tokens=min(longest, capacity) if longest else capacity,
            identity=s.model_id or ""), log=log, label="kvabi-transformers")
        self._incoming = incoming
        #: request id -> its kv_transfer_params, while it is live
        self.params: dict[str, object] = {}
        self.consumer = Consumer(self)
        self.producer = Producer(self)
        #: per step where anything ended: what (for tests and monitoring)
        self.stats = {"pulled": 0, "pull_failed": 0, "held": 0, "freed": 0}

    # -- any thread ----------------------------------------------------------------------
    def take_answer(self, rid: str):
        """A finished producer request's answer (``kv_transfer_params``), or None."""
        return self.producer.take_answer(rid)

    # -- the generation loop's thread ----------------------------------------------------
    def enter(self, state) -> bool:
        """A request enters the scheduler: True when the connector takes it (a pull, or a
        refusal); False: the scheduler queues it."""
        params = self._incoming.pop(state.request_id)
        if params is None:
            return False
        self.params[state.request_id] = params
        return self.consumer.enter(state, params)

    def step(self) -> None:
        """Once per loop iteration: kvabi.pd's step work, then what ended."""
        res = self.endpoint.step()
        if res.received:
            self.stats["pulled"] += len(res.received) - len(res.failed)
            self.stats["pull_failed"] += len(res.failed)
        self.consumer.ended(res.received, res.failed)
        if res.sent:
            self.stats["freed"] += len(res.sent)
            self.producer.sent(res.sent)

    def finish(self, state) -> bool:
        """``state`` ended (finished, failed): True when its blocks are now held."""
        rid = state.request_id
        self.consumer.pulled.discard(rid)
        params = self.params.pop(rid, None)
        if params is None:
            return False
        held = self.producer.finish(state, params)
        self.stats["held"] += held
        return held

    def cancel(self, rid: str) -> bool:
        """A request is cancelled: True when the connector handles it (waiting for blocks or
        pulling); otherwise it is forgotten here and the scheduler cancels it."""
        if self.consumer.cancel(rid):
            return True
        params = self.params.pop(rid, None)
        if params is not None:
            self.endpoint.finished(rid, params, normal=False, tokens=[], num_computed=0,
                                   blocks=[[] for _ in self.caches.caches])
        self.consumer.pulled.discard(rid)
        return False

    def forget(self, state) -> None:
        """``state`` leaves without finishing in the scheduler: its tables are cleaned."""
        rid = state.request_id
        params = self.params.pop(rid, None)
        self.consumer.pulled.discard(rid)
        if params is not None:
            self.endpoint.finished(rid, params, normal=False, tokens=state.initial_tokens,
                                   num_computed=0, blocks=[[] for _ in self.caches.caches])

    def fail(self, state, reason: str) -> None:
        """``state`` fails alone, with ``reason``."""
        self.forget(state)
        self.router.fail_and_deliver(state, KVABIError(reason))

    def busy(self) -> bool:
        """Whether requests wait for blocks or pulls (the loop must keep running)."""
        return bool(len(self.consumer))

    def pulls(self, last: int = 64) -> list[dict]:
        """The latest pulls' figures (request, seconds in all, in READs, to the grant record
        checked, of the checksums; regions; bytes), oldest first."""
        consumer = self.endpoint.cache_side.consumer
        rows = list(consumer.pull_stats)[-last:] if consumer is not None else []
        return [{"request": r, "seconds": s, "regions": n, "bytes": b, "read_s": rd,
                 "grant_s": g, "checksum_s": c} for r, s, n, b, rd, g, c in rows]

    def part_layouts(self) -> list[dict[str, str]]:
        """Per KV cache group, each served part's layout name."""
        return self.endpoint.cache_side.part_layouts()

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table here and in kvabi.pd (the front's and the
        cache side's added up, as the P/D kit reads them; tests, monitoring)."""
        out = dict(self.endpoint.front.table_sizes())
        for k, v in self.endpoint.cache_side.table_sizes().items():
            out[k] = out.get(k, 0) + v
        out.update(incoming=len(self._incoming), params=len(self.params),
                   waiting=len(self.consumer.waiting),
                   pulling_requests=len(self.consumer.pulling),
                   pulled=len(self.consumer.pulled), held_requests=len(self.producer.held),
                   answers=len(self.producer.answers))
        return out

    def close(self) -> None:
        self.endpoint.close()


__all__ = ["TransformersConnector", "model_identity"]
