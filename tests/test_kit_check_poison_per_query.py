"""The ``poisoned_per_query`` check: rows some queries see and others do not, poisoned; the
reference passes, and a backend that zeroes rows per step (not per query) fails it while
passing ``poisoned_rows``."""
from __future__ import annotations

import numpy as np

import kvabi
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing import KitOptions, get_check, run_check
from kvabi.testing.cases import AttentionCase
from kvabi.testing.checks.poison import visible_slots
from kvabi.testing.checks.poison_per_query import pick_rows, seen_rows


def _run(check, backend, n=20, seed=3, options=KitOptions()):
    return run_check(get_check(check), backend, options=options, max_examples=n, seed=seed,
                     time_budget=None, shrink=False, replay=None)


def _case(kind, seed=9, **kw):
    spec = kvabi.KVSpec(kind, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32", **kw)
    # request 0: 6 cached + 2 new (blocks 2, 0); request 1: a decode after 3 (block 1)
    meta = kvabi.CommonAttentionMetadata.from_lengths([2, 1], [6, 3], [[2, 0], [1, 3]], 4,
                                                      num_blocks=4)
    layout = kvabi.Layout.preset("flash_attn", spec, num_blocks=4, num_layers=2)
    return AttentionCase(spec, layout, meta, num_q_heads=1, layer=1, seed=seed)


def _seen_by_formula(case):
    """The semantics' visibility, one token and one key position at a time."""
    m, s = case.meta, case.spec
    out = np.zeros((m.num_actual_tokens, case.layout.num_blocks * s.block_size), bool)
    for t in range(m.num_actual_tokens):
        r = int(m.token_request[t])
        p = int(m.positions[t])
        lo = int(s.first_visible_key(np.array(p)))
        for j in range(lo, p + 1):
            out[t, int(m.block_table[r, j // s.block_size]) * s.block_size +
                j % s.block_size] = True
    return out


def test_seen_rows_follow_the_semantics_and_cover_visible_slots():
    for c in (_case("full"), _case("sliding_window", window=2),
              _case("chunked_local", chunk=4)):
        seen = seen_rows(c.meta, c.spec, 16)
        np.testing.assert_array_equal(seen, _seen_by_formula(c))
        np.testing.assert_array_equal(seen.any(axis=0), visible_slots(c.meta, c.spec, 16))


def test_picked_rows_are_seen_by_some_queries_and_by_none_compared():
    for seed in range(20):
        c = _case("sliding_window", seed=seed, window=2)
        dirty, compared = pick_rows(c, salt=seed)
        seen = _seen_by_formula(c)
        assert dirty.any() and compared.size
        assert seen[:, dirty].any(axis=0).all()  # each poisoned row: some query sees it
        assert not seen[np.ix_(compared, np.flatnonzero(dirty))].any()
        others = np.setdiff1d(np.arange(seen.shape[0]), compared)
        assert seen[np.ix_(others, np.flatnonzero(dirty))].any(axis=1).all()


def test_a_lone_decode_has_no_rows_to_pick():
    spec = kvabi.KVSpec("full", block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
    meta = kvabi.CommonAttentionMetadata.from_lengths([1], [5], [[0, 1]], 4, num_blocks=2)
    layout = kvabi.Layout.preset("flash_attn", spec, num_blocks=2)
    assert pick_rows(AttentionCase(spec, layout, meta, num_q_heads=1), salt=0) is None


def test_reference_passes():
    res = _run("poisoned_per_query", ReferenceBackend(), n=25)
    assert res.status == "passed", res.message + "\n" + res.example
    assert res.examples == 25


class ZeroesPerStep(ReferenceBackend):
    """Dense attention per request that zeroes the rows no query of the step sees (so
    ``poisoned_rows`` passes) and masks each query's logits by selection, but multiplies
    the masked probabilities (0) by every value row of its request: a NaN value that
    another query sees turns this query's output into NaN."""

    name = "planted.zeroes_per_step"

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        spec, meta, layout, c = plan.spec, plan.meta, plan.layout, cache
        h, bs = spec.num_kv_heads, spec.block_size
        q = np.asarray(query, np.float64)
        g = q.shape[1] // h
        seen_any = visible_slots(meta, spec, layout.num_blocks * bs)
        kv = c.kv_view(layer, 0).astype(np.float64).reshape(-1, h, spec.head_dim)
        vv = c.kv_view(layer, 1).astype(np.float64).reshape(-1, h, spec.head_dim_v)
        kv[~seen_any], vv[~seen_any] = 0.0, 0.0  # per step: the rows some query sees stay
        s = sinks  # this call's, else the plan's (the base class resolves them)
        res = np.zeros((q.shape[0], q.shape[1], spec.head_dim_v))
        lse = np.full(q.shape[:2], -np.inf)
        qsl = meta.query_start_loc
        for r in range(meta.num_reqs):  # a test oracle: one request at a time
            t0, t1, n = int(qsl[r]), int(qsl[r + 1]), int(meta.seq_lens[r])
            if t0 == t1:
                continue
            j = np.arange(n)
            slots = meta.block_table[r, j // bs].astype(np.int64) * bs + j % bs
            pos = meta.positions[t0:t1].astype(np.int64)[:, None]
            vis = (j[None, :] <= pos) & (j[None, :] >= spec.first_visible_key(pos))
            qr = q[t0:t1].reshape(t1 - t0, h, g, -1)
            x = np.einsum("thgd,nhd->thgn", qr, kv[slots]) * plan.scale
            if plan.softcap is not None:
                x = plan.softcap * np.tanh(x / plan.softcap)
            x = np.where(vis[:, None, None, :], x, -np.inf)  # selected: NaN logits masked
            sink = np.full((h, g), -np.inf) if s is None else s.reshape(h, g)
            m = np.maximum(x.max(axis=-1), sink)
            e = np.exp(x - m[..., None])
            z = e.sum(axis=-1) + np.exp(sink - m)
            o = np.einsum("thgn,nhd->thgd", e, vv[slots]) / z[..., None]  # 0 * NaN is NaN
            res[t0:t1] = o.reshape(t1 - t0, h * g, -1)
            lse[t0:t1] = (m + np.log(z)).reshape(t1 - t0, -1)
        return res, (lse if return_lse else None)


def test_zeroing_per_step_passes_poisoned_rows_and_fails_per_query():
    opts = KitOptions(kinds=("full", "sliding_window"), dtypes=("float32",))
    with np.errstate(invalid="ignore"):
        per_step = _run("poisoned_rows", ZeroesPerStep(), n=10, options=opts)
        assert per_step.status == "passed", per_step.message
        res = _run("poisoned_per_query", ZeroesPerStep(), n=20, options=opts)
    assert res.failed
    assert "poisoned_per_query" in res.message and "queries see" in res.message
