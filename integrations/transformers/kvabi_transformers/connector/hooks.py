"""Where the connector meets transformers' continuous batching: a scheduler that hands
requests to it where they enter, end or are cancelled, a batch processor that steps it
before each batch is scheduled, and an output router that attaches a producer's answer to
the request's finished output.  Each calls the connector and otherwise does what
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


class PDOutputRouter(OutputRouter):
    """An output router that sets ``kv_transfer_params`` on every finished output: the
    producer's answer (``connector()``'s, None when there is none)."""

    def __init__(self, connector):
        super().__init__()
        self._connector = connector

    def _attach(self, output) -> None:
        conn = self._connector()
        if conn is not None and output.is_finished():
            output.kv_transfer_params = conn.producer.answer(output.request_id)

    def deliver(self, output):
        self._attach(output)
        super().deliver(output)

    def deliver_batch(self, outputs):
        for o in outputs:
            self._attach(o)
        super().deliver_batch(outputs)


__all__ = ["PDBatchProcessor", "PDOutputRouter", "PDSchedulerMixin", "pd_scheduler"]
