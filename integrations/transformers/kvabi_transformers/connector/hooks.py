"""Where the connector meets transformers' continuous batching: a scheduler that hands
requests to it where they enter, end or are cancelled, a batch processor that steps it
before each batch is scheduled, and an output router that completes a finished output (a
producer's answer, token ids).  Each calls the connector and otherwise does what
transformers does (these methods are checked at ``use()``, ``compat.OVERRIDDEN``).
"""
from __future__ import annotations

from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchProcessor, OutputRouter)


class PDSchedulerMixin:
    """Put before one of transformers' schedulers (:func:`pd_scheduler`); ``kvabi_pd`` is
    the connector."""

    kvabi_pd = None

    def add_waiting_request(self, state):
        if self.kvabi_pd.enter(state):
            return
        super().add_waiting_request(state)

    def finish_request(self, request_id):
        state = self.active_requests.get(request_id)
        if state is not None and self.kvabi_pd.finish(state):
            self.active_requests.pop(request_id, None)  # its blocks stay, held
            return
        super().finish_request(request_id)

    def set_request_cancellation(self, request_id):
        if self.kvabi_pd.cancel(request_id):
            return
        super().set_request_cancellation(request_id)

    def has_pending_requests(self):
        return super().has_pending_requests() or self.kvabi_pd.busy()


_SCHEDULERS: dict = {}


def pd_scheduler(cls):
    """``cls`` (a transformers scheduler class) with :class:`PDSchedulerMixin` before it."""
    sub = _SCHEDULERS.get(cls)
    if sub is None:
        sub = _SCHEDULERS[cls] = type(f"PD{cls.__name__}", (PDSchedulerMixin, cls), {})
    return sub


class PDBatchProcessor(ContinuousBatchProcessor):
    """transformers' batch processor, stepping the connector ``kvabi_pd`` first."""

    kvabi_pd = None

    def prepare_next_batch(self):
        self.kvabi_pd.step()
        return super().prepare_next_batch()

    def fail_all_requests(self, error):
        super().fail_all_requests(error)
        self.kvabi_pd.consumer.fail_all(error)


class KvabiOutputRouter(OutputRouter):
    """An output router that completes every finished output before it is delivered:
    ``kv_transfer_params``, the producer's answer (None where there is none), and the
    request's token ids where its caller asked for them (``manager``: a KvabiManager)."""

    def __init__(self, manager):
        super().__init__()
        self._manager = manager

    def _attach(self, output) -> None:
        if output.is_finished():
            self._manager.finished_output(output)

    def deliver(self, output):
        self._attach(output)
        super().deliver(output)

    def deliver_batch(self, outputs):
        for o in outputs:
            self._attach(o)
        super().deliver_batch(outputs)


__all__ = ["PDBatchProcessor", "KvabiOutputRouter", "PDSchedulerMixin", "pd_scheduler"]
