"""The pytest base class an engine integrator subclasses to prove its P/D adapter::

    from kvabi.testing import PDConformance

    class TestMyEngine(PDConformance):
        def make_engine(self):
            return MyEngineUnderTest()      # a kvabi.testing.pd.EngineUnderTest

Every check of the kit (:data:`~.checks.CHECK_NAMES`) is a test; the kit runs once per class
(the engine started once per role) and each test reports its check's problems.
"""
from __future__ import annotations

from .checks import CHECK_NAMES
from .runner import run_kit


class PDConformance:
    """P/D conformance tests of one engine (pytest collects subclasses)."""

    #: check names to leave out (each named with a reason in the engine's docs)
    skip_checks: tuple = ()

    def make_engine(self):
        raise NotImplementedError(f"{type(self).__name__}: implement make_engine()")

    @classmethod
    def _results(cls, self):
        got = cls.__dict__.get("_kit_results")
        if got is None:
            want = [n for n in CHECK_NAMES if n not in self.skip_checks]
            got = {r.name: r for r in run_kit(self.make_engine(), want)}
            cls._kit_results = got
        return got


def _test(name: str):
    def test(self):
        import pytest

        if name in self.skip_checks:
            pytest.skip(f"{name}: left out by {type(self).__name__}.skip_checks")
        results = type(self)._results(self)
        r = results.get(name)
        if r is None:
            pytest.skip(f"{name}: the engine does not speak this role")
        assert r.ok, f"{name}:\n" + "\n".join(r.problems)
    test.__name__ = f"test_{name.replace('.', '_')}"
    test.__doc__ = f"The P/D kit's check {name}."
    return test


for _name in CHECK_NAMES:
    setattr(PDConformance, f"test_{_name.replace('.', '_')}", _test(_name))

__all__ = ["PDConformance"]
