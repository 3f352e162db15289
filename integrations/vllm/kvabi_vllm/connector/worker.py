"""KvabiConnector's worker side: describes the cache vLLM hands it with kvabi layouts
(:mod:`.cache_layouts`, checked against the engine's own cache write), and runs a
:class:`kvabi.pd.CacheSide` over it: NIXL, grants (producer), pulls off the engine's thread
(consumer), the host tier; it tells vLLM which transfers finished or failed.  It lives in
the worker process, next to the cache.

Under tensor parallelism every worker is one rank: its layouts state its shard of the
model's KV heads (:func:`kvabi.pd.with_shard`); the protocol between ranks is kvabi.pd's.
"""
from __future__ import annotations

import logging

from kvabi.pd import CacheGroup, CacheSide, EngineCaches, with_shard

from .cache_layouts import (IMAGE, KT_V, engine_writer, group_parts, image_part, interior_of,
                            is_kvabi_backend, kvabi_backend_part, kt_v_halves, part_cache,
                            tp_shard_info, verify_part)
from .config import ConnectorConfig
from .fixes import with_fix
from .meta import KvabiConnectorMetadata, KvabiHandshakeMetadata
from .stats import KvabiConnectorStats

log = logging.getLogger(__name__)


class KvabiConnectorWorker:
    """The worker-side object behind :class:`~kvabi_vllm.connector.KvabiConnector`."""

    def __init__(self, config: ConnectorConfig, vllm_config):
        self.config = config
        self._vllm_config = vllm_config
        self.cache_side: CacheSide | None = None
        #: this interval's pulls and refusals, drained by vLLM (kv_connector_stats)
        self.transfer_stats = KvabiConnectorStats()

    # -- start ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        """Describe each KV cache group's memory with kvabi layouts (one, or a K and a V
        part), check them against the engine's own write, and serve them."""
        from kvabi.pd.parts import split_kv

        from ..kv_quant import FP8

        cfg, vc = self.config, self._vllm_config
        ctx = vc.compilation_config.static_forward_context
        layout_name = vc.cache_config.kv_cache_layout
        rank, size, heads = tp_shard_info(vc, cfg.num_kv_heads or None)
        kv_dtype = FP8.get(vc.cache_config.cache_dtype)  # fp8: codes
        groups = []
        for gi, group in enumerate(cfg.groups):
            names = [n for n in group.layer_names if n in kv_caches]
            tensors = [kv_caches[n] for n in names]
            # per-tensor scales are layer state: they travel in the handshake
            scales = None if kv_dtype is None else tuple(
                (ctx[n]._k_scale_float, ctx[n]._v_scale_float) for n in names)
            backend = getattr(ctx.get(names[0]), "attn_backend", None)
            if is_kvabi_backend(backend):  # the plugin's own layout; its backend's write
                part, cache, write = kvabi_backend_part(tensors, vc)
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
                parts += split_kv(parts[0][1]) or []  # for peers that hold K and V apart
            # under TP every layout says which of the model's heads this rank holds
            groups.append(CacheGroup([(n, with_shard(c, rank, size, heads)) for n, c in parts],
                                     cfg.windows[gi], scales))
        caches = EngineCaches(groups, block_size=cfg.block_size,
                              max_tokens=max(cfg.max_model_len, 1), engine_id=cfg.engine,
                              rank=rank, tp_size=size, identity=cfg.model,
                              host_framework="torch")
        self.cache_side = CacheSide(cfg.settings, caches, log=log, label="KvabiConnector",
                                    fix=with_fix, after_pull=self._after_pull,
                                    after_load=self._after_load,
                                    settings_at="kv_connector_extra_config.")
        log.info("KvabiConnector: %d KV cache group(s): %s", len(groups), "; ".join(
            f"{c.layout.name} {c.layout.order or c.layout.component_names} "
            f"N={c.layout.size('N')}" for g in groups for _, c in g.parts))

    def part_layouts(self) -> list[dict[str, str]]:
        """Per KV cache group, each part's layout name (what this engine serves and reads)."""
        return self.cache_side.part_layouts()

    def get_handshake_metadata(self):
        served = self.cache_side.served() if self.cache_side is not None else None
        return None if served is None else KvabiHandshakeMetadata.of(served)

    # -- each step ---------------------------------------------------------------------------
    def start_load_kv(self, meta) -> None:
        """The step's work from the scheduler side, in its order."""
        if isinstance(meta, KvabiConnectorMetadata):
            self.cache_side.apply(meta.work)

    def get_transfer_results(self, finished_req_ids):
        """(finished sending, finished receiving, failed receiving) request ids: grants
        read by a decode engine or expired, host saves done; pulls that ended (a failed
        one is in both receiving sets, as vLLM expects)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import \
            KVConnectorTransferResults

        r = self.cache_side.results(finished_req_ids)
        for why in r.failed.values():
            self.transfer_stats.record_refusal(why)
        return KVConnectorTransferResults(finished_sending=r.sent, finished_recving=r.received,
                                          failed_recving=set(r.failed))

    def get_finished(self, finished_req_ids):
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def kv_connector_stats(self) -> KvabiConnectorStats | None:
        """This interval's transfer figures (None when there are none)."""
        figures = self.cache_side.consumer.figures if self.cache_side is not None and \
            self.cache_side.consumer is not None else ()
        while figures:
            secs, read_s, nbytes, regions, relayout = figures.popleft()
            self.transfer_stats.record_pull(secs, read_s, nbytes, regions, relayout=relayout)
        return None if self.transfer_stats.is_empty() else self.transfer_stats.take()

    def get_block_ids_with_load_errors(self):
        return set()  # failed loads are reported per request (failed_recving)

    def _after_pull(self, pull, group: int, part: str, cache, dst_slots) -> None:
        """Called once a part of a group has arrived (a place for checks; nothing here)."""

    def _after_load(self, load, group: int, part: str, cache, blocks) -> None:
        """Called once a part of a group's host blocks are back (nothing here)."""

    # -- what it holds (tests, monitoring, tools) -------------------------------------------
    @property
    def refusals(self):
        """(request id, reason) of the latest failed loads."""
        return self.cache_side.refusals

    @property
    def pull_stats(self):
        """Per pull (request id, seconds, regions, bytes, READ seconds, grant seconds,
        checksum seconds)."""
        c = self.cache_side.consumer if self.cache_side is not None else None
        return c.pull_stats if c is not None else ()

    @property
    def host_stats(self) -> dict:
        h = self.cache_side.host if self.cache_side is not None else None
        return dict(h.stats) if h is not None else {"saved": 0, "loaded": 0, "evicted": 0}

    @property
    def ignored_notifications(self) -> int:
        p = self.cache_side.producer if self.cache_side is not None else None
        return p.ignored_notifications if p is not None else 0

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table (for tests and monitoring)."""
        return self.cache_side.table_sizes()

    def shutdown(self):
        if self.cache_side is not None:
            self.cache_side.close()


__all__ = ["KvabiConnectorWorker"]
