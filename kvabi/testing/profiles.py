"""Profiles of kvabi's conformance kit and test suite: one profile, one seed, for every entry
point (``kvabi conformance``, ``pytest --kvabi-backend``, a ``BackendConformance`` subclass).

The kit does not take its settings from whatever Hypothesis profile happens to be loaded
(an author's project may load its own): each entry point asks :func:`kit_profile` and
:func:`kit_seed`, which read, in order, an explicit request (``--profile``/``--seed``,
``--kvabi-profile``/``--kvabi-seed``, the class's ``profile``/``seed``), then
``$KVABI_HYPOTHESIS_PROFILE``/``$KVABI_SEED``, then the default: profile ``ci`` and its
fixed seed.  :func:`kit_settings` builds the Hypothesis settings of a check from them, so
the same profile and seed draw the same examples in all three.

Profiles: ``ci`` (the default) is fast and deterministic: the whole suite, every backend
included (interpreted TPU and Triton kernels are slow), must fit CI's budget on two cores.
``thorough`` explores many more examples with a fresh seed per run (printed).  ``quick``
is a smoke test (``kvabi conformance --quick``).

Nothing is written into the working directory: the kit runs with no Hypothesis example
database unless ``$KVABI_HYPOTHESIS_DATABASE`` names a directory for one, and Hypothesis'
own caches go to a temporary directory (:func:`kit_storage`) unless the caller chose one.
"""
from __future__ import annotations

import contextlib
import os
import random
import tempfile

from hypothesis import HealthCheck, Phase, settings

#: environment variable naming the profile to load
PROFILE_ENV = "KVABI_HYPOTHESIS_PROFILE"
#: environment variable fixing the kit's seed
SEED_ENV = "KVABI_SEED"
#: environment variable naming a directory for Hypothesis' example database (none if unset)
DATABASE_ENV = "KVABI_HYPOTHESIS_DATABASE"
DEFAULT_PROFILE = "ci"
PROFILES = ("ci", "thorough", "quick")

#: examples per conformance check in each profile (each example runs the backend a few
#: times; interpreted kernels take seconds per call)
KIT_EXAMPLES = {"ci": 8, "thorough": 150, "quick": 3}
#: seconds after which a check stops starting new examples (at least
#: :data:`MIN_EXAMPLES` run); None: no limit.  Keeps slow interpreted kernels within CI's
#: budget (about 13 checks x this per backend) while fast backends run every example.
KIT_TIME_BUDGET = {"ci": 6.0, "thorough": None, "quick": None}
#: the seed of each profile; None: a fresh random seed per run (printed with results)
KIT_SEED = {"ci": 0, "thorough": None, "quick": 0}
MIN_EXAMPLES = 2
#: seeds are drawn from [0, SEED_LIMIT)
SEED_LIMIT = 2**32

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

_selected: dict[str, object] = {}


def _error(msg: str):
    from ..util.errors import KVABIError

    return KVABIError(msg)


def register_profiles() -> None:
    """Register the profiles with Hypothesis for plain property tests (idempotent)."""
    settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                              database=None, suppress_health_check=_SLOW_OK)
    settings.register_profile("thorough", max_examples=400, deadline=None, database=None,
                              suppress_health_check=_SLOW_OK)
    settings.register_profile("quick", max_examples=5, deadline=None, derandomize=True,
                              database=None, suppress_health_check=_SLOW_OK)


def check_profile(name: str, field: str = PROFILE_ENV) -> str:
    """``name`` if it is a profile, else a :class:`KVABIError` naming ``field``."""
    if name not in PROFILES:
        raise _error(f"{field}: unknown profile {name!r}; profiles are {', '.join(PROFILES)}")
    return name


def parse_seed(value, field: str = SEED_ENV) -> int:
    """A seed: an integer in [0, 2**32), given as int or decimal string."""
    s = None
    if isinstance(value, int) and not isinstance(value, bool):
        s = value
    elif isinstance(value, str) and value.strip().isdigit():
        s = int(value.strip())
    if s is None or not 0 <= s < SEED_LIMIT:
        raise _error(f"{field}: a seed is an integer in [0, 2**32), got {value!r}")
    return s


def profile_name(requested: str | None = None) -> str:
    """The profile to use: ``requested``, else ``$KVABI_HYPOTHESIS_PROFILE``, else ``ci``."""
    if requested:
        return check_profile(requested, "profile")
    return check_profile(os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE)


def select(profile: str | None = None, seed: int | None = None) -> None:
    """Make ``profile``/``seed`` the kit's for this process (what ``--kvabi-profile`` and
    ``--kvabi-seed`` do); None leaves that one to the environment and the default."""
    _selected.clear()
    if profile:
        _selected["profile"] = check_profile(profile, "profile")
    if seed is not None:
        _selected["seed"] = parse_seed(seed, "seed")


def kit_profile(requested: str | None = None) -> str:
    """The kit's profile: ``requested``, the selected one, ``$KVABI_HYPOTHESIS_PROFILE``,
    else ``ci``."""
    return profile_name(requested or _selected.get("profile"))


_RUN_SEEDS: dict[str, int] = {}


def kit_seed(requested: int | None = None, profile: str | None = None) -> int:
    """The kit's seed: ``requested``, the selected one, ``$KVABI_SEED``, else the profile's
    (``ci`` and ``quick``: 0; ``thorough``: one random seed per process, so every check of
    a run and its report share it)."""
    if requested is not None:
        return parse_seed(requested, "seed")
    if "seed" in _selected:
        return int(_selected["seed"])
    env = os.environ.get(SEED_ENV)
    if env not in (None, ""):
        return parse_seed(env)
    name = kit_profile(profile)
    fixed = KIT_SEED[name]
    if fixed is not None:
        return fixed
    return _RUN_SEEDS.setdefault(name, random.randrange(SEED_LIMIT))


def load_profile(requested: str | None = None) -> str:
    """Register and load the chosen profile for plain Hypothesis tests; returns its name."""
    register_profiles()
    name = profile_name(requested)
    settings.load_profile(name)
    return name


def current_profile() -> str:
    """The kit's profile in effect (see :func:`kit_profile`)."""
    return kit_profile()


def kit_examples(profile: str | None = None) -> int:
    """Examples per conformance check under ``profile`` (default: the kit's)."""
    return KIT_EXAMPLES[kit_profile(profile)]


def kit_time_budget(profile: str | None = None) -> float | None:
    """Seconds per conformance check under ``profile`` (default: the kit's)."""
    return KIT_TIME_BUDGET[kit_profile(profile)]


def kit_database():
    """The example database asked for by ``$KVABI_HYPOTHESIS_DATABASE``, else None."""
    path = os.environ.get(DATABASE_ENV)
    if not path:
        return None
    from hypothesis.database import DirectoryBasedExampleDatabase

    return DirectoryBasedExampleDatabase(path)


def kit_settings(max_examples: int, *, shrink: bool = True, database=None) -> settings:
    """Hypothesis settings of one conformance check, independent of the loaded profile.

    No deadline (interpreted kernels are slow), no health checks (the strategies filter
    hard by design), no ``@reproduce_failure`` blob and no explain phase (the kit writes
    its own reproducer instead of pointing at its internals), one bug per check.
    """
    phases = [Phase.explicit, Phase.generate]
    if database is not None:
        phases.insert(1, Phase.reuse)
    if shrink:
        phases.append(Phase.shrink)
    return settings(max_examples=max_examples, deadline=None, database=database,
                    derandomize=False, print_blob=False, report_multiple_bugs=False,
                    phases=phases, suppress_health_check=list(HealthCheck))


_storage: list[str] = []


@contextlib.contextmanager
def kit_storage():
    """Point Hypothesis' storage (caches it writes even without a database) at a temporary
    directory while a check runs, unless ``$HYPOTHESIS_STORAGE_DIRECTORY`` or the caller's
    ``set_hypothesis_home_dir`` chose one; otherwise it would create ``.hypothesis/`` in the
    working directory, the backend author's tree."""
    from hypothesis import configuration

    current = getattr(configuration, "__hypothesis_home_directory", None)
    if current is not None or os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    if not _storage:
        _storage.append(tempfile.mkdtemp(prefix="kvabi-hypothesis-"))
    configuration.set_hypothesis_home_dir(_storage[0])
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(None)
