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
from .profiles import kit_examples

PASSED, FAILED, NOT_APPLICABLE, SKIPPED = "passed", "FAILED", "n/a", "skipped"


@attrs.define
class CheckResult:
    """What one check did against one backend."""

    backend: str
    check: str
    status: str = PASSED
    examples: int = 0
    refused: int = 0
    worst: float = 0.0
    seconds: float = 0.0
    message: str = ""
    example: str = ""
    exception: BaseException | None = attrs.field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        return self.status == FAILED


def reference_backend():
    from ..registry import get_backend

    return get_backend("reference")


def run_check(check: Check, backend, reference=None, *, options: KitOptions = KitOptions(),
              max_examples: int | None = None, seed: int | None = None,
              database=None, shrink: bool = True, reraise: bool = False) -> CheckResult:
    """Run ``check`` against ``backend`` for up to ``max_examples`` examples (default: the
    current profile's :func:`~kvabi.testing.profiles.kit_examples`).

    ``seed`` fixes Hypothesis' randomness (otherwise the current profile decides, e.g.
    derandomized in ``ci``).  With ``reraise`` a failure propagates as raised (Hypothesis
    attaches the minimal failing example as a note) instead of being recorded.
    ``shrink=False`` reports the first failing example as found (faster).
    """
    reference = reference or reference_backend()
    res = CheckResult(backend.name, check.name)
    t0 = time.perf_counter()
    try:
        strategy = check.strategy(backend, options)
    except NotApplicable as e:
        res.status, res.message = NOT_APPLICABLE, str(e)
        return res

    def one(params):
        err = check.function(backend, reference, params, options)
        res.examples += 1
        if isinstance(err, Refused):
            res.refused += 1
        res.worst = max(res.worst, float(err))

    n = max_examples if max_examples is not None else kit_examples()
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


def run_backend(backend, *, checks: Iterable[Check] = CHECKS, reference=None,
                options: KitOptions = KitOptions(), max_examples: int | None = None,
                seed: int | None = None,
                progress: Callable[[str, CheckResult | None], None] | None = None
                ) -> list[CheckResult]:
    """Every check against one backend; ``progress(check name, result or None)`` is called
    before (None) and after each check.  An unavailable backend gives one skipped result."""
    ok, why = backend.available()
    if not ok:
        return [CheckResult(backend.name, "*", SKIPPED, message=f"unavailable: {why}")]
    out = []
    for check in checks:
        if progress:
            progress(check.name, None)
        r = run_check(check, backend, reference, options=options, max_examples=max_examples,
                      seed=seed)
        out.append(r)
        if progress:
            progress(check.name, r)
    return out
