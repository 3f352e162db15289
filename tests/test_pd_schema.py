"""The P/D messages' normative JSON Schemas (specs/pd.*.schema.json) agree with kvabi.pd's
readers: what one accepts the other accepts, except for the rules each schema's description
lists as beyond a schema (checked here by direct formulas, never by the reader)."""
import copy
import json
import pathlib
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvabi import KVABIError
from kvabi.pd import ASK
from kvabi.pd.notify import parse_notification
from kvabi.pd.record import LIVE, RELEASED, GrantRecord, PartClaim, decode, encode

jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")
SPECS = pathlib.Path(__file__).resolve().parents[1] / "specs"


def _validator(name):
    schema = json.loads((SPECS / name).read_text())
    base = schema["$id"].rsplit("/", 1)[0]
    registry = referencing.Registry()
    for other in ("transfer.schema.json", "layout.schema.json"):
        registry = registry.with_resource(f"{base}/{other}", referencing.Resource.from_contents(
            json.loads((SPECS / other).read_text())))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_the_ask_is_the_schemas():
    v = _validator("pd.ask.schema.json")
    assert v.is_valid(ASK) and v.is_valid({"do_remote_decode": True, "kvabi_host": None})
    for bad in ({}, {"do_remote_decode": "true"}, {"do_remote_decode": True,
                                                   "do_remote_prefill": True}, [ASK]):
        assert not v.is_valid(bad), bad


# -- the answer -----------------------------------------------------------------------------
def _honest():
    from test_pd_params import honest

    return honest()


def _reads(p) -> bool:
    from test_pd_params import PROMPT, reader

    try:
        reader().read(p, PROMPT)
    except KVABIError:
        return False
    return True


#: (what changes, schema accepts, reader accepts): the reader refuses more where the
#: schema's description says so (prompt length, group count, block counts, ids twice, handshakes)
CASES = [
    (lambda p: None, True, True),
    (lambda p: p.pop("kvabi_pd"), False, False),
    (lambda p: p.update(kvabi_pd=[2, 0]), False, False),
    (lambda p: p.update(kvabi_pd=[1, 3], extra_field=1), True, True),
    (lambda p: p.pop("kvabi_grant"), False, False),
    (lambda p: p["kvabi_grant"].update(nonce="AB" * 16), False, False),
    (lambda p: p["kvabi_grant"].update(extra=1), False, False),
    (lambda p: p["kvabi_grant"].update(slot=-1), False, False),
    (lambda p: p.update(remote_num_tokens=0), False, False),
    (lambda p: p.update(remote_num_tokens=True), False, False),
    (lambda p: p["remote_block_ids"][0].__setitem__(0, -2), False, False),
    (lambda p: p["remote_block_ids"][0].__setitem__(0, 1.5), False, False),
    (lambda p: p.update(kvabi_handshakes=[{}]), False, False),
    (lambda p: p.update(kvabi_handshakes=[{"x" * 33: p["kvabi_grants"]}]), False, False),
    (lambda p: p["kvabi_handshakes"][0].update(kv=[]), False, False),
    (lambda p: p.update(kvabi_grants=5), False, False),
    # beyond a schema
    (lambda p: p.update(remote_num_tokens=71), True, False),            # the prompt's length
    (lambda p: p["remote_block_ids"][0].pop(), True, False),            # ceil(n / bs) ids
    (lambda p: p["remote_block_ids"][0].__setitem__(1, 5), True, False),  # an id twice
    (lambda p: p["remote_block_ids"].append([1, 2, 3]), True, False),   # the group count
    (lambda p: p["kvabi_handshakes"][0].update(kv="{}"), True, False),  # a handshake
    (lambda p: p.update(kvabi_grants=p["kvabi_handshakes"][0]["kv"]), True, False),  # a table
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_answer_schema_and_the_reader_agree(i):
    edit, schema_ok, reader_ok = CASES[i]
    p = copy.deepcopy(_honest())
    edit(p)
    assert _validator("pd.params.schema.json").is_valid(p) == schema_ok
    assert _reads(p) == reader_ok


# -- notifications ----------------------------------------------------------------------------
NOTE = _validator("pd.notification.schema.json")
_text = st.one_of(
    st.text(alphabet="kvabi.pul:0123456789abcdefAB/ \n-", max_size=60),
    st.builds(lambda s, n, r, z: f"kvabi.pull:{s}:{n}:{r}/{z}",
              st.sampled_from(["0", "7", "007", "1234567890", "-1", ""]),
              st.sampled_from(["ab" * 16, "AB" * 16, "a" * 31, "g" * 32]),
              st.integers(0, 70).map(str), st.sampled_from(["1", "2", "64", "65", "0", "x"])))


@given(_text)
def test_a_notification_is_what_the_schema_says_and_rank_below_size_at_most_64(text):
    beyond = (lambda m: m is not None and int(m[1]) < int(m[2]) <= 64)(
        re.search(r":([0-9]+)/([0-9]+)$", text))
    want = NOTE.is_valid(text) and beyond
    assert (parse_notification(text.encode()) is not None) == want, text


# -- records -----------------------------------------------------------------------------------
@given(st.integers(0, 20), st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3)),
                                    min_size=0, max_size=3), st.sampled_from([LIVE, RELEASED]))
def test_a_decoded_record_is_the_schemas(tokens, groups, state):
    rng = np.random.default_rng(tokens)
    rec = GrantRecord(state, bytes(range(16)), tokens, b"t" * 16,
                      tuple(rng.integers(-1, 99, size=3) for _ in groups),
                      tuple(tuple(PartClaim(f"p{j}", b"a" * 16, b"b" * 16, b"c" * 16, b"d" * 16)
                                  for j in range(parts)) for _, parts in groups),
                      tuple(rng.integers(0, 2**32, size=(tokens, h)).astype(np.uint32)
                            for h, _ in groups))
    got = decode(np.frombuffer(encode(rec), np.uint8)).to_json()
    _validator("pd.record.schema.json").validate(got)
    assert got["groups"] == rec.to_json()["groups"]
