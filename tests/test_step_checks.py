"""The public step checks every backend shares name the offending field."""
import math

import numpy as np
import pytest

from kvabi import (AttentionOptions, CommonAttentionMetadata, KVABIError, KVSpec, Layout,
                   check_kv, check_query, check_step)

SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
META = CommonAttentionMetadata.from_lengths([2, 1], [3, 0], [[0, 1], [2, 0]], 4)


def test_options_resolve_default_scale_and_validate():
    o = AttentionOptions.resolve(SPEC)
    assert o.scale == 1 / math.sqrt(8) and o.softcap is None and o.sinks is None
    o = AttentionOptions.resolve(SPEC, 0.5, 30, [0.1, 0.2, 0.3, 0.4])
    assert o.scale == 0.5 and o.softcap == 30.0 and o.sinks.dtype == np.float64
    o.check_heads(4)
    with pytest.raises(KVABIError, match=r"sinks: must have one logit per query head \(8\)"):
        o.check_heads(8)


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


def test_check_query_and_kv_shapes():
    assert check_query(np.zeros((3, 6, 8)), META, SPEC) == 6
    for bad in [(3, 3, 8), (2, 4, 8), (3, 4, 7), (3, 4)]:
        with pytest.raises(KVABIError, match="query"):
            check_query(np.zeros(bad), META, SPEC)
    check_kv(np.zeros((3, 2, 8)), np.zeros((3, 2, 8)), META, SPEC)
    with pytest.raises(KVABIError, match="key"):
        check_kv(np.zeros((3, 1, 8)), np.zeros((3, 2, 8)), META, SPEC)
    with pytest.raises(KVABIError, match="value"):
        check_kv(np.zeros((3, 2, 8)), None, META, SPEC)
    mla = KVSpec(kind="mla", block_size=4, num_kv_heads=1, head_dim=12, head_dim_v=8)
    check_kv(np.zeros((3, 1, 12)), None, META, mla)
    with pytest.raises(KVABIError, match="value: must be None for MLA"):
        check_kv(np.zeros((3, 1, 12)), np.zeros((3, 1, 8)), META, mla)
