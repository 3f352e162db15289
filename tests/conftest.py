"""Suite-wide Hypothesis profile: ``ci`` (fast, deterministic) by default; ``thorough`` with
``KVABI_HYPOTHESIS_PROFILE=thorough`` or ``pytest --kvabi-profile thorough``
(see kvabi.testing.profiles)."""
from kvabi.testing.profiles import load_profile


def pytest_configure(config):
    load_profile(config.getoption("kvabi_profile", None))
