"""Running conformance checks outside pytest: Hypothesis drives each check's function over
its strategy; the result records examples, the worst error and any minimal failing case.

Every entry point (``kvabi conformance``, ``pytest --kvabi-backend``, a
``BackendConformance`` subclass) comes through :func:`run_check`, which takes its profile,
seed and settings from :mod:`kvabi.testing.profiles`, never from the Hypothesis profile
loaded in the caller's process: the same profile and seed draw the same examples in all
three.  On a failure it keeps the minimal failing example and writes a standalone
reproducer (:mod:`kvabi.testing.replay`).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import attrs
from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable

from .checks import CHECKS, Check, KitOptions, NotApplicable, Refused
from .failure import failing_error
from .measure import tolerance
from .profiles import (MIN_EXAMPLES, kit_database, kit_examples, kit_profile, kit_seed,
                       kit_settings, kit_storage, kit_time_budget)

PASSED, FAILED, NOT_APPLICABLE, SKIPPED = "passed", "FAILED", "n/a", "skipped"
#: default of ``time_budget``: the current profile's
PROFILE = "profile"
#: default of ``replay``: write a reproducer into :func:`kvabi.testing.replay.replay_dir`
DEFAULT = "default"


@attrs.define
class CheckResult:
    """What one check did against one backend."""

    backend: str
    check: str
    exact: bool = False
    status: str = PASSED
    examples: int = 0
    max_examples: int = 0
    refused: int = 0
    worst: float = 0.0
    seconds: float = 0.0
    message: str = ""
    #: the minimal failing example, as text
    example: str = ""
    exception: BaseException | None = attrs.field(default=None, repr=False)
    #: the example closest to its tolerance: (error, tolerance, cache dtype)
    closest: tuple | None = None
    #: whether the time budget cut the run short
    budget_hit: bool = False
    #: the profile and seed the check ran under
    profile: str = ""
    seed: int | None = None
    #: the minimal failing example itself (the check's params)
    params: object = attrs.field(default=None, repr=False)
    #: structured facts of the failure (``ConformanceFailure.details``: got, want, ratio,
    #: token, head, slot, ...), {} when the failure carried none
    details: dict = attrs.field(factory=dict)
    #: the failing example's (error, tolerance, cache dtype), when the failure measured one
    failing: tuple | None = None
    #: path of the standalone reproducer written for a failure, or ""
    reproducer: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAILED


def reference_backend():
    from ..backend.registry import get_backend

    return get_backend("reference")


def run_check(check: Check, backend, reference=None, *, options: KitOptions = KitOptions(),
              max_examples: int | None = None, seed: int | None = None,
              profile: str | None = None, time_budget: float | None | str = PROFILE,
              database=DEFAULT, shrink: bool = True, shrink_seconds: float | None = 60.0,
              replay: str | None = DEFAULT, reraise: bool = False) -> CheckResult:
    """Run ``check`` against ``backend`` for up to ``max_examples`` examples (default: the
    kit profile's :func:`~kvabi.testing.profiles.kit_examples`).

    ``profile`` and ``seed`` default to :func:`~kvabi.testing.profiles.kit_profile` and
    :func:`~kvabi.testing.profiles.kit_seed` (``ci``: seed 0).  ``time_budget`` seconds
    after the start no new example runs once :data:`~kvabi.testing.profiles.MIN_EXAMPLES`
    have (default: the profile's when ``max_examples`` is not given, else none).
    ``database``: a Hypothesis example database (default: the one
    ``$KVABI_HYPOTHESIS_DATABASE`` asks for, else none: nothing is written to disk).
    ``shrink=False`` reports the first failing example as found; otherwise shrinking stops
    ``shrink_seconds`` after the first failure (Hypothesis' own limit is 5 minutes, too
    long for interpreted kernels), reporting the smallest failing example found so far.
    ``replay``: the directory a failure's reproducer is written to (default:
    :func:`kvabi.testing.replay.replay_dir`; None: none written).  With ``reraise`` a
    failure propagates as raised instead of being recorded.
    """
    reference = reference or reference_backend()
    profile = kit_profile(profile)
    seed = kit_seed(seed, profile)
    res = CheckResult(backend.name, check.name, check.exact, profile=profile, seed=seed)
    t0 = time.perf_counter()
    try:
        strategy = check.strategy(backend, options)
    except NotApplicable as e:
        res.status, res.message = NOT_APPLICABLE, str(e)
        return res

    failing: set[str] = set()
    first_failure: list[float] = []
    last_failing: list = []

    if time_budget == PROFILE:
        time_budget = kit_time_budget(profile) if max_examples is None else None

    def one(params):
        if (time_budget is not None and not first_failure and res.examples >= MIN_EXAMPLES
                and time.perf_counter() - t0 > time_budget):
            res.budget_hit = True
            return  # time budget spent: the remaining examples are drawn but not run
        if (first_failure and shrink_seconds is not None
                and time.perf_counter() - first_failure[0] > shrink_seconds
                and repr(params) not in failing):
            return  # shrink budget spent: decline new candidates, replay known failures
        try:
            err = check.function(backend, reference, params, options)
        except Exception:
            if not first_failure:  # the failing example counts; shrinking candidates not
                res.examples += 1
                first_failure.append(time.perf_counter())
            failing.add(repr(params))
            # Hypothesis replays the minimal failing example last: keep the last one seen.
            last_failing[:] = [params]
            raise
        if first_failure:
            return  # a shrinking candidate that passed: not one of the check's examples
        res.examples += 1
        if isinstance(err, Refused):
            res.refused += 1
        res.worst = max(res.worst, float(err))
        dtype = dtype_of(params)
        if dtype is not None and not isinstance(err, Refused):
            tol = tolerance(dtype, options.tolerances)
            if res.closest is None or float(err) / tol > res.closest[0] / res.closest[1]:
                res.closest = (float(err), tol, dtype)

    n = max_examples if max_examples is not None else kit_examples(profile)
    res.max_examples = n
    if database == DEFAULT:
        database = kit_database()
    conf = kit_settings(n, shrink=shrink, database=database)
    prop = hypothesis_seed(seed)(conf(given(strategy)(one)))
    try:
        with kit_storage():
            prop()
    except Unsatisfiable as e:
        res.status, res.message = NOT_APPLICABLE, f"no example could be drawn: {e}"
    except Exception as e:  # noqa: BLE001 - a backend may fail in any way
        if reraise:
            raise
        res.status = FAILED
        res.message = f"{type(e).__name__}: {e}"
        res.exception = e
        res.params = last_failing[0] if last_failing else None
        res.example = "" if res.params is None else f"Failing test case: {res.params!r}"
        details = getattr(e, "details", None)
        res.details = dict(details) if isinstance(details, dict) else {}
        res.failing = failing_error(e, dtype_of(res.params), options.tolerances)
    finally:
        res.seconds = time.perf_counter() - t0
    if res.failed and res.params is not None and replay is not None:
        from .replay import replay_dir, write_reproducer

        directory = replay_dir() if replay == DEFAULT else replay
        try:
            res.reproducer = str(write_reproducer(res, backend, options, directory))
        except Exception as e:  # noqa: BLE001 - a report must survive an unrenderable case
            res.reproducer = ""
            res.example += f"\n(no reproducer written: {type(e).__name__}: {e})"
    return res


def dtype_of(params) -> str | None:
    """The cache dtype of a check's params (an AttentionCase or a case with extras)."""
    case = getattr(params, "case", params)
    spec = getattr(case, "spec", None)
    return getattr(spec, "dtype", None)


def run_backend(backend, *, checks: Iterable[Check] = CHECKS, reference=None,
                options: KitOptions = KitOptions(), max_examples: int | None = None,
                seed: int | None = None, profile: str | None = None,
                time_budget: float | None | str = PROFILE, shrink: bool = True,
                replay: str | None = DEFAULT,
                progress: Callable[[str, CheckResult | None], None] | None = None
                ) -> list[CheckResult]:
    """Every check against one backend; ``progress(check name, result or None)`` is called
    before (None) and after each check.  An unavailable backend gives one skipped result."""
    ok, why = backend.available()
    if not ok:
        return [CheckResult(backend.name, "*", status=SKIPPED, message=f"unavailable: {why}",
                            profile=kit_profile(profile), seed=kit_seed(seed, profile))]
    out = []
    for check in checks:
        if progress:
            progress(check.name, None)
        r = run_check(check, backend, reference, options=options, max_examples=max_examples,
                      seed=seed, profile=profile, time_budget=time_budget, shrink=shrink,
                      replay=replay)
        out.append(r)
        if progress:
            progress(check.name, r)
    return out
