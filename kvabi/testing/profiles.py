"""Hypothesis profiles of kvabi's test suite and conformance kit.

``ci`` (the default) is fast and deterministic: the whole suite, every backend included
(interpreted TPU and Triton kernels are slow), must fit CI's budget on two cores.
``thorough`` explores many more examples; select it with ``KVABI_HYPOTHESIS_PROFILE=thorough``
or ``pytest --kvabi-profile thorough``.  ``quick`` is a smoke test (``kvabi conformance
--quick``).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: environment variable naming the profile to load
PROFILE_ENV = "KVABI_HYPOTHESIS_PROFILE"
DEFAULT_PROFILE = "ci"
PROFILES = ("ci", "thorough", "quick")

#: examples per conformance check in each profile (each example runs the backend a few
#: times; interpreted kernels take seconds per call)
KIT_EXAMPLES = {"ci": 8, "thorough": 150, "quick": 3}
#: seconds after which a check stops starting new examples (at least
#: :data:`MIN_EXAMPLES` run); None: no limit.  Keeps slow interpreted kernels within CI's
#: budget (about 13 checks x this per backend) while fast backends run every example.
KIT_TIME_BUDGET = {"ci": 6.0, "thorough": None, "quick": None}
MIN_EXAMPLES = 2

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def register_profiles() -> None:
    """Register the profiles with Hypothesis (idempotent; loads none)."""
    settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                              database=None, print_blob=True,
                              suppress_health_check=_SLOW_OK)
    settings.register_profile("thorough", max_examples=400, deadline=None, print_blob=True,
                              suppress_health_check=_SLOW_OK)
    settings.register_profile("quick", max_examples=5, deadline=None, derandomize=True,
                              database=None, suppress_health_check=_SLOW_OK)


def profile_name(requested: str | None = None) -> str:
    """The profile to use: ``requested``, else ``$KVABI_HYPOTHESIS_PROFILE``, else ``ci``."""
    name = requested or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    if name not in PROFILES:
        from ..errors import KVABIError

        raise KVABIError(f"{PROFILE_ENV}: unknown profile {name!r}; profiles are "
                         f"{', '.join(PROFILES)}")
    return name


def load_profile(requested: str | None = None) -> str:
    """Register and load the profile chosen by :func:`profile_name`; returns its name."""
    register_profiles()
    name = profile_name(requested)
    settings.load_profile(name)
    return name


def current_profile() -> str:
    """The name of the Hypothesis profile in effect."""
    return settings.get_current_profile_name()


def kit_examples(profile: str | None = None) -> int:
    """Examples per conformance check under ``profile`` (default: the current one)."""
    name = profile or current_profile()
    return KIT_EXAMPLES.get(name, settings.default.max_examples)


def kit_time_budget(profile: str | None = None) -> float | None:
    """Seconds per conformance check under ``profile`` (default: the current one)."""
    return KIT_TIME_BUDGET.get(profile or current_profile())
