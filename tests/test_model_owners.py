"""``ModelKV.owners`` gives names like its siblings; the LayerKV objects are
``owner_layers``."""
from __future__ import annotations

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
    assert m.owners == ("a", "b") and all(type(n) is str for n in m.owners)
    assert m.owner_layers == (LayerKV("a", SLIDE), LayerKV("b", FULL))
    assert set(m.shared_layers.values()) <= set(m.owners)   # siblings speak names too
    assert m.prefill_skip_layers == ("c", "d")
    with pytest.raises(AttributeError):
        m.owners[0].spec  # noqa: B018 - a name, not the object (owner_layers has those)
