"""Failure diagnostics are computed where the kit compares: for attention the worst
element's token, head, got and want values and their ratio; for writes which token's data
landed in which wrong slot.  Plain numbers in ``ConformanceFailure.details`` and in the
message (no numpy reprs)."""
from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

import kvabi
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing import (ConformanceFailure, KitOptions, check_attention, check_write_kv,
                           get_check, run_check)
from kvabi.testing.cases import AttentionCase
from kvabi.testing.measure import describe_worst, worst_element

NUMPY_REPRS = ("np.", "array(", "dtype=", "float64(", "int64(")


def _plain(details):
    for k, v in details.items():
        assert type(v) in (int, float, str, bool, type(None), list), (k, type(v))
    return details


def _case(softcap=None):
    spec = kvabi.KVSpec("full", block_size=2, num_kv_heads=2, head_dim=4, dtype="float32")
    meta = kvabi.CommonAttentionMetadata.from_lengths([2, 1], [3, 1], [[1, 0, 3], [2, 4, 4]],
                                                      2, num_blocks=5, num_tokens=4)
    layout = kvabi.Layout.preset("flash_attn", spec, num_blocks=5)
    return AttentionCase(spec, layout, meta, num_q_heads=4, softcap=softcap, seed=4)


class WrongSlot(ReferenceBackend):
    """Writes the step's first token one slot too far."""

    name = "planted.diag_wrong_slot"

    def prepare(self, plan):
        m = plan.meta
        s = m.slot_mapping.copy()
        s[0] += 1
        shifted = kvabi.CommonAttentionMetadata._trusted(
            m.query_start_loc, m.seq_lens, m.context_lens, m.positions, s, m.block_table,
            m.block_size, m.num_blocks)
        return super().prepare(attrs.evolve(plan, meta=shifted))


class WritesPadding(ReferenceBackend):
    """Writes the padding token into the pool's last slot."""

    name = "planted.diag_writes_padding"

    def write(self, plan, cache, key, value, layer, **scales):
        cache = super().write(plan=plan, cache=cache, key=key, value=value, layer=layer,
                              **scales)
        pad = np.nonzero(plan.meta.slot_mapping < 0)[0]
        cache.kv_view(layer, 1)[-1, -1] = np.asarray(value[pad[-1]])
        return cache


def test_write_failure_names_the_token_and_the_slot():
    case = _case()
    ref = ReferenceBackend()
    with pytest.raises(ConformanceFailure) as info:
        check_write_kv(WrongSlot(), ref, case)
    e = info.value
    s0 = int(case.meta.slot_mapping[0])
    msg = str(e)
    assert f"slot {s0 + 1} of layer 0 K holds token 0's key (it belongs in slot {s0})" in msg
    d = _plain(e.details)
    assert d["layer"] == 0 and d["kv"] == "K" and d["holds_token"] == 0
    assert d["holds"] == "key" and d["token_slot"] == s0
    assert not any(r in msg for r in NUMPY_REPRS), msg


def test_write_failure_names_a_padding_token():
    case = _case()
    with pytest.raises(ConformanceFailure) as info:
        check_write_kv(WritesPadding(), ReferenceBackend(), case)
    msg = str(info.value)
    assert "holds token 3's value (a padding token, slot -1)" in msg
    assert "it should be unchanged" in msg
    assert info.value.details["slot"] == 5 * 2 - 1 and info.value.details["kv"] == "V"


class NoSoftcap(ReferenceBackend):
    name = "planted.diag_no_softcap"

    def attend(self, plan, **kw):
        return super().attend(plan=attrs.evolve(plan, softcap=None), **kw)


def test_attention_failure_names_the_worst_element():
    case = _case(softcap=1.5)
    ref = ReferenceBackend()
    with pytest.raises(ConformanceFailure) as info:
        check_attention(NoSoftcap(), ref, case)
    e = info.value
    d = _plain(e.details)
    for k in ("token", "head", "element", "got", "want", "error", "tolerance"):
        assert k in d, k
    assert 0 <= d["token"] < case.meta.num_actual_tokens and 0 <= d["head"] < 4
    assert d["ratio"] == pytest.approx(d["got"] / d["want"])
    assert f"worst at token {d['token']} head {d['head']} element {d['element']}" in str(e)
    assert not any(r in str(e) for r in NUMPY_REPRS), str(e)
    # The worst element is where |got - want| is largest over the real tokens.
    want = _step(ref, case)
    got = _step(NoSoftcap(), case)
    n = case.meta.num_actual_tokens
    t, h, x = np.unravel_index(np.argmax(np.abs(got[:n] - want[:n])), got[:n].shape)
    assert (d["token"], d["head"], d["element"]) == (t, h, x)
    assert d["got"] == pytest.approx(got[t, h, x]) and d["want"] == pytest.approx(want[t, h, x])


def _step(backend, case):
    """One write + attention of ``case`` on a numpy backend, from the kit's starting
    cache (every slot filled from the case's pool)."""
    from kvabi.testing.harness import oracle_cache

    cache = kvabi.KVCache.wrap(case.layout, oracle_cache(case, via_backend_allocate=True))
    i = case.inputs()
    plan = backend.plan(case.meta, case.spec, case.layout, num_q_heads=case.num_q_heads,
                        softcap=case.softcap)
    cache = backend.write_kv(plan, cache, key=i.key, value=i.value)
    return np.asarray(backend.attention(plan, cache, query=i.query), np.float64)


class LseLog2(ReferenceBackend):
    name = "planted.diag_lse_log2"

    def attend(self, **kw):
        out, lse = super().attend(**kw)
        return out, lse / math.log(2)


def test_base2_lse_shows_its_ratio():
    res = run_check(get_check("attention"), LseLog2(), options=KitOptions(dtypes=("float32",)),
                    max_examples=30, seed=2, time_budget=None, shrink=False, replay=None)
    assert res.failed
    d = res.exception.details
    assert d["ratio"] == pytest.approx(1 / math.log(2), rel=1e-9)
    assert "ratio 1.443" in res.message


def test_worst_element_formula():
    got = np.zeros((3, 2, 2))
    want = np.zeros((3, 2, 2))
    want[1, 1, 0] = 2.0
    got[1, 1, 0] = 5.0
    got[2, 0, 1] = np.nan  # padding row: excluded
    d = worst_element(got, want, np.arange(2))
    assert d == {"token": 1, "head": 1, "element": 0, "got": 5.0, "want": 2.0, "ratio": 2.5,
                 "abs_error": 3.0}
    assert describe_worst(d) == "worst at token 1 head 1 element 0: got 5, want 2 (ratio 2.5)"
    d = worst_element(got, want, np.arange(3))
    assert d["token"] == 2 and math.isnan(d["got"]) and d["ratio"] is None
