"""Running conformance checks outside pytest: Hypothesis drives each check's function over
its strategy; the result records examples, the worst error and any minimal failing case."""
from __future__ import annotations

import time
from typing import Callable, Iterable

import attrs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable

from .checks import CHECKS, Check, KitOptions, NotApplicable, Refused
from .measure import tolerance
from .profiles import MIN_EXAMPLES, kit_examples, kit_time_budget

PASSED, FAILED, NOT_APPLICABLE, SKIPPED = "passed", "FAILED", "n/a", "skipped"
#: default of ``time_budget``: the current profile's
PROFILE = "profile"


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
    example: str = ""
    exception: BaseException | None = attrs.field(default=None, repr=False)
    #: the example closest to its tolerance: (error, tolerance, cache dtype)
    closest: tuple | None = None
    #: whether the time budget cut the run short
    budget_hit: bool = False

    @property
    def failed(self) -> bool:
        return self.status == FAILED


def reference_backend():
    from ..registry import get_backend

    return get_backend("reference")


def run_check(check: Check, backend, reference=None, *, options: KitOptions = KitOptions(),
              max_examples: int | None = None, seed: int | None = None,
              time_budget: float | None | str = PROFILE, database=None,
              shrink: bool = True, shrink_seconds: float | None = 60.0,
              reraise: bool = False) -> CheckResult:
    """Run ``check`` against ``backend`` for up to ``max_examples`` examples (default: the
    current profile's :func:`~kvabi.testing.profiles.kit_examples`).

    ``time_budget`` seconds after the start no new example runs once
    :data:`~kvabi.testing.profiles.MIN_EXAMPLES` have (default: the profile's when
    ``max_examples`` is not given, else none).  ``seed`` fixes Hypothesis' randomness (otherwise the current profile decides, e.g.
    derandomized in ``ci``).  With ``reraise`` a failure propagates as raised (Hypothesis
    attaches the minimal failing example as a note) instead of being recorded.
    ``shrink=False`` reports the first failing example as found; otherwise shrinking stops
    ``shrink_seconds`` after the first failure (Hypothesis' own limit is 5 minutes, too
    long for interpreted kernels), reporting the smallest failing example found so far.
    """
    reference = reference or reference_backend()
    res = CheckResult(backend.name, check.name, check.exact)
    t0 = time.perf_counter()
    try:
        strategy = check.strategy(backend, options)
    except NotApplicable as e:
        res.status, res.message = NOT_APPLICABLE, str(e)
        return res

    failing: set[str] = set()
    first_failure: list[float] = []

    if time_budget == PROFILE:
        time_budget = kit_time_budget() if max_examples is None else None

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
            first_failure[:] = first_failure or [time.perf_counter()]
            failing.add(repr(params))
            raise
        res.examples += 1
        if isinstance(err, Refused):
            res.refused += 1
        res.worst = max(res.worst, float(err))
        dtype = _dtype_of(params)
        if dtype is not None and not isinstance(err, Refused):
            tol = tolerance(dtype, options.tolerances)
            if res.closest is None or float(err) / tol > res.closest[0] / res.closest[1]:
                res.closest = (float(err), tol, dtype)

    n = max_examples if max_examples is not None else kit_examples()
    res.max_examples = n
    conf = settings(settings.default, max_examples=n, deadline=None, database=database,
                    report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))
    if seed is not None:
        conf = settings(conf, derandomize=False)
    if not shrink:
        conf = settings(conf, phases=[Phase.explicit, Phase.reuse, Phase.generate])
    prop = conf(given(strategy)(one))
    if seed is not None:
        prop = hypothesis_seed(seed)(prop)
    try:
        prop()
    except Unsatisfiable as e:
        res.status, res.message = NOT_APPLICABLE, f"no example could be drawn: {e}"
    except Exception as e:  # noqa: BLE001 - a backend may fail in any way
        if reraise:
            raise
        res.status = FAILED
        res.message = f"{type(e).__name__}: {e}"
        res.example = "\n".join(getattr(e, "__notes__", ()))
        res.exception = e
    finally:
        res.seconds = time.perf_counter() - t0
    return res


def _dtype_of(params) -> str | None:
    case = getattr(params, "case", params)
    spec = getattr(case, "spec", None)
    return getattr(spec, "dtype", None)


def run_backend(backend, *, checks: Iterable[Check] = CHECKS, reference=None,
                options: KitOptions = KitOptions(), max_examples: int | None = None,
                seed: int | None = None, time_budget: float | None | str = PROFILE,
                shrink: bool = True, progress: Callable[[str, CheckResult | None], None] | None = None
                ) -> list[CheckResult]:
    """Every check against one backend; ``progress(check name, result or None)`` is called
    before (None) and after each check.  An unavailable backend gives one skipped result."""
    ok, why = backend.available()
    if not ok:
        return [CheckResult(backend.name, "*", status=SKIPPED, message=f"unavailable: {why}")]
    out = []
    for check in checks:
        if progress:
            progress(check.name, None)
        r = run_check(check, backend, reference, options=options, max_examples=max_examples,
                      seed=seed, time_budget=time_budget, shrink=shrink)
        out.append(r)
        if progress:
            progress(check.name, r)
    return out
