"""KvabiConnector's scheduler side: vLLM's scheduler hooks over :class:`kvabi.pd.Front`,
which reads each request's ``kv_transfer_params`` once, where it enters, and decides what
the worker side does for it (pull from a producer, load from or save to the host tier,
publish a grant, or report it refused).  It lives in the process of vLLM's scheduler and
reaches the worker side only through the step's
:class:`~kvabi_vllm.connector.meta.KvabiConnectorMetadata`.

A refused request (bad parameters, no grant slot) is failed alone through vLLM's own path
for a failed KV load: this side reports it as an asynchronous load, the worker side reports
that load failed, and vLLM finishes the request with an error (``kv_load_failure_policy=
"fail"``, the default) or computes it itself (``"recompute"``).
"""
from __future__ import annotations

import logging

from kvabi.pd import Front

from .config import ConnectorConfig
from .meta import KvabiConnectorMetadata, KvabiHandshakeMetadata, pd_blocks

log = logging.getLogger(__name__)


class KvabiConnectorScheduler:
    """The scheduler-side object behind :class:`~kvabi_vllm.connector.KvabiConnector`."""

    def __init__(self, config: ConnectorConfig):
        self.config = config
        self.front = Front(config.settings, block_size=config.block_size,
                           windows=config.windows, engine_id=config.engine, log=log,
                           label="KvabiConnector", settings_at="kv_connector_extra_config.")

    @property
    def refusals(self):
        """(request id, reason) of the latest refusals."""
        return self.front.refusals

    def set_xfer_handshake_metadata(self, metadata):
        """Every worker's messages, by tensor-parallel rank."""
        self.front.serve([metadata[r].served() for r in sorted(metadata)
                          if isinstance(metadata[r], KvabiHandshakeMetadata)])

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.front.matched(request.request_id, request.kv_transfer_params,
                                  request.prompt_token_ids or [], num_computed_tokens,
                                  getattr(request, "cache_salt", None))

    def get_loaded_kv_cache_group_ids(self, request):
        return tuple(range(len(self.config.groups)))

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        e = self.front.entry(request.request_id, request.kv_transfer_params,
                             request.prompt_token_ids or [])
        if not isinstance(e, str) and e.remote is not None and \
                isinstance(request.kv_transfer_params, dict):
            request.kv_transfer_params["do_remote_prefill"] = False
        self.front.allocated(request.request_id, request.kv_transfer_params,
                             request.prompt_token_ids or [], pd_blocks(blocks.get_block_ids()),
                             num_external_tokens, getattr(request, "cache_salt", None))

    def build_connector_meta(self, scheduler_output):
        return KvabiConnectorMetadata(work=self.front.take_work())

    def request_finished(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED)
        return self.front.finished(request.request_id, request.kv_transfer_params,
                                   normal=normal, tokens=request.all_token_ids,
                                   num_computed=int(request.num_computed_tokens),
                                   blocks=pd_blocks(block_ids),
                                   salt=getattr(request, "cache_salt", None))

    def has_pending_push_work(self) -> bool:
        return self.front.has_pending_work()

    def update_connector_output(self, connector_output):
        self.front.sent(connector_output.finished_sending or ())

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table (for tests and monitoring)."""
        return self.front.table_sizes()


__all__ = ["KvabiConnectorScheduler"]
