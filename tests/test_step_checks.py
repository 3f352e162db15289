"""The step checks kvabi.Backend runs for every backend name the offending field."""
import math

import numpy as np
import pytest

import kvabi
from kvabi import (AttentionOptions, CommonAttentionMetadata, KVABIError, KVSpec, Layout,
                   check_step)
from kvabi.step.checks import check_kv, check_query, check_sinks

SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
META = CommonAttentionMetadata.from_lengths([2, 1], [3, 0], [[0, 1], [2, 0]], 4)


def test_options_resolve_default_scale_and_validate():
    o = AttentionOptions.resolve(SPEC)
    assert o.scale == 1 / math.sqrt(8) and o.softcap is None and o.sinks is None
    o = AttentionOptions.resolve(SPEC, 0.5, 30, [0.1, 0.2, 0.3, 0.4])
    assert o.scale == 0.5 and o.softcap == 30.0 and o.sinks.dtype == np.float64
    assert not o.sinks.flags.writeable


@pytest.mark.parametrize("kw,match", [(dict(scale=0), "scale"), (dict(scale="x"), "scale"),
                                      (dict(softcap=-1), "softcap"),
                                      (dict(softcap=float("inf")), "softcap"),
                                      (dict(sinks=[[1.0]]), "sinks"),
                                      (dict(sinks=[float("nan")]), "sinks")])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(KVABIError, match=match):
        AttentionOptions.resolve(SPEC, **kw)


def test_check_step_matches_meta_spec_layout():
    layout = Layout.preset("flash_attn", SPEC, 3)
    check_step(META, SPEC, layout)
    with pytest.raises(KVABIError, match=r"block_table: entry \[0, 1\] = 1 is outside .* 1 "):
        check_step(META, SPEC, Layout.preset("flash_attn", SPEC, 1))
    with pytest.raises(KVABIError, match="layout.dtype"):
        check_step(META, SPEC, Layout.preset("flash_attn", KVSpec(
            kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16"), 3))
    with pytest.raises(KVABIError, match="layout.sizes.H"):
        check_step(META, SPEC, Layout.preset("flash_attn", KVSpec(
            kind="full", block_size=4, num_kv_heads=1, head_dim=8, dtype="float32"), 3))
    with pytest.raises(KVABIError, match="meta.block_size"):
        check_step(CommonAttentionMetadata.from_lengths([1], [0], [[0]], 8), SPEC, layout)
    with pytest.raises(KVABIError, match="meta"):
        check_step("meta", SPEC, layout)
    # a spec whose head dim is not the layout's: refused here, not in a kernel
    for d in (4, 16):
        with pytest.raises(KVABIError, match=f"layout.sizes.D: must equal spec.head_dim {d}"):
            check_step(META, KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=d,
                                    dtype="float32"), layout)


def test_check_query_and_kv_shapes():
    assert check_query(np.zeros((3, 6, 8)), META, SPEC) == 6
    for bad in [(3, 3, 8), (2, 4, 8), (3, 4, 7), (3, 4)]:
        with pytest.raises(KVABIError, match="query"):
            check_query(np.zeros(bad), META, SPEC)
    with pytest.raises(KVABIError, match="query.dtype: must be a floating-point dtype"):
        check_query(np.zeros((3, 6, 8), np.int32), META, SPEC)
    check_kv(np.zeros((3, 2, 8)), np.zeros((3, 2, 8)), META, SPEC)
    with pytest.raises(KVABIError, match="key"):
        check_kv(np.zeros((3, 1, 8)), np.zeros((3, 2, 8)), META, SPEC)
    with pytest.raises(KVABIError, match="value"):
        check_kv(np.zeros((3, 2, 8)), None, META, SPEC)
    mla = KVSpec(kind="mla", block_size=4, num_kv_heads=1, head_dim=12, head_dim_v=8)
    check_kv(np.zeros((3, 1, 12)), None, META, mla)
    with pytest.raises(KVABIError, match="value: must be None for MLA"):
        check_kv(np.zeros((3, 1, 12)), np.zeros((3, 1, 8)), META, mla)


def test_check_step_bounds_what_backends_index_with():
    """After check_step every used block id is inside the layout, so every slot is below
    num_blocks * block_size; unused columns may hold anything; index_dtype says when int32
    suffices."""
    layout = Layout.preset("flash_attn", SPEC, 3)
    # unused columns (past each request's need) may hold anything
    meta = CommonAttentionMetadata.from_lengths([2, 1], [3, 0], [[0, 1, -7], [2, 2**31 - 1, -1]],
                                                4)
    check_step(meta, SPEC, layout)
    for bt, entry in (([[0, 1, 0], [3, 0, 0]], r"\[1, 0\] = 3"),
                      ([[0, 2**31 - 1, 0], [2, 0, 0]], r"\[0, 1\] = 2147483647")):
        bad = CommonAttentionMetadata.from_lengths([2, 1], [3, 0], bt, 4)
        with pytest.raises(KVABIError, match=rf"block_table: entry {entry} is outside"):
            check_step(bad, SPEC, layout)
    with pytest.raises(KVABIError, match="layout"):
        check_step(META, SPEC, "flash_attn")
    assert kvabi.index_dtype(layout) == np.int32
    assert kvabi.index_dtype(Layout.preset("flash_attn", SPEC, 2**29)) == np.int32
    assert kvabi.index_dtype(Layout.preset("flash_attn", SPEC, 2**29 + 1)) == np.int64


def test_sinks_and_num_q_heads_checks():
    assert check_sinks(None) is None
    given = np.array([1, -np.inf])
    s = check_sinks(given, 2)
    assert s.dtype == np.float64 and s.tolist() == [1.0, -np.inf]
    assert s is not given and not s.flags.writeable and given.flags.writeable  # its own copy
    for bad in ([1j], ["x"], [True], [np.nan], [np.inf], [[1.0]], "1.0"):
        with pytest.raises(KVABIError, match="sinks"):
            check_sinks(bad)
    with pytest.raises(KVABIError, match=r"sinks: must have one logit per query head \(4\)"):
        check_sinks([1.0], 4)
    assert kvabi.check_num_q_heads(6, SPEC) == 6
    for bad in (3, 0, -2, 4.0, True, "4", None):
        with pytest.raises(KVABIError, match="num_q_heads"):
            kvabi.check_num_q_heads(bad, SPEC)
    o = AttentionOptions.resolve(SPEC, num_q_heads=4, sinks=[0, 1, 2, 3])
    assert o.sinks.shape == (4,)
    with pytest.raises(KVABIError, match="sinks"):
        AttentionOptions.resolve(SPEC, num_q_heads=2, sinks=[0, 1, 2, 3])
    for bad in (True, "0.5", 1j, float("nan")):
        with pytest.raises(KVABIError, match="scale"):
            AttentionOptions.resolve(SPEC, scale=bad)


def test_metadata_keeps_its_own_copy_of_a_callers_array():
    """An engine's persistent buffer, given as is: the metadata keeps its own copy (the
    buffer stays writable, and writing it later does not change the checked metadata)."""
    bt = np.array([[0, 1], [2, 0]], np.int32)
    slots = np.array([0, 1, 8], np.int64)
    meta = CommonAttentionMetadata(query_start_loc=[0, 2, 3], seq_lens=[2, 1],
                                   context_lens=[0, 0], positions=[0, 1, 0],
                                   slot_mapping=slots, block_table=bt, block_size=4,
                                   num_blocks=3)
    assert bt.flags.writeable and slots.flags.writeable
    bt[0, 0], slots[0] = 2, 9
    assert meta.block_table.tolist() == [[0, 1], [2, 0]]
    assert meta.slot_mapping.tolist() == [0, 1, 8]
    meta.validate()


def test_check_step_refuses_slots_outside_the_layout_even_if_changed_after_validation():
    layout = Layout.preset("flash_attn", SPEC, 3)
    meta = CommonAttentionMetadata.from_lengths([2, 1], [3, 0], [[0, 1], [2, 0]], 4)
    with pytest.raises(ValueError, match="read-only"):
        meta.slot_mapping[1] = 12  # kvabi's own validated arrays are read-only
    meta.slot_mapping.flags.writeable = True  # a caller who insists, after validation
    meta.slot_mapping[1] = 12
    with pytest.raises(KVABIError, match="slot_mapping: token 1 has slot 12"):
        check_step(meta, SPEC, layout)
    meta.slot_mapping[1] = -2
    with pytest.raises(KVABIError, match="slot_mapping: token 1 has slot -2"):
        check_step(meta, SPEC, layout)


def test_query_and_kv_must_be_real_arrays():
    for bad in (np.zeros((3, 4, 8), complex), np.zeros((3, 4, 8), bool),
                np.zeros((3, 4, 8), "U1"), np.zeros((3, 4, 8), object)):
        with pytest.raises(KVABIError, match="query: must hold real numbers"):
            check_query(bad, META, SPEC)
    with pytest.raises(KVABIError, match="query: must be an array"):
        check_query([[[0.0] * 8] * 4] * 3, META, SPEC)
    with pytest.raises(KVABIError, match="key: must hold real numbers"):
        check_kv(np.zeros((3, 2, 8), complex), np.zeros((3, 2, 8)), META, SPEC)
    with pytest.raises(KVABIError, match="value: must hold real numbers"):
        check_kv(np.zeros((3, 2, 8)), np.zeros((3, 2, 8), np.complex64), META, SPEC)
    torch = pytest.importorskip("torch")
    check_query(torch.zeros((3, 4, 8), dtype=torch.bfloat16), META, SPEC)
    with pytest.raises(KVABIError, match="query: must hold real numbers"):
        check_query(torch.zeros((3, 4, 8), dtype=torch.complex64), META, SPEC)
    with pytest.raises(KVABIError, match="key: must hold real numbers"):
        check_kv(torch.zeros((3, 2, 8), dtype=torch.bool), torch.zeros((3, 2, 8)), META, SPEC)
