"""What an integrator writes to run the P/D kit against an engine: an
:class:`EngineUnderTest`, a small harness over the engine with its kvabi adapter.

The kit never looks inside the engine: it asks it to prefill prompts (the engine as
producer), to decode requests with parameters (as consumer), for the KV it holds for a
request (read where the engine's own block table says, through the layout its adapter
serves), and for its per-request tables.  :class:`~.reference.ReferenceEngine` is one
(numpy caches): ``kvabi conformance --pd reference`` runs the kit against it.
"""
from __future__ import annotations

import abc

import attrs


@attrs.frozen
class ModelFacts:
    """What the reference peers must share with the engine to exchange KV: per KV cache
    group its sliding window (None: full attention), the model's layers per group, KV heads
    (all ranks), head dim, dtype, vocabulary; the engine's block size, TP size and longest
    request; ``model_id`` the identity its handshakes state (None: none)."""

    windows: tuple = (None,)
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    vocab: int = 256
    block_size: int = 32
    tp_size: int = 1
    max_tokens: int = 512
    model_id: str | None = None


@attrs.frozen
class Outcome:
    """What became of a request the engine decoded: ``reason`` None when its KV arrived
    (else the refusal, as the engine logged it); ``kv`` the KV the engine holds for its
    pulled positions at the moment they arrived (:func:`~.values.kv_values` per group, by
    global head), or None; ``seconds`` until the engine said so."""

    reason: str | None
    kv: list | None = None
    seconds: float = 0.0


class EngineUnderTest(abc.ABC):
    """A harness over one engine and its adapter (see the module docstring).  Each method
    may be slow (it runs the engine); none is called concurrently."""

    #: a short name for reports
    name = "engine"
    #: the roles the engine speaks: "producer", "consumer"
    roles: tuple = ("producer", "consumer")

    @abc.abstractmethod
    def facts(self) -> ModelFacts:
        """The model and engine facts (available before :meth:`start`)."""

    @abc.abstractmethod
    def start(self, role: str, settings) -> None:
        """Start the engine as ``role`` (``producer`` or ``consumer``) with
        ``settings`` (:class:`kvabi.pd.PDSettings`: the kit's short timeouts)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the engine (the kit then starts it again, possibly in another role)."""

    def prefill(self, prompts: list) -> list:
        """Producer: run each prompt (token ids) with the ask (``kvabi.pd.ASK``) to a normal
        finish after one token; their answers (None where the engine holds nothing)."""
        raise NotImplementedError

    def kv(self, answer: dict) -> list:
        """Producer: the KV the engine holds for the request of ``answer``, positions
        0 .. remote_num_tokens - 1, per group (:func:`~.values.kv_values`), read at the
        blocks the engine's own block table gives the request."""
        raise NotImplementedError

    def decode(self, requests: list) -> dict:
        """Consumer: run ``[(request id, prompt, kv_transfer_params or None)]`` together,
        each to one generated token or its failure; {request id: :class:`Outcome`}."""
        raise NotImplementedError

    def step(self, seconds: float = 0.0) -> None:
        """Let the engine step while idle for about ``seconds`` (notifications, expiry)."""

    @abc.abstractmethod
    def tables(self) -> dict:
        """Sizes of the engine's per-request P/D tables (front and cache sides): entries,
        grants held, pulls running, ... (the kit checks they return to 0)."""

    def blocks(self) -> tuple | None:
        """(free, total) blocks of the engine's allocator, or None where unknown."""
        return None


__all__ = ["EngineUnderTest", "ModelFacts", "Outcome"]
