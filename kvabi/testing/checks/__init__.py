"""The conformance checks, usable outside pytest.

Each ``check_xxx(backend, reference, params, options=KitOptions())`` runs one example and
returns its error (0.0 for byte-exact checks; a :class:`Refused` 0.0 when the backend
properly refused), raising :class:`~kvabi.testing.measure.ConformanceFailure` when the
backend disagrees with the reference.  :data:`CHECKS` pairs each with the Hypothesis
strategy of its examples, in the order the kit runs them.
"""
from __future__ import annotations

from .attention import attention_strategy, check_attention
from .base import Check, KitOptions, NotApplicable, Refused, attention_cases, spec_strategy
from .frameworks import check_foreign_framework, foreign_framework_strategy
from .hostile import (check_hostile_cache, check_huge_lengths, hostile_cache_strategy,
                      huge_lengths_strategy)
from .layouts import (check_foreign_layouts, check_layouts, foreign_layouts_strategy,
                      layouts_strategy)
from .poison import check_poisoned_rows, poison_strategy
from .poison_per_query import check_poisoned_per_query, poison_per_query_strategy
from .refusal import check_unsupported, unsupported_strategy
from .sharing import check_kv_sharing, sharing_strategy
from .transforms import (cascade_strategy, check_cascade, check_local_virtual_batches, check_pad,
                         check_permute, check_prefill_skip, check_split_ubatches, local_strategy,
                         pad_strategy, permute_strategy, prefill_skip_strategy, ubatch_strategy)
from .write import check_kv_update_slices, check_write_kv, update_slices_strategy, write_strategy

CHECKS: tuple[Check, ...] = (
    Check("write_kv", "writes exactly the batch's slots, byte for byte", check_write_kv,
          write_strategy, exact=True),
    Check("attention", "output and lse equal the reference; attention only reads",
          check_attention, attention_strategy),
    Check("layouts", "preferred layouts byte-exact through the backend, JSON round trip",
          check_layouts, layouts_strategy, exact=True),
    Check("foreign_layouts", "other layouts computed right or refused", check_foreign_layouts,
          foreign_layouts_strategy),
    Check("unsupported", "specs outside the capabilities refused with KVABIError",
          check_unsupported, unsupported_strategy),
    Check("kv_update_slices", "update slices applied == the backend's write",
          check_kv_update_slices, update_slices_strategy, exact=True),
    Check("prefill_skip", "prefill-skipped rows equal the full computation",
          check_prefill_skip, prefill_skip_strategy),
    Check("local_virtual_batches", "virtual batches == chunked local attention",
          check_local_virtual_batches, local_strategy),
    Check("split_ubatches", "micro-batches concatenated == the whole step",
          check_split_ubatches, ubatch_strategy),
    Check("cascade", "cascade_split + merge_attention == the whole step", check_cascade,
          cascade_strategy),
    Check("pad", "padding leaves real outputs and other cache bytes unchanged", check_pad,
          pad_strategy),
    Check("permute", "permuted requests give permuted outputs", check_permute,
          permute_strategy),
    Check("kv_sharing", "sharing layers read their owner's cache and never write",
          check_kv_sharing, sharing_strategy),
    Check("poisoned_rows", "NaN/inf in rows no query may see change nothing",
          check_poisoned_rows, poison_strategy),
    Check("poisoned_per_query", "NaN/inf in rows some queries see change nothing for the "
          "others", check_poisoned_per_query, poison_per_query_strategy),
    Check("hostile_cache", "caches that do not fit refused before any write",
          check_hostile_cache, hostile_cache_strategy),
    Check("foreign_framework", "a cache of another framework refused by name or converted",
          check_foreign_framework, foreign_framework_strategy),
    Check("huge_lengths", "lengths and block ids past the layout refused, never written",
          check_huge_lengths, huge_lengths_strategy),
)

CHECK_NAMES = tuple(c.name for c in CHECKS)


def get_check(name: str) -> Check:
    for c in CHECKS:
        if c.name == name:
            return c
    from ...util.errors import KVABIError

    raise KVABIError(f"check: unknown check {name!r}; checks are {', '.join(CHECK_NAMES)}")


__all__ = ["CHECKS", "CHECK_NAMES", "Check", "KitOptions", "NotApplicable", "Refused",
           "attention_cases", "check_attention", "check_cascade", "check_foreign_layouts",
           "check_kv_sharing", "check_kv_update_slices", "check_layouts",
           "check_hostile_cache", "check_huge_lengths", "check_local_virtual_batches",
           "check_pad", "check_permute", "check_poisoned_per_query", "check_poisoned_rows",
           "check_prefill_skip",
           "check_split_ubatches", "check_unsupported", "check_write_kv", "get_check",
           "spec_strategy"]
