"""What an HTTP request asked beyond transformers' own fields, handed to the manager's
``add_request`` through a context variable: transformers' handlers call ``add_request``
from the request's own task, with only the fields they know."""
from __future__ import annotations

import contextlib
import contextvars

import attrs


@attrs.frozen
class RequestAsk:
    """``kv_transfer_params`` (P/D), ``ignore_eos`` and ``return_token_ids`` of request
    ``request_id``, as vLLM's OpenAI server takes them."""

    request_id: str
    kv_transfer_params: object = None
    ignore_eos: bool = False
    return_token_ids: bool = False


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("kvabi_request", default=None)


def current_request() -> RequestAsk | None:
    """What the HTTP request being handled in this context asked, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def asking(ask: RequestAsk):
    """``ask`` is what the request handled inside the block asked."""
    token = _CURRENT.set(ask)
    try:
        yield ask
    finally:
        _CURRENT.reset(token)


__all__ = ["RequestAsk", "asking", "current_request"]
