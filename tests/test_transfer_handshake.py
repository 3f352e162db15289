"""The handshake message as untrusted input (no nixl needed): what is sent is accepted,
and every malformed field is refused by name; the JSON Schema in specs/ agrees."""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from kvabi import WIRE_VERSION, KVABIError, KVSpec
from kvabi.layout.descriptor import Layout
from kvabi.transfer.handshake import MAX_HANDSHAKE_BYTES, make_handshake, parse_handshake

SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
LAYOUT = Layout.preset("flashinfer.HND", SPEC, 6, 2)
PLANE = LAYOUT.plane_nbytes
SCHEMA = pathlib.Path(__file__).parent.parent / "specs" / "transfer.schema.json"


def message(**over):
    planes = [(4096 * (i + 1) << 20, LAYOUT.plane_nbytes, 0) for i in range(2)]
    d = json.loads(make_handshake(agent_name="prefill-0", host="127.0.0.1", port=5600,
                                  memory="DRAM", layout=LAYOUT, planes=planes,
                                  metadata=b"\x00agent-md"))
    for k, v in over.items():
        d[k] = v
    return d


def test_round_trip():
    h = parse_handshake(json.dumps(message()))
    assert h.layout == LAYOUT and h.abi == WIRE_VERSION and h.port == 5600
    assert h.agent_name == "prefill-0" and h.memory == "DRAM" and h.metadata == b"\x00agent-md"
    assert h.planes.dtype == np.int64 and h.planes.shape == (2, 3)
    assert list(h.plane_nbytes) == [LAYOUT.plane_nbytes] * 2
    assert h.fingerprint == LAYOUT.fingerprint() and h.model is None


def test_planes_are_compact():
    """A 64-layer model's per-layer planes: one address each, the shared size and device
    once; per-plane lists where they differ."""
    lay = Layout.preset("flashinfer.HND", SPEC, 6, 64)
    planes = [((i + 1) << 32, lay.plane_nbytes + (i == 5), 0) for i in range(64)]
    text = make_handshake(agent_name="prefill-0", host="127.0.0.1", port=5600, memory="DRAM",
                          layout=lay, planes=planes)
    d = json.loads(text)
    assert d["planes"]["device"] == 0 and len(d["planes"]["nbytes"]) == 64
    assert parse_handshake(text).planes.tolist() == [list(p) for p in planes]
    assert len(text) < 2048


def test_shard_and_model_travel():
    import attrs
    from kvabi.model.shard import Shard

    lay = attrs.evolve(LAYOUT, shard=Shard.tp(3, 4, 8))
    text = make_handshake(agent_name="prefill-3", host="127.0.0.1", port=5600, memory="DRAM",
                          layout=lay, planes=[(1 << 30, lay.plane_nbytes, 0)] * 2,
                          model="llama-3-8b@abc")
    h = parse_handshake(text)
    assert h.layout.shard == Shard.tp(3, 4, 8) and h.model == "llama-3-8b@abc"
    assert h.fingerprint == lay.fingerprint() != LAYOUT.fingerprint()
    # a shard changed in transit no longer matches the fingerprint sent with it
    d = json.loads(text)
    d["layout"]["shard"]["heads"] = [4, 5]
    with pytest.raises(KVABIError, match="fingerprint: the message says"):
        parse_handshake(json.dumps(d))


def test_schema_accepts_what_is_sent_and_refuses_a_bad_message():
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    schema = json.loads(SCHEMA.read_text())
    layout_schema = json.loads((SCHEMA.parent / "layout.schema.json").read_text())
    # "layout.schema.json" next to the handshake schema's $id
    uri = schema["$id"].rsplit("/", 1)[0] + "/layout.schema.json"
    registry = referencing.Registry().with_resource(
        uri, referencing.Resource.from_contents(layout_schema))
    check = jsonschema.Draft202012Validator(schema, registry=registry).validate
    check(message())
    for bad in (message(memory="HBM"), message(kvabi_abi=[3, 0]),
                _mutate(("layout", "dtype"), "float64"), _mutate(("planes",), KeyError),
                _mutate(("planes", "address"), [0, 1]), _mutate(("planes", "nbytes"), [0, 0])):
        with pytest.raises(jsonschema.ValidationError):
            check(bad)


def _mutate(path, value):
    d = message()
    obj = d
    for k in path[:-1]:
        obj = obj[k]
    if value is KeyError:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return d


@pytest.mark.parametrize("path, value, match", [
    (("kvabi_abi",), [3, 0], "kvabi_abi: the peer speaks ABI 3.0"),
    (("kvabi_abi",), [1], r"kvabi_abi: must be \[major, minor\]"),
    (("kvabi_abi",), [True, 1], r"kvabi_abi: must be \[major, minor\]"),
    (("kvabi_abi",), [1, 0], "kvabi_abi: the handshake message exists since ABI 1.1"),
    (("message",), "something.else", "message: must be"),
    (("agent", "zone"), "eu", "agent.zone: unknown field"),
    (("planes", "numa"), 0, r"planes.numa: unknown field"),
    (("agent", "name"), "prefill-0\n", "agent.name"),
    (("agent", "host"), "127.0.0.1\n", "agent.host"),
    (("metadata",), None, "metadata: must be a base64 string, got NoneType"),
    (("extra",), 1, "handshake.extra: unknown field"),
    (("planes",), KeyError, "handshake.planes: missing"),
    (("agent", "name"), "a b", "agent.name"),
    (("agent", "name"), 7, "agent.name"),
    (("agent", "host"), "", "agent.host"),
    (("agent", "port"), 0, "agent.port: must be >= 1"),
    (("agent", "port"), 70000, "agent.port: must be <= 65535"),
    (("agent", "port"), 56.0, "agent.port: must be an integer"),
    (("agent", "port"), True, "agent.port: must be an integer"),
    (("memory",), "HBM", "memory: must be one of DRAM, VRAM"),
    (("layout", "strides"), {"B": -1}, "strides"),
    (("layout", "kvabi_abi"), [0, 9], "kvabi_abi"),
    (("layout", "sizes"), "many", "sizes"),
    (("planes",), [], "planes: must be a JSON object"),
    (("planes", "address"), [], "planes.address: the layout has 2 planes, the message lists 0"),
    (("planes", "address"), 7, "planes.address: must be a list"),
    (("planes", "nbytes"), 16, r"planes.nbytes: plane 0 has 16 bytes registered, but the "),
    (("planes", "nbytes"), [PLANE, 16], r"planes.nbytes: plane 1 has 16 bytes registered"),
    (("planes", "nbytes"), [PLANE], r"planes.nbytes: 1 values for 2 planes"),
    (("planes", "address"), [1 << 30, 0], r"planes.address: values must be >= 1"),
    (("planes", "address"), [1 << 30, 2**62], r"planes: plane 1's address \+ nbytes passes"),
    (("planes", "address"), [1 << 30, "0x10"], r"planes.address: must"),
    (("planes", "address"), [1 << 30, 2.0], r"planes.address: must hold integers"),
    (("planes", "address"), [1 << 30, True], r"planes.address: must hold integers"),
    (("planes", "device"), -1, r"planes.device: must be >= 0"),
    (("planes", "device"), [0, 65537], r"planes.device: values must be <= 65536"),
    (("metadata",), "not base64!", "metadata: not valid base64"),
    (("fingerprint",), "kv1:" + "0" * 32, "fingerprint: the message says kv1:0000"),
    (("fingerprint",), KeyError, "handshake.fingerprint: missing"),
    (("fingerprint",), "kv1:abc", "fingerprint: must be a layout fingerprint"),
    (("model",), "a b", "model: must be 1-256 characters"),
    (("layout", "sizes", "B"), 7, "fingerprint: the message says"),  # descriptor changed
    (("metadata",), 12, "metadata: must be a base64 string"),
])
def test_refusals_name_the_field(path, value, match):
    with pytest.raises(KVABIError, match=match):
        parse_handshake(json.dumps(_mutate(path, value)))


def test_a_parsed_handshake_cannot_change():
    """What the receiver checked stays checked: the handshake is frozen and its planes
    (the bounds every later pull trusts) are read-only."""
    import attrs

    h = parse_handshake(json.dumps(message()))
    with pytest.raises(ValueError, match="read-only"):
        h.planes[0, 1] = 1 << 40
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        h.planes = np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError):
        h.planes.flags.writeable = True  # the array owns its memory, but not this flag
    assert list(h.plane_nbytes) == [LAYOUT.plane_nbytes] * 2


def test_newer_minor_may_add_fields():
    d = message(kvabi_abi=[WIRE_VERSION[0], WIRE_VERSION[1] + 1], future_field={"x": 1})
    assert parse_handshake(json.dumps(d)).abi == (WIRE_VERSION[0], WIRE_VERSION[1] + 1)


def test_hostile_text():
    text = json.dumps(message())
    with pytest.raises(KVABIError, match="duplicate key"):
        parse_handshake(text[:-1] + ', "memory": "VRAM"}')
    with pytest.raises(KVABIError, match="nested"):
        parse_handshake("[" * 100 + "]" * 100)
    with pytest.raises(KVABIError, match="limit"):
        parse_handshake(b" " * (MAX_HANDSHAKE_BYTES + 1))
    with pytest.raises(KVABIError, match="UTF-8"):
        parse_handshake(b"\xff" + text.encode())
    with pytest.raises(KVABIError, match="must be a JSON object"):
        parse_handshake("[]")


def test_missing_nixl_is_a_clear_error(monkeypatch):
    from kvabi.transfer import nixl as kv_nixl

    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(KVABIError, match=r"nixl is not installed: pip install 'kvabi\[nixl\]'"):
        kv_nixl.NixlAgent("a")
    assert kv_nixl.available() == (False, kv_nixl.INSTALL_HINT)
