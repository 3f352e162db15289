"""The handshake parser and its normative JSON Schema (specs/transfer.schema.json) agree:
one corpus of accepted and refused messages, and random mutations of a valid message, are
judged by both.  Where the parser refuses more, it is for a rule the schema's description
lists as beyond a schema (integers written as 4.0, sizes against the layout, base64, int64),
checked here by a direct formula."""
from __future__ import annotations

import base64
import copy
import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvabi import WIRE_VERSION, KVABIError, KVSpec
from kvabi.layout.descriptor import Layout
from kvabi.transfer.handshake import MAX_ADDRESS, make_handshake, parse_handshake

jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")

SPECS = pathlib.Path(__file__).parent.parent / "specs"
SCHEMA = json.loads((SPECS / "transfer.schema.json").read_text())
SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
LAYOUT = Layout.preset("flashinfer.HND", SPEC, 6, 2)
PLANE = LAYOUT.plane_nbytes
INT64_MAX = 2**63 - 1


def _validator():
    layout_schema = json.loads((SPECS / "layout.schema.json").read_text())
    uri = SCHEMA["$id"].rsplit("/", 1)[0] + "/layout.schema.json"  # the $ref, resolved
    registry = referencing.Registry().with_resource(
        uri, referencing.Resource.from_contents(layout_schema))
    return jsonschema.Draft202012Validator(SCHEMA, registry=registry)


VALIDATOR = _validator()


def valid() -> dict:
    planes = [(4096 * (i + 1) << 20, PLANE, 0) for i in range(2)]
    return json.loads(make_handshake(agent_name="prefill-0", host="127.0.0.1", port=5600,
                                     memory="DRAM", layout=LAYOUT, planes=planes,
                                     metadata=b"\x00agent-md"))


def edit(*changes) -> dict:
    """``valid()`` with ``(path, value)`` changes; value ``...`` deletes the key."""
    d = valid()
    for path, value in changes:
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        if value is ...:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    return d


def parser_accepts(d) -> bool:
    try:
        parse_handshake(json.dumps(d))
    except KVABIError:
        return False
    return True


def schema_accepts(d) -> bool:
    return VALIDATOR.is_valid(d)


NEWER = [WIRE_VERSION[0], WIRE_VERSION[1] + 1]

BOTH_ACCEPT = {
    "as sent": valid(),
    "no metadata": edit((("metadata",), ...)),
    "empty metadata": edit((("metadata",), "")),
    "every name character": edit((("agent", "name"), "Az09_.:@-")),
    "128-character name": edit((("agent", "name"), "n" * 128)),
    "IPv6 host": edit((("agent", "host"), "[::1]")),
    "255-character host": edit((("agent", "host"), "h" * 255)),
    "port 1": edit((("agent", "port"), 1)),
    "port 65535": edit((("agent", "port"), 65535)),
    "VRAM, device 65536": edit((("memory",), "VRAM"), (("planes", "device"), 65536)),
    "devices per plane": edit((("planes", "device"), [0, 3])),
    "sizes per plane": edit((("planes", "nbytes"), [PLANE, PLANE + 8])),
    "largest range": edit((("planes", "address"), [1, MAX_ADDRESS - PLANE])),
    "model stated": edit((("model",), "llama-3-8b@4f2a/rev:1+x=y")),
    "newer minor, unknown field": edit((("kvabi_abi",), NEWER), (("future",), {"x": 1})),
    "newer minor, unknown agent field": edit((("kvabi_abi",), NEWER),
                                             (("agent", "zone"), "eu")),
    "newer minor, unknown plane field": edit((("kvabi_abi",), NEWER),
                                             (("planes", "numa"), 0)),
    "a 1.x message (read by a 2.0 reader)": edit((("kvabi_abi",), [1, 2])),
}

BOTH_REFUSE = {
    "name ending in a newline": edit((("agent", "name"), "prefill-0\n")),
    "name starting with a newline": edit((("agent", "name"), "\nprefill-0")),
    "host ending in a newline": edit((("agent", "host"), "127.0.0.1\n")),
    "empty name": edit((("agent", "name"), "")),
    "129-character name": edit((("agent", "name"), "n" * 129)),
    "256-character host": edit((("agent", "host"), "h" * 256)),
    "space in the name": edit((("agent", "name"), "a b")),
    "name not a string": edit((("agent", "name"), 7)),
    "unknown field": edit((("extra",), 1)),
    "unknown agent field": edit((("agent", "zone"), "eu")),
    "unknown plane field": edit((("planes", "numa"), 0)),
    "ABI 1.0 (no handshake then)": edit((("kvabi_abi",), [1, 0])),
    "ABI 3.0": edit((("kvabi_abi",), [3, 0])),
    "ABI 0.9": edit((("kvabi_abi",), [0, 9])),
    "ABI [1]": edit((("kvabi_abi",), [1])),
    "ABI [1, 1, 0]": edit((("kvabi_abi",), [1, 1, 0])),
    "ABI as strings": edit((("kvabi_abi",), ["1", "1"])),
    "ABI minor true": edit((("kvabi_abi",), [1, True])),
    "ABI minor -1": edit((("kvabi_abi",), [1, -1])),
    "metadata null": edit((("metadata",), None)),
    "metadata a number": edit((("metadata",), 12)),
    "message wrong": edit((("message",), "kvabi.transfer.handshake\n")),
    "memory HBM": edit((("memory",), "HBM")),
    "memory in a list": edit((("memory",), ["DRAM"])),
    "port 0": edit((("agent", "port"), 0)),
    "port 65536": edit((("agent", "port"), 65536)),
    "port true": edit((("agent", "port"), True)),
    "port a string": edit((("agent", "port"), "5600")),
    "agent a list": edit((("agent",), ["prefill-0", "127.0.0.1", 5600])),
    "agent without port": edit((("agent", "port"), ...)),
    "no planes": edit((("planes",), ...)),
    "no layout": edit((("layout",), ...)),
    "no kvabi_abi": edit((("kvabi_abi",), ...)),
    "planes a list": edit((("planes",), [{"address": 1, "nbytes": PLANE, "device": 0}])),
    "planes without device": edit((("planes", "device"), ...)),
    "addresses not a list": edit((("planes", "address"), 4096)),
    "address 0": edit((("planes", "address"), [0, 1 << 30])),
    "address past 2^62": edit((("planes", "address"), [MAX_ADDRESS + 1, 1 << 30])),
    "address a string": edit((("planes", "address"), ["4096", 1 << 30])),
    "nbytes 0": edit((("planes", "nbytes"), 0)),
    "nbytes 0 in a list": edit((("planes", "nbytes"), [PLANE, 0])),
    "device -1": edit((("planes", "device"), -1)),
    "device 65537": edit((("planes", "device"), [0, 65537])),
    "device true": edit((("planes", "device"), True)),
    "layout of another dtype": edit((("layout", "dtype"), "float64")),
    "layout a string": edit((("layout",), "flashinfer.HND")),
    "no fingerprint": edit((("fingerprint",), ...)),
    "fingerprint upper case": edit((("fingerprint",), "kv1:" + "A" * 32)),
    "fingerprint a number": edit((("fingerprint",), 12)),
    "model empty": edit((("model",), "")),
    "model with a space": edit((("model",), "llama 3")),
    "model ending in a newline": edit((("model",), "llama\n")),
    "newer minor, metadata null": edit((("kvabi_abi",), NEWER), (("metadata",), None)),
}

#: refused by the parser for a rule the schema's description lists as beyond a schema
BEYOND_SCHEMA = {
    "port written 5600.0": (edit((("agent", "port"), 5600.0)), "4.0"),
    "ABI minor written 1.0": (edit((("kvabi_abi",), [1, 1.0])), "4.0"),
    "plane count": (edit((("planes", "address"), valid()["planes"]["address"][:1])),
                    "plane count"),
    "sizes list of another length": (edit((("planes", "nbytes"), [PLANE] * 3)),
                                     "list whose length is not the plane count"),
    "devices list of another length": (edit((("planes", "device"), [0])),
                                       "list whose length is not the plane count"),
    "plane smaller than the layout's": (edit((("planes", "nbytes"), PLANE - 1)),
                                        "plane_nbytes"),
    "range past 2^62": (edit((("planes", "address"), [1, MAX_ADDRESS - PLANE + 1])), "2^62"),
    "metadata not base64": (edit((("metadata",), "not base64!")), "base64"),
    "fingerprint of another layout": (edit((("fingerprint",), "kv1:" + "0" * 32)),
                                      "fingerprint other than"),
}


@pytest.mark.parametrize("name", BOTH_ACCEPT)
def test_both_accept(name):
    d = BOTH_ACCEPT[name]
    assert schema_accepts(d) and parser_accepts(d)


@pytest.mark.parametrize("name", BOTH_REFUSE)
def test_both_refuse(name):
    d = BOTH_REFUSE[name]
    assert not schema_accepts(d), "the schema accepts it"
    assert not parser_accepts(d), "the parser accepts it"


@pytest.mark.parametrize("name", BEYOND_SCHEMA)
def test_beyond_the_schema_and_said_so(name):
    d, said = BEYOND_SCHEMA[name]
    assert schema_accepts(d) and not parser_accepts(d)
    assert said in SCHEMA["description"]


# -- random mutations ------------------------------------------------------------------

_TEXT = st.text(st.sampled_from("aZ09_.:@-[]/ \n\x00é"), max_size=6)
_INTS = st.one_of(st.sampled_from([0, 1, -1, 65535, 65536, 65537, PLANE - 1, PLANE,
                                   MAX_ADDRESS, MAX_ADDRESS + 1, INT64_MAX, INT64_MAX + 1]),
                  st.integers(-2**64, 2**64))
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, _TEXT,
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.sampled_from([5600.0, 1.0, 0.5, "DRAM", "VRAM", "AAAA",
                                      "kvabi.transfer.handshake"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)), max_leaves=6)
_PATHS = [("kvabi_abi",), ("kvabi_abi", 0), ("kvabi_abi", 1), ("message",), ("agent",),
          ("agent", "name"), ("agent", "host"), ("agent", "port"), ("memory",), ("layout",),
          ("planes",), ("metadata",), ("fingerprint",), ("model",)] + [
          ("planes", k) for k in ("address", "nbytes", "device")] + [
          ("planes", k, i) for i in (0, 1) for k in ("address", "nbytes", "device")]
_HOMES = [(), ("agent",), ("planes",)]


@st.composite
def mutated(draw):
    d = valid()
    if draw(st.booleans()):
        d["kvabi_abi"] = draw(st.sampled_from([[1, 0], [1, 1], [1, 2], [1, 3], [2, 0],
                                               [2, 1], [3, 0]]))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "delete", "add"]))
        path = draw(st.sampled_from(_HOMES if op == "add" else _PATHS))
        obj = d
        try:
            for k in path[:-1] if op != "add" else path:
                obj = obj[k]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier op removed or replaced the parent
        if op == "add":
            if isinstance(obj, dict):
                obj[draw(_TEXT)] = draw(_VALUES)
            continue
        key = path[-1]
        if isinstance(obj, dict) or (isinstance(obj, list) and isinstance(key, int)
                                     and key < len(obj)):
            if op == "delete" and isinstance(obj, dict):
                obj.pop(key, None)
            elif op == "set":
                obj[key] = draw(_VALUES)
    return d


def _int_positions(d):
    """The values at the places the parser reads as integers (where present)."""
    out = []
    if isinstance(d.get("kvabi_abi"), list):
        out += d["kvabi_abi"]
    if isinstance(d.get("agent"), dict):
        out.append(d["agent"].get("port"))
    p = d.get("planes")
    if isinstance(p, dict):
        for k in ("address", "nbytes", "device"):
            v = p.get(k)
            out += v if isinstance(v, list) else [v]
    return out


def _all_ints(v):
    if isinstance(v, dict):
        return [i for x in v.values() for i in _all_ints(x)]
    if isinstance(v, list):
        return [i for x in v for i in _all_ints(x)]
    return [v] if isinstance(v, int) and not isinstance(v, bool) else []


def beyond_schema(d) -> bool:
    """Whether a message the schema accepts breaks one of the rules its description lists
    as beyond a schema (direct formulas, not the parser)."""
    if any(isinstance(v, float) for v in _int_positions(d)):
        return True  # 4.0 is an integer to JSON Schema, not to kvabi
    if any(abs(v) > INT64_MAX for v in _all_ints(d)):
        return True  # the strict JSON reader's int64 bound, on every number
    p = d["planes"]
    n = len(p["address"])
    if n != LAYOUT.num_planes:
        return True
    per = {k: p[k] if isinstance(p[k], list) else [p[k]] * n for k in ("nbytes", "device")}
    if any(len(v) != n for v in per.values()):
        return True
    for a, nb in zip(p["address"], per["nbytes"]):
        if nb < PLANE or a + nb > MAX_ADDRESS:
            return True
    if "metadata" in d:
        try:
            base64.b64decode(d["metadata"], validate=True)
        except ValueError:
            return True
    try:  # the fingerprint must be the descriptor's own (layout.md)
        return d["fingerprint"] != Layout.from_json(d["layout"]).fingerprint()
    except KVABIError:
        return False


#: cheap (a few ms an example): 625 in the ci profile, 10,000 in thorough
@settings(max_examples=25 * settings().max_examples)
@given(mutated())
def test_parser_and_schema_agree_on_mutations(d):
    d = json.loads(json.dumps(d))  # what a receiver would read
    schema_ok = schema_accepts(d)
    want = schema_ok and not beyond_schema(copy.deepcopy(d))
    assert parser_accepts(d) == want, (schema_ok, d)


def test_the_schema_closes_the_readers_own_minor():
    """Messages of the reader's own minor are closed in the schema as in the parser: the
    schema's bound moves with WIRE_VERSION (a minor bump that forgets it fails here)."""
    from kvabi import WIRE_VERSION

    bound = SCHEMA["if"]["properties"]["kvabi_abi"]["anyOf"][1]["prefixItems"][1]["maximum"]
    assert bound == WIRE_VERSION[1]



@pytest.mark.parametrize("name", ["vllm.fp8_per_token_head", "flashinfer.HND.fp8_scale_plane",
                                  "vllm.cpu"])
def test_component_layouts_travel_in_the_handshake(name):
    """A 2.0 component descriptor (scales, planes of different sizes) is carried, accepted
    by parser and schema alike, and read back equal; a plane smaller than its own size is
    refused by the parser (a rule beyond the schema)."""
    lay = Layout.preset(name, SPEC, 6, 2)
    planes = [(4096 * (i + 1) << 20, n, 0) for i, n in enumerate(lay.plane_sizes)]
    msg = json.loads(make_handshake(agent_name="prefill-0", host="127.0.0.1", port=5600,
                                    memory="DRAM", layout=lay, planes=planes))
    VALIDATOR.validate(msg)
    assert parse_handshake(json.dumps(msg)).layout == lay
    assert msg["layout"]["kvabi_abi"] == [2, 0] and "components" in msg["layout"]
    msg["planes"]["nbytes"] = [*lay.plane_sizes[:-1], lay.plane_sizes[-1] - 1]
    VALIDATOR.validate(msg)
    with pytest.raises(KVABIError, match=rf"^planes\.nbytes: plane {len(planes) - 1} "):
        parse_handshake(json.dumps(msg))
