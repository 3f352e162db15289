"""The JSON descriptor: exact round trip, the normative schema, and untrusted input."""
import json

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import KVABIError, KVSpec, Layout
from kvabi.layout.presets import PRESETS, preset_names
from pathlib import Path

SCHEMA = json.loads((Path(__file__).parents[1] / "specs" / "layout.schema.json").read_text())

specs = st.builds(
    KVSpec, kind=st.just("full"), block_size=st.sampled_from([1, 4, 16]),
    num_kv_heads=st.sampled_from([1, 2, 8]), head_dim=st.sampled_from([8, 64, 96, 128]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]))


@settings(max_examples=80, deadline=None)
@given(spec=specs, name=st.sampled_from([n for n in PRESETS if n != "deepseek.fp8_ds_mla"]),
       B=st.integers(1, 50), L=st.integers(1, 4))
def test_round_trip_is_exact_and_schema_valid(spec, name, B, L):
    layout = Layout.preset(name, spec, B, L)
    text = layout.to_json()
    jsonschema.validate(json.loads(text), SCHEMA)
    back = Layout.from_json(text)
    assert back == layout
    assert back.to_json() == text
    assert back.byte_offset(L - 1, B - 1, 1, 0, 0, 0) == layout.byte_offset(L - 1, B - 1, 1)


def _doc(**over):
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    d = json.loads(Layout.preset("flashinfer.NHD", spec, 3).to_json())
    d.update(over)
    return d


def test_newer_minor_accepted_and_unknown_fields_ignored():
    d = _doc(kvabi_abi=[1, 7], compression="zstd", future={"x": 1})
    assert Layout.from_json(json.dumps(d)).name == "flashinfer.NHD"


@pytest.mark.parametrize("bad,match", [
    (dict(kvabi_abi=[3, 0]), "kvabi_abi"),
    (dict(kvabi_abi="1.0"), "kvabi_abi"),
    (dict(dtype="float64"), "dtype"),
    (dict(order=["B", "KV", "N", "H"]), "order"),
    (dict(order=["B", "KV", "N", "H", "D", "D"]), "order"),
    (dict(order=["B", "KV", "N", "H", "X"]), "order"),
    (dict(sizes={"L": 1, "B": -3, "KV": 2, "N": 4, "H": 2, "D": 8}), "sizes.B"),
    (dict(sizes={"L": 1, "B": 3, "KV": 3, "N": 4, "H": 2, "D": 8}), "sizes.KV"),
    (dict(sizes={"L": 1, "B": 3, "KV": 2, "N": 4, "H": 2, "D": True}), "sizes.D"),
    (dict(strides={"B": 256, "KV": 128, "N": 32, "H": 16, "D": -4}), "strides.D"),
    (dict(strides={"B": 256, "KV": 128, "N": 32, "H": 4, "D": 4}), "strides.H"),
    (dict(strides={"B": 256, "KV": 128, "N": 32, "H": 16, "D": 6}), "strides.D"),
    (dict(strides={"B": 256, "KV": 128, "N": 32}), "strides"),
    (dict(plane_bytes=100), "plane_bytes"),
    (dict(extents={"D": 4}), "extents.D"),
    (dict(folds=[["N", "D"]]), "folds"),
    (dict(folds="HD"), "folds"),
    (dict(packing=3), "packing"),
    (dict(planes=["B"]), "planes"),
])
def test_untrusted_descriptors_are_refused(bad, match):
    with pytest.raises(KVABIError, match=match):
        Layout.from_json(json.dumps(_doc(**bad)))


@pytest.mark.parametrize("text,match", [("{", "JSON"), ("[1]", "object"),
                                        ('{"kvabi_abi": [1, 0]}', "missing")])
def test_garbage_is_refused(text, match):
    with pytest.raises(KVABIError, match=match):
        Layout.from_json(text)


def test_max_bytes_bounds_the_whole_descriptor():
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    text = Layout.preset("flashinfer.NHD", spec, 3, num_layers=5).to_json()
    layout = Layout.from_json(text)
    total = 5 * layout.plane_nbytes  # one plane per layer
    assert layout.total_nbytes == total
    assert Layout.from_json(text, max_bytes=total).total_nbytes == total
    with pytest.raises(KVABIError, match="total_nbytes"):
        Layout.from_json(text, max_bytes=total - 1)
    with pytest.raises(KVABIError, match="total_nbytes"):  # one plane fits, five do not
        Layout.from_json(text, max_bytes=layout.plane_nbytes)


def test_explicit_strides_and_padding_round_trip():
    d = _doc(strides={"B": 1024, "KV": 256, "N": 64, "H": 32, "D": 4}, plane_bytes=4096)
    layout = Layout.from_json(json.dumps(d))
    assert layout.plane_nbytes == 4096
    assert layout.byte_offset(block=2, kv=1, token=3, head=1, dim=7) == (0, 2048 + 256 + 192 + 32 + 28)
    assert Layout.from_json(layout.to_json()) == layout
    jsonschema.validate(json.loads(layout.to_json()), SCHEMA)


def test_every_preset_for_mla_round_trips():
    spec = KVSpec(kind="mla", block_size=4, num_kv_heads=1, head_dim=576, head_dim_v=512)
    for name in preset_names(spec):
        layout = Layout.preset(name, spec, 5, 3)
        assert Layout.from_json(layout.to_json()) == layout
