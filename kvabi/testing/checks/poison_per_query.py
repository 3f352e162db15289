"""Masking is per query, not per step (``specs/semantics.md`` section 2): a row that some
queries of a step see and another query does not (past that query's causal bound, before
its window or chunk, in a block another request shares) holds NaN or +/-inf, and the
queries that do not see it get exactly the clean result.

``poisoned_rows`` only poisons rows no query of the step sees, which a backend passes by
zeroing rows per step; a backend that multiplies a masked probability (0) by a NaN value,
or masks a NaN logit by adding ``-inf``, passes that check and fails this one.  Rows the
step writes are poisoned through the step's own K/V inputs, earlier rows in the cache.
The queries that see a poisoned row are not compared (their result is whatever IEEE
arithmetic on the poison gives).
"""
from __future__ import annotations

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from ..harness import Runner, step_inputs
from .attention import compare_outputs
from .base import (KitOptions, NotApplicable, WithExtra, attention_cases, claimed,
                   spec_strategy)
from .poison import poison_values, seen_pairs, variants


def seen_rows(meta, spec, num_slots: int) -> np.ndarray:
    """bool [real tokens, num_slots]: ``[t, s]`` when real query token ``t`` sees slot
    ``s``."""
    seen = np.zeros((meta.num_actual_tokens, num_slots), bool)
    seen[seen_pairs(meta, spec)] = True
    return seen


def pick_rows(case, salt: int):
    """(poisoned slots bool [num_slots], compared tokens) for ``case``: a witness query is
    drawn among those that miss some row another query sees, then a non-empty random
    subset of the rows it misses; compared are the queries that see none of them.  None
    when every query sees the same rows."""
    spec, layout, meta = case.spec, case.layout, case.meta
    seen = seen_rows(meta, spec, layout.num_blocks * spec.block_size)
    some = seen.any(axis=0)
    misses = some[None, :] & ~seen  # [t, slots]: rows another query sees and t does not
    witnesses = np.flatnonzero(misses.any(axis=1))
    if not witnesses.size:
        return None
    rng = np.random.default_rng([case.seed, salt])
    w = int(rng.choice(witnesses))
    cand = np.flatnonzero(misses[w])
    pick = cand[rng.random(cand.size) < 0.5]
    if not pick.size:
        pick = cand[[int(rng.integers(cand.size))]]
    dirty = np.zeros(seen.shape[1], bool)
    dirty[pick] = True
    compared = np.flatnonzero(~seen[:, dirty].any(axis=1))
    return dirty, compared


def check_poisoned_per_query(backend, reference, params, options: KitOptions = KitOptions()
                             ) -> float:
    """Rows some queries of the step see and others do not hold NaN and +/-inf (in the
    cache, or in the step's K/V where the step writes them): the output and lse of every
    query that sees none of them equal the reference's on the clean inputs.
    ``params.extra``: ``kinds`` (the other claimed kinds run on the same batch) and
    ``salt`` (picks the rows)."""
    case = getattr(params, "case", params)
    extra = getattr(params, "extra", {})
    worst = 0.0
    for c in variants(backend, case, extra.get("kinds", ()), options):
        picked = pick_rows(c, extra.get("salt", 0))
        if picked is None:
            continue  # under this kind every query sees the same rows
        with np.errstate(invalid="ignore", over="ignore"):  # arithmetic on poison is fine
            worst = max(worst, _step(backend, reference, c, options, *picked))
    return worst


def _step(backend, reference, case, options, dirty, compared) -> float:
    s = case.spec
    label = s.kind + (f" window={s.window}" if s.kind == "sliding_window" else "") + \
        (f" chunk={s.chunk}" if s.kind == "chunked_local" else "")
    k, v, q = step_inputs(case)
    clean = Runner(reference, case, oracle=True)
    plan = clean.plan(case.meta)
    clean.write(plan, k, v)
    want, want_lse = clean.attend(plan, q, lse=True)

    i = case.inputs()
    vals = poison_values(s.dtype)
    rng = np.random.default_rng([case.seed, 0x9016])

    def poison(x, rows):  # rows: a bool mask over x's leading axes
        if x is None:
            return None
        p = x.astype(np.float64)
        bad = rng.integers(0, len(vals), size=p.shape)
        p = np.where(rows.reshape(rows.shape + (1,) * (p.ndim - rows.ndim)), vals[bad], p)
        return p.astype(x.dtype)

    # rows in the cache before the step (the case's layer), and rows the step writes
    pool_mask = np.zeros((case.num_layers, dirty.size), bool)
    pool_mask[case.layer] = dirty
    pk, pv = poison(i.pool_k, pool_mask), poison(i.pool_v, pool_mask)
    slots = case.meta.slot_mapping.astype(np.int64)
    mine = (slots >= 0) & dirty[np.maximum(slots, 0)]
    pk_step, pv_step = poison(k, mine), poison(v, mine)
    b = Runner(backend, case, oracle=False, pool=(pk, pv))
    bplan = b.plan(case.meta)
    b.write(bplan, pk_step, pv_step)
    got, got_lse = b.attend(bplan, q, lse=True)
    n_tok = case.meta.num_actual_tokens
    return compare_outputs(
        f"poisoned_per_query ({label}, NaN/inf in {int(dirty.sum())} rows of layer "
        f"{case.layer} that {n_tok - len(compared)} of {n_tok} queries see; compared: the "
        f"{len(compared)} that do not)", case, got, want, compared, options,
        got_lse=got_lse, want_lse=want_lse)


#: why the check draws caches of quant none only
PER_QUERY_QUANT = ("poisoned_per_query puts NaN/inf in the step's K/V, which a quantizing "
                   "write may refuse (specs/semantics.md 11.1): caches of quant none only")


@st.composite
def _params(draw, backend, options, specs):
    case = draw(attention_cases(backend, options, num_layers=(1, 2), specs=specs))
    salt = draw(st.integers(0, 2**16))
    if pick_rows(case, salt) is None:
        reject()  # one decode query, or queries that all see the same rows
    caps = backend.capabilities(None)
    kinds = () if case.spec.is_mla else tuple(
        k for k in caps.kinds if k not in ("mla", case.spec.kind)
        and (options.kinds is None or k in options.kinds))
    return WithExtra(case, {"kinds": kinds, "salt": salt})


def poison_per_query_strategy(backend, options):
    if not any(q == "none" for _, q, _ in claimed(backend, options)):
        raise NotApplicable(f"{PER_QUERY_QUANT}; {backend.name} claims quantized caches only"
                            + ("" if options.quants is None else " (or --quant leaves none)"))
    return _params(backend, options, spec_strategy(backend, options, quants=("none",)))
