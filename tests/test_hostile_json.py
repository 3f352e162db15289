"""The strict JSON reader (kvabi.util.safe_json): what it refuses, and that on everything else it
agrees with the standard library's json.loads (the oracle)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from kvabi import KVABIError
from kvabi.util.safe_json import MAX_BYTES, MAX_DEPTH, loads, nesting_depth


@pytest.mark.parametrize("data,match", [
    ("[" * 100_000 + "]" * 100_000, "nested 100000 deep, more than the limit of 64"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nested 65 deep"),
    ('{"dtype": "float32", "dtype": "int8"}', "duplicate key 'dtype'"),
    ('{"a": {"b": 1, "b": 1}}', "duplicate key 'b'"),
    (b'{"a": "\xff"}', r"not UTF-8 \(byte 0xff at offset 7\)"),
    (b'\xef\xbb\xbf{}', "byte-order mark"),
    ('[NaN]', "NaN is not a JSON value"), ('[Infinity]', "Infinity"),
    ('[-Infinity]', "-Infinity"), ('[1e999]', "overflows"),
    ("[9223372036854775808]", "beyond"), ("[-9223372036854775809]", "beyond"),
    ("[" + "9" * 100_000 + "]", "beyond"),
    ("{", "not valid JSON"), ("", "not valid JSON"), ('{"a": 1} x', "not valid JSON"),
    (42, "must be JSON text"), (None, "must be JSON text"),
])
def test_refusals_name_the_document(data, match):
    with pytest.raises(KVABIError, match="^doc: .*" + match):
        loads(data, what="doc")


def test_size_limit_is_checked_before_parsing():
    assert loads("[1]", what="doc", max_bytes=3) == [1]
    with pytest.raises(KVABIError, match="^doc: .*limit of 2"):
        loads("[1]", what="doc", max_bytes=2)
    with pytest.raises(KVABIError, match="^doc: 4 bytes, more than the limit of 3"):
        loads(b'"\xc3\xa9"', what="doc", max_bytes=3)
    with pytest.raises(KVABIError, match="limit of 3"):  # 2 characters, 4 bytes
        loads('"\u00e9"', what="doc", max_bytes=3)
    assert MAX_BYTES == 16 * 2**20 and MAX_DEPTH == 64


def test_int64_edges_are_exact_and_max_int_is_a_choice():
    assert loads("[9223372036854775807, -9223372036854775807]", what="d") == \
        [2**63 - 1, -(2**63 - 1)]
    assert loads("[18446744073709551616]", what="d", max_int=None) == [2**64]


def test_depth_limit_is_inclusive_and_strings_do_not_count():
    assert loads("[" * 64 + "]" * 64, what="d") == json.loads("[" * 64 + "]" * 64)
    assert loads('{"a": "[[[[{{{{"}', what="d", max_depth=1) == {"a": "[[[[{{{{"}
    assert loads('["\\"[[["]', what="d", max_depth=1) == ['"[[[']


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63 + 1, 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=30)


def depth_of(v) -> int:
    """Nesting depth, by recursion over the value (independent of the text scan)."""
    if isinstance(v, list):
        return 1 + max((depth_of(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((depth_of(x) for x in v.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 1]), ascii_=st.booleans())
def test_agrees_with_json_loads_on_valid_documents(value, indent, ascii_):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_)
    assert nesting_depth(text) == depth_of(value)
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from st.text(): not UTF-8 as bytes
        raw = None
    assert loads(text, what="doc") == json.loads(text)
    if raw is not None:
        assert loads(raw, what="doc") == json.loads(text)


def test_no_recursion_error_even_when_the_depth_limit_is_lifted():
    with pytest.raises(KVABIError, match="^doc: nested too deep for the parser"):
        loads("[" * 200_000 + "]" * 200_000, what="doc", max_depth=10**9)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="0123456789-e.\"[], a\\", max_size=60))
def test_longest_digit_run_against_a_regex(text):
    import re

    import numpy as np

    from kvabi.util.safe_json import longest_digit_run
    want = max((len(m) for m in re.findall("[0-9]+", text)), default=0)
    assert longest_digit_run(np.frombuffer(text.encode(), np.uint8)) == want


@pytest.mark.parametrize("doc,max_int,ok", [
    ("[999, -999]", 999, True), ("[1000]", 999, False), ("[-1000]", 999, False),
    ('["12345678901234567890", 5]', 999, True),  # a long digit run in a string: checked path
    ("[9223372036854775808]", None, True), ("[9223372036854775808]", 2**63 - 1, False),
    ("[" + "9" * 18 + "]", 2**63 - 1, True)])
def test_integer_bounds_with_and_without_long_digit_runs(doc, max_int, ok):
    if ok:
        assert loads(doc, what="d", max_int=max_int) == json.loads(doc)
    else:
        with pytest.raises(KVABIError, match="^d: integer .* is beyond"):
            loads(doc, what="d", max_int=max_int)
