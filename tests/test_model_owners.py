"""``ModelKV.owners`` gives names like its siblings (ABI 1.2); the LayerKV objects are
``owner_layers``; the 1.0/1.1 use of owners' items as objects keeps working, warned."""
from __future__ import annotations

import copy
import pickle

import pytest

from kvabi import KVSpec, LayerKV, ModelKV

FULL = KVSpec(kind="full", block_size=16, num_kv_heads=2, head_dim=64, dtype="float32")
SLIDE = KVSpec(kind="sliding_window", block_size=16, num_kv_heads=2, head_dim=64,
               dtype="float32", window=8)


def model():
    return ModelKV([LayerKV("a", SLIDE), LayerKV("b", FULL), LayerKV("c", SLIDE, shares="a"),
                    LayerKV("d", FULL, shares="b")])


def test_owners_are_names_in_layer_order():
    m = model()
    assert m.owners == ("a", "b") and all(type(n) is not LayerKV for n in m.owners)
    assert [str(n) for n in m.owners] == ["a", "b"]
    assert m.owner_layers == (LayerKV("a", SLIDE), LayerKV("b", FULL))
    assert set(m.shared_layers.values()) <= set(m.owners)   # siblings speak names too
    assert m.prefill_skip_layers == ("c", "d")
    assert pickle.loads(pickle.dumps(m.owners)) == ("a", "b")
    assert type(copy.deepcopy(m.owners)[0]) is str


def test_old_object_form_still_works_with_a_warning():
    m = model()
    with pytest.warns(DeprecationWarning, match="owner_layers"):
        assert m.owners[0].name == "a"
    with pytest.warns(DeprecationWarning):
        assert m.owners[1].spec == FULL and m.owners[1].shares is None
    with pytest.raises(AttributeError):
        m.owners[0].nonexistent  # noqa: B018
