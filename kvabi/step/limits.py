"""What an engine promises about its steps, so that a backend can compile ahead of time.

Backends that compile per shape (XLA, CUDA graphs) round each step's shapes up to buckets;
:class:`StepLimits` bounds the steps an engine will run, so that the set of buckets is
finite and :meth:`kvabi.Backend.warmup` can build all of them before the first step.
"""
from __future__ import annotations

import attrs

from ..util.coerce import as_int
from ..util.errors import KVABIError
from .metadata import MAX_STEP_REQS, MAX_STEP_TOKENS


def _count(field: str, hi: int):
    def check(_inst, attribute, value):
        as_int(value, f"StepLimits.{field}", lo=1, hi=hi)
    return check


@attrs.frozen
class StepLimits:
    """Bounds of every step an engine will run for one KV group.

    ``max_tokens``: query tokens of one step (padding included), e.g. vLLM's
    ``max_num_batched_tokens``; ``max_reqs``: requests of one step (``max_num_seqs``);
    ``max_seq_len``: tokens of one request, cached plus new (``max_model_len``).
    """

    max_tokens: int = attrs.field(validator=_count("max_tokens", MAX_STEP_TOKENS))
    max_reqs: int = attrs.field(validator=_count("max_reqs", MAX_STEP_REQS))
    max_seq_len: int = attrs.field(validator=_count("max_seq_len", (1 << 31) - 1))

    def __attrs_post_init__(self):
        for f in ("max_tokens", "max_reqs", "max_seq_len"):  # numpy ints in, Python ints kept
            object.__setattr__(self, f, int(getattr(self, f)))

    def check(self, meta) -> None:
        """Raise :class:`KVABIError` naming the limit a step's metadata exceeds."""
        for field, got, limit in (("num_tokens", meta.num_tokens, "max_tokens"),
                                  ("num_reqs", meta.num_reqs, "max_reqs"),
                                  ("seq_lens", meta.max_seq_len, "max_seq_len")):
            if int(got) > getattr(self, limit):
                raise KVABIError(f"{field}: {int(got)} exceeds the declared StepLimits."
                                 f"{limit} = {getattr(self, limit)} (warm up with larger "
                                 f"limits)")
