"""Rows no query may see never influence the result (``specs/semantics.md`` section 2):
NaN and +/-inf written there must leave output and lse equal to the clean computation.

A backend that masks by adding ``-inf`` to a product (``NaN + -inf`` is NaN, ``0 * inf``
is NaN) instead of selecting fails this check; one that reads a whole tile or block and
relies on the mask alone passes only if the mask selects.
"""
from __future__ import annotations

import attrs
import numpy as np
from hypothesis import strategies as st

from ...util.dtypes import numpy_dtype
from ..harness import Runner, StepData, expect_same_cache, raw_items, step_inputs, use_host_planes
from .attention import compare_outputs
from .base import KitOptions, WithExtra, attention_cases, supported

#: poison values, in this order along each poisoned row (where the dtype holds them)
POISON = (np.nan, np.inf, -np.inf)


def poison_values(dtype: str) -> np.ndarray:
    """The poison of a cache dtype, as float64: NaN, +inf, -inf where representable, else
    the extreme finite values (float8_e4m3fn has no inf; int8 no NaN)."""
    if dtype == "int8":
        return np.array([127.0, -128.0, 127.0])
    dt = numpy_dtype(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        vals = np.array(POISON).astype(dt).astype(np.float64)
    if not np.isinf(vals).any():  # float8_e4m3fn: no inf, poison with its extremes too
        import ml_dtypes

        big = float(ml_dtypes.finfo(dt).max)
        vals = np.array([np.nan, big, -big])
    return vals


def seen_pairs(meta, spec) -> tuple[np.ndarray, np.ndarray]:
    """(token, slot) int64 arrays: every slot each real query token of ``meta`` may see
    (its own request's keys from ``spec.first_visible_key`` to its position), vectorized."""
    t = meta.num_actual_tokens
    pos = meta.positions[:t].astype(np.int64)
    req = meta.token_request[:t].astype(np.int64)
    lo = np.asarray(spec.first_visible_key(pos), np.int64)
    n = pos - lo + 1
    owner = np.repeat(np.arange(t), n)
    key = np.repeat(lo, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    bs = spec.block_size
    return owner, meta.block_table[req[owner], key // bs].astype(np.int64) * bs + key % bs


def visible_slots(meta, spec, num_slots: int) -> np.ndarray:
    """bool [num_slots]: the slots some real query token of ``meta`` may see."""
    seen = np.zeros(num_slots, bool)
    seen[seen_pairs(meta, spec)[1]] = True
    return seen


def poisoned_pool(case, seed_salt: int = 0x9015):
    """(pool_k, pool_v, poisoned mask [L, slots]) of ``case``: its clean pool with every
    row no query of the step may see (every row of the other layers) replaced by poison.

    Poisoned values are exact in the cache dtype, so a write of them is a copy.  A
    quantized cache the kit builds itself (a dense layout) holds NaN/inf codes there; one
    the backend must write itself takes only finite input, so its poison is values far
    beyond the codes' range (saturated codes)."""
    i = case.inputs()
    spec, layout = case.spec, case.layout
    slots = layout.num_blocks * spec.block_size
    dirty = np.ones((layout.num_layers, slots), bool)
    dirty[case.layer] = ~visible_slots(case.meta, spec, slots)
    vals = poison_values(spec.dtype)
    if spec.is_quantized and not use_host_planes(layout):
        vals = np.array([1e30, -1e30, 1e30])
    rng = np.random.default_rng([case.seed, seed_salt])

    def poison(pool):
        if pool is None:
            return None
        p = pool.astype(np.float64)
        pick = rng.integers(0, len(vals), size=p.shape)
        p = np.where(dirty[:, :, None, None], vals[pick], p)
        with np.errstate(invalid="ignore", over="ignore"):
            return p.astype(pool.dtype)

    return poison(i.pool_k), poison(i.pool_v), dirty


def check_poisoned_rows(backend, reference, params, options: KitOptions = KitOptions()
                        ) -> float:
    """K/V rows no query may see hold NaN and +/-inf (outside the window or chunk, past
    ``seq_len`` in a request's last block, blocks no request uses, other layers): the
    backend's output and lse equal the reference's on the clean cache, and its write
    leaves the poison where it was.  ``params.extra["kinds"]`` lists the other claimed
    kinds run on the same batch (the case's own kind first)."""
    case = getattr(params, "case", params)
    worst = 0.0
    for c in variants(backend, case, getattr(params, "extra", {}).get("kinds", ()),
                      options):
        with np.errstate(invalid="ignore", over="ignore"):  # arithmetic on poison is fine
            worst = max(worst, _poisoned_step(backend, reference, c, options))
    return worst


def _poisoned_step(backend, reference, case, options) -> float:
    s = case.spec
    label = s.kind + (f" window={s.window}" if s.kind == "sliding_window" else "") + \
        (f" chunk={s.chunk}" if s.kind == "chunked_local" else "")
    pk, pv, dirty = poisoned_pool(case)
    k, v, q = step_inputs(case)
    clean = Runner(reference, case, oracle=True)
    plan = clean.plan(case.meta)
    clean.write(plan, k, v)
    want, want_lse = clean.attend(plan, q, lse=True)
    dirty_ref = Runner(reference, case, oracle=True, pool=(pk, pv))
    dirty_ref.write(dirty_ref.plan(case.meta), k, v)
    b = Runner(backend, case, oracle=False, pool=(pk, pv))
    bplan = b.plan(case.meta)
    b.write(bplan, k, v)
    got_planes, want_planes = b.planes(), dirty_ref.planes()
    if not _same_up_to_nan_payload(case.layout, got_planes, want_planes):
        expect_same_cache(f"poisoned_rows ({label}): write_kv over a poisoned cache",
                          case.layout, case.spec, got_planes, want_planes,
                          step=StepData(k, v, case.meta.slot_mapping, case.layer,
                                        case.scales()))
    got, got_lse = b.attend(bplan, q, lse=True)
    n = int(dirty[case.layer].sum())
    rows = np.arange(case.meta.num_actual_tokens)
    return compare_outputs(f"poisoned_rows ({label}, NaN/inf in {n} invisible rows of layer "
                           f"{case.layer})", case, got, want, rows, options,
                           got_lse=got_lse, want_lse=want_lse)


def _same_up_to_nan_payload(layout, got, want) -> bool:
    """Byte-equal planes, except that any NaN equals any NaN (a backend that wrote the
    poisoned pool itself may encode NaN with another sign or payload)."""
    dt = numpy_dtype(layout.dtype)
    for a, b in zip(got, want):
        ra, rb = raw_items(layout, a), raw_items(layout, b)
        diff = ra != rb
        if diff.any():
            if dt.kind == "i":
                return False
            va = ra[diff].view(dt).astype(np.float64)
            vb = rb[diff].view(dt).astype(np.float64)
            if not (np.isnan(va) & np.isnan(vb)).all():
                return False
    return True


def variants(backend, case, kinds, options):
    """The case, then the same batch and layout under each other kind of ``kinds`` the
    backend claims (window and chunk derived from the case's seed)."""
    out = [case]
    for kind in kinds:
        if kind == case.spec.kind:
            continue
        extra = {"window": None, "chunk": None}
        if kind == "sliding_window":
            extra["window"] = 1 + case.seed % 5
        elif kind == "chunked_local":
            bs = case.spec.block_size
            extra["chunk"] = bs * (1 + case.seed % 2) if case.seed % 3 else 1 + case.seed % 5
        spec = attrs.evolve(case.spec, kind=kind, **extra)
        if supported(backend, spec, options, softcap=case.softcap,
                     sinks=True if case.sinks else None) and \
                case.layout.name in _preferred(backend, spec):
            out.append(case.with_(spec=spec))
    return out


def _preferred(backend, spec):
    from ...util.errors import KVABIError

    try:
        return tuple(backend.preferred_layouts(spec))
    except KVABIError:
        return ()


@st.composite
def _poison_params(draw, backend, options):
    case = draw(attention_cases(backend, options, num_layers=(1, 2)))
    caps = backend.capabilities(None)
    kinds = () if case.spec.is_mla else tuple(
        k for k in caps.kinds if k not in ("mla", case.spec.kind)
        and (options.kinds is None or k in options.kinds))
    return WithExtra(case, {"kinds": kinds})


def poison_strategy(backend, options):
    return _poison_params(backend, options)
