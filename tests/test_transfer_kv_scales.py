"""Per-tensor KV scales in the transfer handshake: carried as float32 values, refused by
field when malformed (parser and schema alike), and compared by a puller, a mismatch named
by layer and scale."""
import json

import numpy as np
import pytest

from kvabi import KVABIError, KVSpec, Layout
from kvabi.transfer.handshake import make_handshake, parse_handshake
from kvabi.transfer.kv_scales import check_same_scales

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("referencing")
from test_transfer_handshake_schema import VALIDATOR  # noqa: E402 - the schema, resolved

SPEC = KVSpec("full", 16, 2, 64, dtype="float8_e4m3fn", quant="per_tensor")
LAYOUT = Layout.preset("vllm.LBHNC", SPEC, num_blocks=4, num_layers=3)
SCALES = [(0.05, 0.04), (0.031, 0.07), (1.0, 0.5)]


def message(**kw):
    return make_handshake(agent_name="a", host="127.0.0.1", port=5555, memory="DRAM",
                          layout=LAYOUT, planes=[(4096, LAYOUT.plane_nbytes, 0)], **kw)


def test_scales_round_trip_as_float32_values():
    h = parse_handshake(message(kv_scales=SCALES))
    assert h.kv_scales == tuple((float(np.float32(k)), float(np.float32(v)))
                                for k, v in SCALES)
    assert parse_handshake(message()).kv_scales is None
    VALIDATOR.validate(json.loads(message(kv_scales=SCALES)))


@pytest.mark.parametrize("bad,field,schema", [
    ([[0.05, 0.04]], "kv_scales: the layout has 3 layers", False),  # beyond a schema
    ([[0.05, 0.04], [0.0, 1.0], [1.0, 1.0]], r"kv_scales\[1\].k_scale", True),
    ([[0.05, 0.04], [1.0, -1.0], [1.0, 1.0]], r"kv_scales\[1\].v_scale", True),
    ([[0.05, 0.04], [1.0, True], [1.0, 1.0]], r"kv_scales\[1\]\[1\]: must be a number", True),
    ([[0.05, 0.04], [1.0], [1.0, 1.0]], r"kv_scales\[1\]: must be a pair", True),
    ({"0": [1, 1]}, "kv_scales: must be a list", True),
    ([[0.05, 0.04], [1e39, 1.0], [1.0, 1.0]], r"kv_scales\[1\].k_scale", False),  # float32
])
def test_malformed_scales_refused_by_field(bad, field, schema):
    msg = json.loads(message())
    msg["kv_scales"] = bad
    with pytest.raises(KVABIError, match=field):
        parse_handshake(json.dumps(msg))
    if schema:
        with pytest.raises(jsonschema.ValidationError):
            VALIDATOR.validate(msg)


def test_a_puller_refuses_other_scales_by_layer():
    check_same_scales(SCALES, parse_handshake(message(kv_scales=SCALES)).kv_scales)
    check_same_scales(None, None)
    other = [SCALES[0], (0.031, 0.0701), SCALES[2]]
    with pytest.raises(KVABIError, match=r"^kv_scales\[1\]\.v_scale: the peer's codes are "
                                         r"under 0\.070"):
        check_same_scales(SCALES, other)
    with pytest.raises(KVABIError, match="the peer's cache has none"):
        check_same_scales(SCALES, None)
    with pytest.raises(KVABIError, match="this cache has none"):
        check_same_scales(None, SCALES)
    with pytest.raises(KVABIError, match="lists 2 layers' scales, this cache 3"):
        check_same_scales(SCALES, SCALES[:2])
