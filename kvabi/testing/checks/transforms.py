"""Each metadata transform holds through the backend: running the backend on transformed
metadata gives the reference's result on the original."""
from __future__ import annotations

import attrs
import numpy as np
from hypothesis import strategies as st

from ...step.merge import merge_attention
from ...transforms import (cascade_split, local_virtual_batches, pad, permute_requests,
                           prefill_skip, reorder_decode_first, split_ubatches)
from ..cases import exact_values
from ..harness import Runner, StepData, expect_same_cache, step_inputs
from ..measure import ConformanceFailure
from .attention import compare_outputs, reference_step
from .base import KitOptions, NotApplicable, WithExtra, attention_cases, spec_strategy


# -- prefill skip ------------------------------------------------------------------------
def keep_indices(meta, counts):
    """Token indices keeping the last ``counts[r]`` query tokens of each request r."""
    q = meta.query_lens.astype(np.int64)
    k = np.minimum(np.asarray(counts, np.int64)[:len(q)], q)
    end = meta.query_start_loc[1:].astype(np.int64)
    owner = np.repeat(np.arange(len(q)), k)
    within = np.arange(len(owner)) - np.repeat(np.cumsum(k) - k, k)
    return end[owner] - k[owner] + within


def check_prefill_skip(backend, reference, params, options: KitOptions = KitOptions()
                       ) -> float:
    """A KV-sharing layer over ``prefill_skip(meta)`` equals the full computation at the
    kept tokens, and never writes: the cache is as the target layer left it."""
    case, counts = params.case, params.extra["keep_last"]
    meta = case.meta
    _, want, want_lse = reference_step(reference, case)
    keep = None if counts is None else keep_indices(meta, counts)
    meta2, idx = prefill_skip(meta, keep)
    b = Runner(backend, case, oracle=False)
    k, v, q = step_inputs(case)
    b.write(b.plan(meta), k, v)  # the target layer wrote the step's K/V
    before = b.planes()
    got, got_lse = b.attend(b.plan(meta2), q[idx], lse=True)
    rows = np.arange(len(idx))
    err = compare_outputs(f"prefill_skip (kept tokens {idx.tolist()[:12]})", case, got,
                          want[idx], rows, options, got_lse=got_lse, want_lse=want_lse[idx])
    expect_same_cache("prefill-skipped attention must only read the cache", case.layout,
                      case.spec, b.planes(), before)
    return err


@st.composite
def _prefill_skip_params(draw, backend, options):
    case = draw(attention_cases(backend, options))
    counts = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=case.meta.num_reqs,
                                                max_size=case.meta.num_reqs).map(tuple)))
    return WithExtra(case, {"keep_last": counts})


def prefill_skip_strategy(backend, options):
    return _prefill_skip_params(backend, options)


# -- local attention as virtual batches ----------------------------------------------------
def check_local_virtual_batches(backend, reference, params, options: KitOptions = KitOptions()
                                ) -> float:
    """Full causal attention of the backend over ``local_virtual_batches(meta, C)`` equals
    the reference's chunked local attention (chunk C) over ``meta``."""
    case, chunk = params.case, params.extra["chunk"]
    local = case.with_(spec=attrs.evolve(case.spec, kind="chunked_local", chunk=chunk))
    _, want, want_lse = reference_step(reference, local)
    meta2, _ = local_virtual_batches(case.meta, chunk)
    b = Runner(backend, case, oracle=False)
    k, v, q = step_inputs(case)
    b.write(b.plan(case.meta), k, v)
    got, got_lse = b.attend(b.plan(meta2), q, lse=True)
    rows = np.arange(case.meta.num_actual_tokens)
    return compare_outputs(f"local_virtual_batches(chunk={chunk})", case, got, want, rows,
                           options, got_lse=got_lse, want_lse=want_lse)


@st.composite
def _local_params(draw, backend, options):
    spec = draw(spec_strategy(backend, options, kinds=("full",)))
    case = draw(attention_cases(backend, options, spec=spec))
    chunk = draw(st.integers(1, 3)) * spec.block_size
    return WithExtra(case, {"chunk": chunk})


def local_strategy(backend, options):
    spec_strategy(backend, options, kinds=("full",))  # NotApplicable without full attention
    return _local_params(backend, options)


# -- micro-batches ---------------------------------------------------------------------
def check_split_ubatches(backend, reference, params, options: KitOptions = KitOptions()
                         ) -> float:
    """Writing and attending ``split_ubatches(meta, cuts)`` one after the other gives the
    reference's outputs and cache for the whole step."""
    case, cuts = params.case, params.extra["cuts"]
    meta = case.meta
    r, want, want_lse = reference_step(reference, case)
    b = Runner(backend, case, oracle=False)
    k, v, q = step_inputs(case)
    edges = [0] + list(cuts) + [meta.num_tokens]
    parts = split_ubatches(meta, list(cuts))
    if len(parts) != len(edges) - 1:
        raise ConformanceFailure(f"split_ubatches gave {len(parts)} micro-batches for cuts "
                                 f"{list(cuts)}")
    outs, lses = [], []
    for (a, e), mu in zip(zip(edges, edges[1:]), parts):
        plan = b.plan(mu)
        b.write(plan, k[a:e], None if v is None else v[a:e])
        o, l_ = b.attend(plan, q[a:e], lse=True)
        outs.append(o)
        lses.append(l_)
    got, got_lse = np.concatenate(outs), np.concatenate(lses)
    rows = np.arange(meta.num_actual_tokens)
    err = compare_outputs(f"split_ubatches(cuts={list(cuts)})", case, got, want, rows,
                          options, got_lse=got_lse, want_lse=want_lse)
    expect_same_cache("micro-batch writes", case.layout, case.spec, b.planes(), r.planes(),
                      step=StepData(k, v, meta.slot_mapping, case.layer,
                                    case.scales()))
    return err


@st.composite
def _ubatch_params(draw, backend, options):
    case = draw(attention_cases(backend, options))
    n = case.meta.num_tokens
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    return WithExtra(case, {"cuts": tuple(cuts)})


def ubatch_strategy(backend, options):
    return _ubatch_params(backend, options)


# -- cascade -----------------------------------------------------------------------------
def common_prefix_columns(meta) -> int:
    """Leading block table columns equal across every request with query tokens."""
    rows = meta.block_table[meta.query_lens > 0]
    if len(rows) == 0:
        return 0
    need = -(-meta.seq_lens[meta.query_lens > 0] // meta.block_size)
    same = (rows == rows[:1]).all(axis=0)
    n = int(np.argmin(same)) if not same.all() else len(same)
    return min(n, int(need.min()))


def check_cascade(backend, reference, params, options: KitOptions = KitOptions()) -> float:
    """The backend's attention over ``cascade_split``'s prefix and suffix parts, merged by
    ``merge_attention``, equals the reference's attention over the whole step."""
    case, cpb = params.case, params.extra["common_prefix_blocks"]
    _, want, want_lse = reference_step(reference, case)
    prefix_len, pm, sm = cascade_split(case.meta, cpb)
    b = Runner(backend, case, oracle=False)
    k, v, q = step_inputs(case)
    b.write(b.plan(case.meta), k, v)
    o2, l2 = b.attend(b.plan(sm), q, lse=True)
    if pm is not None:
        o1, l1 = b.attend(b.plan(pm), q, lse=True)
        got, got_lse = merge_attention(o1, l1, o2, l2)
    else:
        got, got_lse = o2, l2
    rows = np.arange(case.meta.num_actual_tokens)
    return compare_outputs(f"cascade (prefix_len={prefix_len})", case, got, want, rows,
                           options, got_lse=got_lse, want_lse=want_lse)


@st.composite
def _cascade_params(draw, backend, options):
    case = draw(attention_cases(backend, options, kinds=("full", "mla"), shared_prefix=True,
                                sinks=False))
    common = common_prefix_columns(case.meta)
    cpb = draw(st.integers(1, max(1, common)))
    return WithExtra(case, {"common_prefix_blocks": cpb})


def cascade_strategy(backend, options):
    spec_strategy(backend, options, kinds=("full", "mla"))
    return _cascade_params(backend, options)


# -- static-shape padding --------------------------------------------------------------------
def check_pad(backend, reference, params, options: KitOptions = KitOptions()) -> float:
    """Over ``pad(meta, T, R)`` (padding rows hold garbage) the real outputs are unchanged
    and no cache byte outside the real slots changes."""
    case = params.case
    et, er = params.extra["extra_tokens"], params.extra["extra_reqs"]
    meta = case.meta
    r, want, want_lse = reference_step(reference, case)
    meta2 = pad(meta, meta.num_tokens + et, meta.num_reqs + er)
    rng = np.random.default_rng(case.seed ^ 0x5EED)
    k, v, q = step_inputs(case)

    def grow(x):
        if x is None:
            return None
        junk = exact_values(rng, (et,) + x.shape[1:], case.spec.dtype).astype(x.dtype)
        return np.concatenate([x, junk])

    b = Runner(backend, case, oracle=False)
    plan = b.plan(meta2)
    k, v = grow(k), grow(v)
    b.write(plan, k, v)
    got, got_lse = b.attend(plan, grow(q), lse=True)
    rows = np.arange(meta.num_actual_tokens)
    err = compare_outputs(f"pad(+{et} tokens, +{er} requests)", case, got[:meta.num_tokens],
                          want, rows, options, got_lse=got_lse[:meta.num_tokens],
                          want_lse=want_lse)
    expect_same_cache("write_kv over padded metadata", case.layout, case.spec, b.planes(),
                      r.planes(), step=StepData(k, v, meta2.slot_mapping, case.layer,
                                                case.scales()))
    return err


@st.composite
def _pad_params(draw, backend, options):
    case = draw(attention_cases(backend, options))
    return WithExtra(case, {"extra_tokens": draw(st.integers(0, 5)),
                            "extra_reqs": draw(st.integers(0, 3))})


def pad_strategy(backend, options):
    return _pad_params(backend, options)


# -- request order -------------------------------------------------------------------------
def check_permute(backend, reference, params, options: KitOptions = KitOptions()) -> float:
    """Over ``permute_requests(meta, perm)`` (e.g. decodes first) the backend's outputs are
    the reference's, permuted the same way, and the cache is the same."""
    case, perm = params.case, params.extra["perm"]
    meta = case.meta
    if perm is None:
        perm = reorder_decode_first(meta)
    r, want, want_lse = reference_step(reference, case)
    meta2, tp = permute_requests(meta, perm)
    k, v, q = step_inputs(case, tp)
    b = Runner(backend, case, oracle=False)
    plan = b.plan(meta2)
    b.write(plan, k, v)
    got, got_lse = b.attend(plan, q, lse=True)
    rows = np.arange(meta2.num_actual_tokens)
    err = compare_outputs(f"permute_requests(perm={list(map(int, perm))})", case, got,
                          want[tp], rows, options, got_lse=got_lse, want_lse=want_lse[tp])
    expect_same_cache("write_kv over permuted requests", case.layout, case.spec, b.planes(),
                      r.planes(), step=StepData(k, v, meta2.slot_mapping, case.layer,
                                                case.scales()))
    return err


@st.composite
def _permute_params(draw, backend, options):
    case = draw(attention_cases(backend, options))
    n = case.meta.num_reqs
    perm = draw(st.one_of(st.none(), st.permutations(range(n)).map(tuple)))
    return WithExtra(case, {"perm": perm})


def permute_strategy(backend, options):
    return _permute_params(backend, options)


__all__ = ["NotApplicable", "check_cascade", "check_local_virtual_batches", "check_pad",
           "check_permute", "check_prefill_skip", "check_split_ubatches"]
