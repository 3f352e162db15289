"""What a check drew: the (kind, dtype, quant, rounding, layout) of every plan the backend
was asked for, counted per example, and the claimed quantizations a check left out.

The kit notes each plan it asks a backend for (:func:`note`, called by the harness); the
runner collects them per example (:func:`collecting`) into a :class:`Coverage`.  Reports
show it (``kvabi conformance``'s table, ``--json``, JUnit), so an author can read which
dtypes, quantizations, roundings, layouts and kinds a pass covers.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import Counter

import attrs

from ..model.quant import FORMATS, QUANT_MODES, ROUNDINGS

_current: contextvars.ContextVar[set | None] = contextvars.ContextVar("kvabi_drawn",
                                                                      default=None)

#: short forms in tables
SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3",
         "float8_e5m2": "e5m2", "int8": "i8", "per_tensor": "tensor",
         "per_token_head": "token-head", "nearest_even": "even", "nearest_away": "away",
         "toward_zero": "toward-0"}


def note(spec, layout) -> None:
    """Record that the backend was asked for a plan of ``spec`` over ``layout`` (inside a
    :func:`collecting` block; a no-op elsewhere)."""
    drawn = _current.get()
    if drawn is not None:
        name = layout.name or "custom layout"
        drawn.add((spec.kind, spec.dtype, spec.quant, spec.rounding, name))


@contextlib.contextmanager
def collecting():
    """Collect the plans noted while the block runs: yields the set being filled."""
    drawn: set = set()
    token = _current.set(drawn)
    try:
        yield drawn
    finally:
        _current.reset(token)


def combo_label(dtype: str, quant: str, rounding: str) -> str:
    """``int8 per_tensor nearest_away``; a dtype alone for quant none."""
    return dtype if quant == "none" else f"{dtype} {quant} {rounding}"


def quant_combos(dtypes, quants=QUANT_MODES, roundings=ROUNDINGS, kind=None
                 ) -> tuple[tuple[str, str, str], ...]:
    """Every valid (dtype, quant, rounding) of ``dtypes`` x ``quants`` x ``roundings``, in
    the order of :data:`kvabi.util.dtypes.DTYPES` with quant none first (where shrinking
    goes): quant none (with its rounding, nearest_even) for every dtype when ``quants`` has
    it, each quantization a dtype takes with every rounding of ``roundings`` defined for
    it.  An MLA ``kind`` has no per-token-head cache (``specs/semantics.md`` section 11)."""
    from ..util.dtypes import DTYPES

    out = []
    for dt in (d for d in DTYPES if d in dtypes):
        if "none" in quants:
            out.append((dt, "none", "nearest_even"))
        fmt = FORMATS.get(dt)
        if fmt is None:
            continue
        for q in QUANT_MODES:
            if q == "none" or q not in quants or (q == "per_token_head" and kind == "mla"):
                continue
            out += [(dt, q, r) for r in ROUNDINGS if r in roundings and r in fmt.roundings]
    return tuple(out)


def narrowed(caps, *, dtypes=None, quants=None, roundings=None) -> tuple:
    """(dtypes, quants, roundings) ``caps`` claims, narrowed by the options (None: no
    narrowing).  ``Capabilities.roundings`` are those of quantized caches; a rounding
    option narrows quantized caches and keeps quant none only if it names nearest_even
    (quant none's)."""
    from ..util.dtypes import DTYPES

    def narrow(claimed, wanted):
        return tuple(x for x in claimed if wanted is None or x in wanted)

    qs = narrow(getattr(caps, "quant", ("none",)), quants)
    if roundings is not None and "nearest_even" not in roundings:
        qs = tuple(q for q in qs if q != "none")
    return (narrow(caps.dtypes if caps.dtypes is not None else DTYPES, dtypes), qs,
            narrow(getattr(caps, "roundings", ("nearest_even",)), roundings))


def claimed_combos(caps, *, dtypes=None, quants=None, roundings=None, kind=None
                   ) -> tuple[tuple[str, str, str], ...]:
    """:func:`quant_combos` of what ``caps`` claims (its dtypes, ``quant``, ``roundings``),
    narrowed by the options (:func:`narrowed`)."""
    return quant_combos(*narrowed(caps, dtypes=dtypes, quants=quants, roundings=roundings),
                        kind)


@attrs.define
class Coverage:
    """Examples per drawn (kind, dtype, quant, rounding, layout), and the claimed
    (dtype, quant, rounding) a check did not draw with the reason."""

    #: (kind, dtype, quant, rounding, layout) -> examples that asked for it
    drawn: Counter = attrs.field(factory=Counter)
    #: [(dtype, quant, rounding, why)]
    not_drawn: list = attrs.field(factory=list)

    def add(self, plans: set) -> None:
        for item in plans:
            self.drawn[item] += 1

    def _by(self, *fields) -> Counter:
        out: Counter = Counter()
        seen: set = set()
        for item, n in self.drawn.items():
            key = tuple(item[i] for i in fields)
            out[key] += n
            seen.add(key)
        return out

    def kinds(self) -> dict:
        return {k[0]: n for k, n in sorted(self._by(0).items())}

    def combos(self) -> dict:
        c = self._by(1, 2, 3)
        return {combo_label(*k): n for k, n in sorted(c.items())}

    def layouts(self) -> dict:
        return {k[0]: n for k, n in sorted(self._by(4).items())}

    def to_dict(self) -> dict:
        return {"kinds": self.kinds(), "dtypes": self.combos(), "layouts": self.layouts(),
                "drawn": [{"kind": k, "dtype": d, "quant": q, "rounding": r, "layout": lay,
                           "examples": n} for (k, d, q, r, lay), n in sorted(
                               self.drawn.items())],
                "not_drawn": [{"dtype": d, "quant": q, "rounding": r, "why": why}
                              for d, q, r, why in self.not_drawn]}


def counts(d: dict, short: bool = False) -> str:
    """``full 5, sliding_window 3`` (``short``: abbreviated dtype and quant names)."""
    def name(k):
        return " ".join(SHORT.get(w, w) for w in k.split()) if short else k

    return ", ".join(f"{name(k)} {n}" for k, n in d.items()) or "-"


def summary(cov: Coverage | None) -> str:
    """One table cell: how many kinds, dtype/quant/rounding combinations and layouts."""
    if cov is None or not cov.drawn:
        return "-"
    k, c, lay = len(cov.kinds()), len(cov.combos()), len(cov.layouts())
    return (f"{k} kind{'s' * (k != 1)}, {c} dtype/quant{'s' * (c != 1)}, "
            f"{lay} layout{'s' * (lay != 1)}")


__all__ = ["Coverage", "claimed_combos", "collecting", "combo_label", "counts", "narrowed",
           "note", "quant_combos", "summary"]
