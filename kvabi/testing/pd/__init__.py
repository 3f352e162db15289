"""The P/D conformance kit (``specs/pd.md`` section 12): kvabi's reference producer and
consumer (numpy caches, NIXL) run against an engine and its adapter, through a small
harness the integrator writes (:class:`EngineUnderTest`).  ``kvabi conformance --pd
MODULE:CALLABLE`` or a subclass of :class:`PDConformance` runs it."""
from .checks import CHECK_NAMES, CHECKS, SETTINGS, CheckResult
from .conformance import PDConformance
from .engine import EngineUnderTest, ModelFacts, Outcome
from .reference import FAULTS, ReferenceEngine
from .runner import load_engine, report, run_kit
from .values import differences, kv_values, merge

__all__ = ["CHECKS", "CHECK_NAMES", "CheckResult", "EngineUnderTest", "FAULTS", "ModelFacts",
           "Outcome", "PDConformance", "ReferenceEngine", "SETTINGS", "differences",
           "kv_values", "load_engine", "merge", "report", "run_kit"]
