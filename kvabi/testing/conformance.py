"""The pytest base class a backend author subclasses to prove a backend conformant.

::

    from kvabi.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_name = "acme.paged"
        dtypes = ("float16", "bfloat16")   # optional: narrow what is drawn
        max_examples = 20                  # optional: per check (default: the profile's)

It runs under the kit's profile and seed (``ci`` and seed 0 unless ``--kvabi-profile``,
``--kvabi-seed``, ``$KVABI_HYPOTHESIS_PROFILE``, ``$KVABI_SEED`` or the class's ``profile``/
``seed`` say otherwise), whatever Hypothesis profile the surrounding project loads: the
same examples as ``kvabi conformance`` and ``pytest --kvabi-backend``.  A failure reports
the seed, the minimal example, and the path of a standalone reproducer.

Each ``test_*`` method runs one check of :data:`kvabi.testing.checks.CHECKS` against the
reference backend over Hypothesis examples of every spec the backend claims
(``capabilities(spec)``).  The backend is looked up by name in the plugin registry, or
returned by :meth:`make_backend` when a subclass overrides it.
"""
from __future__ import annotations

import sys

import attrs

from .checks import CHECKS, KitOptions, get_check
from .failure import failure_report
from .measure import ConformanceFailure
from .runner import FAILED, NOT_APPLICABLE, reference_backend, run_check


class BackendConformance:
    """Conformance tests against the reference backend (pytest collects subclasses)."""

    #: the registered name of the backend under test
    backend_name: str = ""
    #: examples per check (None: the kit profile's, see kvabi.testing.profiles)
    max_examples: int | None = None
    #: the kit profile and seed (None: the selected ones, see kvabi.testing.profiles)
    profile: str | None = None
    seed: int | None = None
    #: narrow the kinds / dtypes / head dims drawn (None: all the backend claims)
    kinds: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    #: predicate on drawn KVSpecs (None: every claimed spec)
    specs = None
    #: page alignments drawn for specs
    page_aligns: tuple[int, ...] = (1,)
    #: per-dtype tolerance overrides, e.g. {"float32": 1e-4} for a TF32 kernel
    tolerances: dict | None = None
    #: check names to leave out (each must be named with a reason in the backend's docs)
    skip_checks: tuple[str, ...] = ()

    # -- the backend ------------------------------------------------------------------------
    def make_backend(self):
        """The backend under test (default: ``get_backend(backend_name)``)."""
        from ..backend.registry import get_backend

        if not self.backend_name:
            raise TypeError(f"{type(self).__name__}: set backend_name")
        return get_backend(self.backend_name)

    def kit_options(self) -> KitOptions:
        return KitOptions(kinds=self.kinds, dtypes=self.dtypes, head_dims=self.head_dims,
                          specs=self.specs, page_aligns=tuple(self.page_aligns),
                          tolerances=self.tolerances)

    def _backend(self):
        import pytest

        backend = self.make_backend()
        ok, why = backend.available()
        if not ok:
            pytest.skip(f"{backend.name} unavailable: {why}")
        return backend

    def run_kit_check(self, name: str) -> None:
        """Run one check.  A failure raises :class:`ConformanceFailure` whose message is the
        kit's report (the failure and its details, the seed, the reproducer's path) and
        whose notes hold the minimal failing example; a backend's own exception is chained
        as its cause, so pytest shows where it was raised."""
        import pytest

        __tracebackhide__ = True
        if name in self.skip_checks:
            pytest.skip(f"{name} skipped by {type(self).__name__}.skip_checks")
        backend = self._backend()
        res = run_check(get_check(name), backend, reference_backend(),
                        options=self.kit_options(), max_examples=self.max_examples,
                        profile=self.profile, seed=self.seed)
        if res.status == NOT_APPLICABLE:
            pytest.skip(f"{name}: {res.message}")
        if res.status == FAILED:
            raise_failure(res)

    # -- the tests --------------------------------------------------------------------------
    def test_registered(self):
        """The backend is a kvabi Backend with a dotted name and sane capabilities, built
        for this ABI's major version, leaving the calls (and their checks) to the base
        class."""
        from ..backend.base import BOUNDARY, Backend
        from ..backend.capabilities import Capabilities
        from ..util.version import ABI_VERSION

        backend = self.make_backend()
        assert isinstance(backend, Backend)
        assert tuple(backend.abi_version)[:1] == ABI_VERSION[:1], backend.abi_version
        own = [m for m in BOUNDARY if getattr(type(backend), m) is not getattr(Backend, m)]
        assert not own, f"overrides {own}: implement prepare, write and attend instead"
        assert backend.name and all(backend.name.split("."))
        ok, why = backend.available()
        assert isinstance(ok, bool) and isinstance(why, str)
        assert isinstance(backend.capabilities(None), Capabilities)


def _check_test(name: str, summary: str):
    def test(self):
        self.run_kit_check(name)

    test.__name__ = f"test_{name}"
    test.__qualname__ = f"BackendConformance.test_{name}"
    test.__doc__ = f"Conformance check {name!r}: {summary}."
    return test


# One test method per check of the kit (a check added to CHECKS is a test here too).
for _check in CHECKS:
    setattr(BackendConformance, f"test_{_check.name}", _check_test(_check.name, _check.summary))
del _check


def raise_failure(res) -> None:
    """Raise a failed result as a :class:`ConformanceFailure` carrying the kit's report."""
    __tracebackhide__ = True
    notes = sys.version_info >= (3, 11)  # pytest shows notes from 3.11 on
    err = ConformanceFailure(failure_report(attrs.evolve(res, example="") if notes else res))
    err.details = dict(res.details)
    if notes and res.example:
        err.add_note(res.example)
    cause = res.exception
    if isinstance(cause, ConformanceFailure):
        cause = cause.__cause__  # the kit's own failure needs no traceback
    raise err from cause
