"""What every check shares: kit options, the :class:`Check` record, and strategies that
draw only what a backend claims to support."""
from __future__ import annotations

from typing import Callable

import attrs
from hypothesis import strategies as st

from ...model.spec import KVSpec
from ...util.errors import KVABIError
from ..cases import AttentionCase
from ..strategies import batches, kv_specs, preset_layouts_for, random_layouts


class NotApplicable(Exception):
    """A check has nothing to test for this backend (e.g. it supports every spec)."""


class Refused(float):
    """A check's result when the backend refused the example with a KVABIError (error 0)."""

    def __new__(cls, reason: str = ""):
        obj = super().__new__(cls, 0.0)
        obj.reason = reason
        return obj


def raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised: ``path:line in function`` of the innermost traceback frame
    outside the kit (the path relative to its ``sys.path`` entry), or ""."""
    import os
    import sys
    import traceback

    kit = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(kit + os.sep)]
    if not frames:
        return ""
    f = frames[-1]
    path = os.path.abspath(f.filename)
    roots = sorted((os.path.abspath(p) for p in sys.path if p), key=len, reverse=True)
    for root in roots:
        if path.startswith(root + os.sep):
            path = os.path.relpath(path, root)
            break
    return f"{path}:{f.lineno} in {f.name}"


def not_refused(what: str, exc: BaseException):
    """The failure for a backend that raised something other than a KVABIError."""
    from ..measure import ConformanceFailure

    where = raised_at(exc)
    msg = (f"{what}: not refused with KVABIError: {type(exc).__name__}: {exc}"
           + (f" (raised at {where})" if where else ""))
    return ConformanceFailure(msg, {"exception": type(exc).__name__, "raised_at": where})


def step_or_refusal(backend, case: AttentionCase, what: str):
    """Run one write + attention step of ``case`` on ``backend``: ``(out, lse, planes)``,
    or :class:`Refused` when it raised a KVABIError.  Any other exception fails the check:
    a backend must refuse what it cannot do with a KVABIError.

    ``plan`` runs before the backend is handed any cache, so that a spec it cannot serve
    is refused before planes of a dtype or layout it never claimed reach it."""
    from ..harness import Runner, step_inputs
    from ..measure import ConformanceFailure

    try:
        b = Runner(backend, case, oracle=False)
        plan = b.plan(case.meta)
        k, v, q = step_inputs(case)
        b.write(plan, k, v)
        got, got_lse = b.attend(plan, q, lse=True)
        return got, got_lse, b.planes()
    except KVABIError as e:
        return Refused(str(e))
    except ConformanceFailure:
        raise
    except Exception as e:  # noqa: BLE001 - the point is to report what it raised
        raise not_refused(what, e) from e


@attrs.frozen
class KitOptions:
    """Knobs of one conformance run.

    ``kinds``/``dtypes``/``head_dims`` narrow what is drawn (None: all the backend
    claims); ``specs`` is a predicate on drawn specs; ``page_aligns`` the page alignments
    drawn; ``tolerances`` overrides :data:`kvabi.testing.measure.TOLERANCES` per dtype; the
    ``max_*`` fields bound batch sizes.
    """

    kinds: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    specs: Callable[[KVSpec], bool] | None = None
    page_aligns: tuple[int, ...] = (1,)
    tolerances: dict | None = None
    max_reqs: int = 4
    max_query_len: int = 8
    max_context_len: int = 24


@attrs.frozen
class Check:
    """One conformance check: ``function(backend, reference, params, options) -> error`` over
    examples drawn from ``strategy(backend, options)`` (which raises :class:`NotApplicable`
    when there is nothing to draw).  ``exact`` checks compare bytes (no tolerance)."""

    name: str
    summary: str
    function: Callable
    strategy: Callable
    exact: bool = False


def _narrow(claimed, wanted):
    if claimed is None:
        return None if wanted is None else tuple(wanted)
    if wanted is None:
        return tuple(claimed)
    return tuple(x for x in claimed if x in wanted)


def supported(backend, spec: KVSpec, options: KitOptions, **opts) -> bool:
    """Whether the backend claims ``spec`` (with ``softcap``/``sinks``) and options allow it."""
    if options.specs is not None and not options.specs(spec):
        return False
    return not backend.capabilities(spec).refusals(spec, **opts)


def spec_strategy(backend, options: KitOptions, kinds=None, **kw):
    """Specs of ``kinds`` (default every claimed kind) that the backend claims to support."""
    caps = backend.capabilities(None)
    ks = _narrow(caps.kinds, options.kinds)
    if kinds is not None:
        ks = tuple(k for k in ks if k in kinds)
    dts = _narrow(caps.dtypes, options.dtypes)
    if not ks or not dts:
        raise NotApplicable(f"no claimed spec of kind {kinds or ks} and dtype {dts}")
    dims = _narrow(caps.head_dims, options.head_dims)
    if dims is not None and not dims:
        raise NotApplicable("no claimed head dim left by the options")
    return kv_specs(ks, dts, dims, caps.block_sizes,
                    block_size_multiple=caps.block_size_multiple,
                    page_aligns=options.page_aligns, quants=getattr(caps, "quant", ("none",)),
                    roundings=getattr(caps, "roundings", ("nearest_even",)), **kw).filter(
        lambda s: supported(backend, s, options))


def preferred_layouts(backend, spec, num_blocks, num_layers=1):
    """The backend's preferred presets for ``spec`` that can hold it, built."""
    try:
        names = backend.preferred_layouts(spec)
    except KVABIError:
        return []
    return preset_layouts_for(spec, num_blocks, num_layers, names)


@st.composite
def attention_cases(draw, backend, options: KitOptions, *, kinds=None, spec=None,
                    shared_prefix=None, softcap=True, sinks=True, num_layers=(1, 2),
                    layouts="preferred", padding=True, specs=None, **batch_kw):
    """An :class:`AttentionCase` the backend claims to support, in a layout it prefers
    (``layouts="random"``: a random valid layout instead)."""
    if spec is None:
        spec = draw(specs if specs is not None else spec_strategy(backend, options, kinds))
    kw = dict(max_reqs=options.max_reqs, max_query_len=options.max_query_len,
              max_context_len=options.max_context_len, shared_prefix=shared_prefix,
              padding=padding)
    kw.update(batch_kw)
    meta = draw(batches(spec, **kw))
    nl = draw(st.sampled_from(num_layers))
    if layouts == "preferred":
        built = preferred_layouts(backend, spec, meta.num_blocks, nl)
        if not built:
            from hypothesis import reject

            reject()  # check_layouts reports a backend that prefers nothing usable
        layout = draw(st.sampled_from(built))
    else:
        layout = draw(random_layouts(spec, meta.num_blocks, nl))
    layer = draw(st.integers(0, nl - 1))
    group = draw(st.sampled_from((1, 2, 4)))
    caps = backend.capabilities(spec)
    scale = draw(st.sampled_from((None, 0.3)))
    cap = None
    if softcap and caps.softcap:
        cap = draw(st.one_of(st.none(), st.sampled_from((1.5, 5.0))))
    sink = bool(sinks and caps.sinks and draw(st.booleans()))
    seed = draw(st.integers(0, 2**32 - 1))
    return AttentionCase(spec, layout, meta, spec.num_kv_heads * group, scale=scale,
                         softcap=cap, sinks=sink, layer=layer, seed=seed)


@attrs.frozen(repr=False)
class WithExtra:
    """A case plus the extra parameters of one check (e.g. micro-batch cut points)."""

    case: AttentionCase
    extra: dict

    def __repr__(self):
        items = ", ".join(f"{k}={v!r}" for k, v in self.extra.items())
        return f"{self.case!r}\n  with {items}"

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))
