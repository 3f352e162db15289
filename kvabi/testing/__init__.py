"""The conformance kit: Hypothesis strategies, reusable checks and a pytest base class that
hold a backend to the reference oracle (``specs/conformance.md``).

Needs the ``test`` extra (hypothesis, pytest).  Subclass :class:`BackendConformance` in a
test file, run ``pytest --kvabi-backend NAME``, or ``kvabi conformance NAME``: all three run
the same profile (``ci`` by default) and seed, so they draw the same examples; a failure
prints its seed and the path of a standalone reproducer (:mod:`kvabi.testing.replay`).
The P/D kit (:mod:`kvabi.testing.pd`, :class:`PDConformance`) holds an engine's P/D adapter
to ``specs/pd.md``.

May import: util, model, layout, memory, step, transforms, backend, probe, transfer, pd.
"""
from . import strategies
from .cases import AttentionCase, input_dtype
from .checks import (CHECK_NAMES, CHECKS, Check, KitOptions, NotApplicable, Refused,
                     check_attention, check_cascade, check_foreign_layouts, check_hostile_cache,
                     check_huge_lengths, check_kv_sharing, check_kv_update_slices, check_layouts,
                     check_local_virtual_batches, check_pad, check_permute, check_poisoned_rows,
                     check_prefill_skip, check_split_ubatches, check_unsupported, check_write_kv,
                     get_check)
from .conformance import BackendConformance
from .pd import PDConformance
from .measure import TOLERANCES, ConformanceFailure, lse_error, relative_l2, tolerance
from .profiles import PROFILE_ENV, SEED_ENV, kit_profile, kit_seed, load_profile, register_profiles
from .runner import CheckResult, run_backend, run_check

__all__ = ["AttentionCase", "BackendConformance", "PDConformance", "CHECKS", "CHECK_NAMES", "Check",
           "CheckResult", "ConformanceFailure", "KitOptions", "NotApplicable", "PROFILE_ENV", "SEED_ENV",
           "Refused", "TOLERANCES", "check_attention", "check_cascade",
           "check_hostile_cache", "check_huge_lengths", "check_poisoned_rows",
           "check_foreign_layouts", "check_kv_sharing", "check_kv_update_slices",
           "check_layouts", "check_local_virtual_batches", "check_pad", "check_permute",
           "check_prefill_skip", "check_split_ubatches", "check_unsupported",
           "check_write_kv", "get_check", "input_dtype", "kit_profile", "kit_seed", "load_profile", "lse_error",
           "register_profiles", "relative_l2", "run_backend", "run_check", "strategies",
           "tolerance"]
