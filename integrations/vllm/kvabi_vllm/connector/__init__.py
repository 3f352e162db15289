"""``KvabiConnector``: a vLLM KV connector that moves KV between engines whose caches differ
in layout and block size, and keeps a host tier.

Load it with ``KVTransferConfig(kv_connector="KvabiConnector",
kv_connector_module_path="kvabi_vllm.connector", kv_role=...)``:

- ``kv_producer`` (prefill engine): a request sent with ``kv_transfer_params=
  {"do_remote_decode": True}`` keeps its blocks when it finishes; its output's
  ``kv_transfer_params`` carry the block ids, this engine's kvabi handshakes (per KV cache
  group, one per *part*: the layout descriptor, the registered planes, the NIXL agent's
  metadata) and a grant: what it holds, published where the decode engine reads it first.
- ``kv_consumer`` (decode engine): a request carrying those params, validated where it
  enters, reads the grant, then the prompt's KV with one NIXL READ per part off the
  engine's thread, planned by ``kvabi.transfer`` from the two layouts (relayout included),
  and checks every token's checksum; the last READ's notification (the grant's slot and
  nonce) frees the producer's blocks.  A refusal fails that request alone
  (``specs/security.md`` section 5).

The protocol is kvabi's (``specs/pd.md``, :mod:`kvabi.pd`), the same any engine speaks; this
package is vLLM's adapter over it: the front vLLM loads (this module), the scheduler side
(:mod:`.scheduler`, over ``kvabi.pd.Front``), the worker side (:mod:`.worker`, over
``kvabi.pd.CacheSide``), vLLM's cache as kvabi layouts (:mod:`.cache_layouts`), vLLM's
metadata classes (:mod:`.meta`), configuration (:mod:`.config`), statistics (:mod:`.stats`)
and the fixes its refusals suggest (:mod:`.fixes`).

Parts (:mod:`.cache_layouts`): a cache whose K and V share one layout serves it as ``kv``;
vLLM's CPU backend, whose keys are stored transposed, serves ``k`` and ``v``; every cache
with one ``kv`` layout also serves its ``k`` and ``v`` halves, and a cache with dense
block-heads an ``image`` (a block's bytes as one run) for peers of the very same format.
The decode side reads the image if both serve the same, else ``kv``, else ``k`` and ``v``.
- ``kv_role="kv_both"``: both of the above (two engines serving each other's prefills).
- Tensor parallelism (:mod:`.worker`): each worker's layouts state its shard of
  the model's KV heads; a producer of TP size M sends a list of M handshakes per part and
  M grant tables, each rank writing its own record of the one grant; each decode rank
  negotiates once per producer group and pulls its heads from the producer ranks holding
  them; a producer rank frees once every decode rank has said it is done.
- ``kv_connector_extra_config={"host_blocks": N}`` (any role): a host tier on
  ``kvabi.transfer.HostPool`` (cross-layer blocks): full blocks of a finished request are
  saved, and a later request whose prompt starts with them loads them instead of computing.
  Sliding-window groups keep (and need) only the blocks inside the window.  A request
  with ``kv_transfer_params={"kvabi_host": False}`` neither loads nor saves
  (``kvabi.pd.host_index``).  Timeouts and bounds: :mod:`.config`.

The layouts of the cache vLLM allocates are derived from its views (or taken from the kvabi
attention-backend plugin) and checked against the engine's own cache write at start with
``kvabi.probe.verify_layout``: a mismatch stops the engine before any transfer.

The class vLLM loads is a thin front, the shape of vLLM's own NixlConnector: in the
scheduler's process it forwards to a :class:`KvabiConnectorScheduler`, in the worker's to a
:class:`KvabiConnectorWorker` (attributes ``connector_scheduler`` / ``connector_worker``; the
other is None).  A subclass swaps either side through ``scheduler_class`` / ``worker_class``.
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorRole, SupportsHMA)

from ..env import log_with_vllm
from .config import ConnectorConfig
from .meta import KvabiHandshakeMetadata
from .scheduler import KvabiConnectorScheduler
from .stats import KvabiConnectorStats, KvabiPromMetrics
from .worker import KvabiConnectorWorker


class KvabiConnector(KVConnectorBase_V1, SupportsHMA):
    """P/D over NIXL across layouts and block sizes, and a host tier (module docstring)."""

    scheduler_class = KvabiConnectorScheduler
    worker_class = KvabiConnectorWorker

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        log_with_vllm()  # an in-process engine configured vLLM's logging after the plugin
        config = ConnectorConfig.from_vllm(vllm_config, kv_cache_config)
        self.connector_scheduler = self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.scheduler_class(config)
        else:
            self.connector_worker = self.worker_class(config, vllm_config)

    # ================================ worker side ================================
    def register_kv_caches(self, kv_caches):
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self.connector_worker.get_handshake_metadata()

    def start_load_kv(self, forward_context, **kwargs):
        self.connector_worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        return self.connector_worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids):
        return self.connector_worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self):
        """This interval's transfer figures (worker side; None when there are none)."""
        worker = self.connector_worker
        return None if worker is None else worker.kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvabiConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        return KvabiPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ================================ scheduler side ================================
    def set_xfer_handshake_metadata(self, metadata):
        self.connector_scheduler.set_xfer_handshake_metadata(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.connector_scheduler.get_num_new_matched_tokens(request,
                                                                   num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request):
        return self.connector_scheduler.get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                          num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and \
            self.connector_scheduler.has_pending_push_work()

    def update_connector_output(self, connector_output):
        self.connector_scheduler.update_connector_output(connector_output)


__all__ = ["KvabiConnector", "KvabiConnectorScheduler", "KvabiConnectorWorker",
           "KvabiHandshakeMetadata"]
