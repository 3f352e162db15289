"""The hostile-input checks (poisoned_rows, hostile_cache, huge_lengths): the reference
passes them, and each catches the class of bug it is for.

The planted attention is written from scratch where the reference is too careful to be
broken by a subclass: it masks by adding -inf.  (Bugs of the boundary itself, a write that
skips the plane checks or slots held in int32 before the block ids are checked, cannot be
planted in a backend any more: ``tests/test_backend_base.py`` shows the base class
refusing for a backend that checks nothing.)
"""
from __future__ import annotations

import math

import attrs

import numpy as np
import pytest

import kvabi
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing import KitOptions, get_check, run_check
from kvabi.testing.cases import AttentionCase
from kvabi.testing.checks.hostile import Guarded, huge_meta
from kvabi.testing.checks.poison import poison_values, poisoned_pool, visible_slots


def _run(check, backend, n=20, seed=3, options=KitOptions()):
    return run_check(get_check(check), backend, options=options, max_examples=n, seed=seed,
                     time_budget=None, shrink=False, replay=None)


@pytest.mark.parametrize("check", ["poisoned_rows", "hostile_cache", "huge_lengths"])
def test_reference_passes(check):
    res = _run(check, ReferenceBackend(), n=25)
    assert res.status == "passed", res.message + "\n" + res.example
    assert res.examples == 25
    if check != "poisoned_rows":
        assert res.refused == res.examples  # every hostile input refused


# -- what the poison is and where it goes -----------------------------------------------------
def test_poison_values_per_dtype():
    assert np.isnan(poison_values("float16")[0]) and np.isinf(poison_values("bfloat16")[1:]).all()
    e4 = poison_values("float8_e4m3fn")
    assert np.isnan(e4[0]) and e4[1] == 448.0 and e4[2] == -448.0  # no inf in e4m3fn
    assert set(poison_values("int8")) == {127.0, -128.0}


def _case(kind, **kw):
    spec = kvabi.KVSpec(kind, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32", **kw)
    # request 0: 6 cached + 2 new (slots in blocks 2, 0); request 1: a decode after 3
    # (block 1); block 3 is spare.
    meta = kvabi.CommonAttentionMetadata.from_lengths([2, 1], [6, 3], [[2, 0], [1, 3]], 4,
                                                      num_blocks=4)
    layout = kvabi.Layout.preset("flash_attn", spec, num_blocks=4, num_layers=2)
    return AttentionCase(spec, layout, meta, num_q_heads=1, layer=1, seed=9)


def test_visible_slots_by_the_semantics():
    full = visible_slots(_case("full").meta, _case("full").spec, 16)
    # request 0 sees positions 0..7 -> blocks 2 then 0; request 1 positions 0..3 -> block 1
    want = np.zeros(16, bool)
    want[[8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]] = True
    np.testing.assert_array_equal(full, want)
    c = _case("sliding_window", window=2)
    win = visible_slots(c.meta, c.spec, 16)
    want = np.zeros(16, bool)
    want[[1, 2, 3]] = True  # request 0 at positions 6, 7 sees 5..7 (block 0, slots 1..3)
    want[[6, 7]] = True  # request 1 at position 3 sees 2..3 (block 1)
    np.testing.assert_array_equal(win, want)


def test_poisoned_pool_poisons_exactly_the_invisible_rows():
    c = _case("sliding_window", window=2)
    pk, pv, dirty = poisoned_pool(c)
    clean = c.inputs().pool_k
    assert dirty[0].all()  # the other layer: every row
    vis = visible_slots(c.meta, c.spec, 16)
    np.testing.assert_array_equal(dirty[1], ~vis)
    assert np.array_equal(pk[1][vis], clean[1][vis])
    bad = pk[1][~vis]
    assert (~np.isfinite(bad)).all()


# -- planted: masking by adding -inf --------------------------------------------------------
class _Unquantized(ReferenceBackend):
    """The reference without quantized caches (the planted bugs below write and read
    unscaled values)."""

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), quant=("none",))


class AddsNegInf(_Unquantized):
    """Dense attention that masks by adding -inf to the logits of every slot of a
    request's blocks (instead of selecting the visible ones): NaN or inf in an invisible
    row turns the sum into NaN.  Correct on clean caches."""

    name = "planted.adds_neg_inf"

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        spec, meta, c = plan.spec, plan.meta, cache
        q = np.asarray(query, np.float64)
        t, hq, _ = q.shape
        h, bs = spec.num_kv_heads, spec.block_size
        g = hq // h
        kv = c.kv_view(layer, 0)
        vv = kv if spec.is_mla else c.kv_view(layer, 1)
        s = sinks
        res = np.zeros((t, hq, spec.head_dim_v))
        lse = np.full((t, hq), -np.inf)
        for i in range(meta.num_actual_tokens):  # a test oracle: one token at a time
            r = int(np.searchsorted(meta.query_start_loc, i, side="right")) - 1
            p = int(meta.positions[i])
            nb = -(-int(meta.seq_lens[r]) // bs)
            blocks = meta.block_table[r, :nb]
            keys = kv[blocks].reshape(nb * bs, h, -1)[..., :spec.head_dim].astype(np.float64)
            vals = vv[blocks].reshape(nb * bs, h, -1)[..., :spec.head_dim_v].astype(np.float64)
            j = np.arange(nb * bs)
            lo = int(spec.first_visible_key(np.array(p)))
            mask = np.where((j >= lo) & (j <= p), 0.0, -np.inf)
            for head in range(hq):
                kh = head // g
                x = keys[:, kh] @ q[i, head] * plan.scale
                if plan.softcap is not None:
                    x = plan.softcap * np.tanh(x / plan.softcap)
                x = x + mask  # the bug: NaN + -inf is NaN
                m = max(np.max(x), s[head] if s is not None else -np.inf)
                e = np.exp(x - m)
                z = e.sum() + (math.exp(s[head] - m) if s is not None else 0.0)
                res[i, head] = (e @ vals[:, kh]) / z
                lse[i, head] = m + math.log(z)
        return res, lse


def test_adds_neg_inf_is_right_on_clean_caches_but_fails_poisoned_rows():
    opts = KitOptions(kinds=("sliding_window", "full"), dtypes=("float32",))
    clean = _run("attention", AddsNegInf(), n=10, options=opts)
    assert clean.status == "passed", clean.message
    res = _run("poisoned_rows", AddsNegInf(), n=20, options=opts)
    assert res.failed
    assert "poisoned_rows" in res.message and "invisible rows" in res.message
    assert "error inf exceeds" in res.message


# -- the guard ---------------------------------------------------------------------------------
def test_guard_catches_a_write_past_the_memory():
    lay = _case("full").layout
    g = Guarded(lay, guard=64)
    assert g.changed() is None
    n = -(-lay.plane_nbytes // lay.itemsize) * lay.itemsize
    kvabi.KVCache.wrap(lay, g.planes)  # the planes own exactly the layout's memory
    g.buffers[1][n + 3] = 1  # past plane 1's memory: in its guard
    assert f"plane 1 byte {n + 3}" in g.changed()


def test_huge_meta_is_refused_by_kvabi_where_it_can():
    c = _case("full")
    for variant, value in (("context_len", 2**31 - 1), ("context_len", 2**63 - 1),
                           ("query_start_loc", 2**32), ("slot", 2**32)):
        with pytest.raises(kvabi.KVABIError):
            huge_meta(c, variant, value)
    m = huge_meta(c, "block_id", 2**30)  # valid metadata; only the layout cannot hold it
    assert int(m.block_table.max()) == 2**30
