"""Grants without an engine: a record survives its encoding; any bytes a peer serves decode
to a record or a KVABIError; only a notification naming a live grant's slot and nonce
releases it, once; grants expire; per-token checksums follow their formula and see a
swapped, shifted or transposed element."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvabi import KVABIError

from kvabi_vllm.connector_checksum import token_checksums
from kvabi_vllm.connector_grants import (EXPIRED, HEADER, LIVE, RELEASED, GrantBook,
                                         GrantRecord, GrantTable, PartClaim, decode, encode,
                                         notify_message, parse_notification, read_header,
                                         record_bytes)


def _record(nonce=b"n" * 16, tokens=70, groups=2):
    rng = np.random.default_rng(tokens)
    return GrantRecord(LIVE, nonce, tokens, b"t" * 16,
                       tuple(rng.integers(1, 99, size=3) for _ in range(groups)),
                       tuple((PartClaim("k", b"a" * 16, b"b" * 16),
                              PartClaim("image.kt_v.n32.d32", b"c" * 16, b"d" * 16))
                             for _ in range(groups)),
                       tuple(rng.integers(0, 2**32, size=tokens).astype(np.uint32)
                             for _ in range(groups)))


def test_record_round_trip():
    rec = _record()
    got = decode(np.frombuffer(encode(rec), np.uint8))
    assert (got.state, got.nonce, got.num_tokens, got.tokens) == (LIVE, rec.nonce, 70, rec.tokens)
    assert all(np.array_equal(a, b) for a, b in zip(got.blocks, rec.blocks))
    assert got.parts == rec.parts
    assert all(np.array_equal(a, b) for a, b in zip(got.checksums, rec.checksums))
    assert len(encode(rec)) <= record_bytes(2, 70, 32)


@given(st.data())
def test_any_bytes_decode_or_are_refused(data):
    """What a peer serves is untrusted: flipped bytes, truncation, garbage."""
    raw = bytearray(encode(_record(tokens=data.draw(st.integers(0, 40)))))
    how = data.draw(st.sampled_from(["flip", "cut", "garbage", "counts"]))
    if how == "flip":
        for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
            raw[i] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    elif how == "garbage":
        raw = bytearray(raw[:8]) + bytearray(data.draw(st.binary(max_size=300)))
    else:  # a body whose counts lie, with a matching digest (a lying producer)
        import hashlib
        import struct

        body = bytearray(raw[HEADER:])
        struct.pack_into("<I", body, 24, data.draw(st.integers(0, 2**32 - 1)))
        raw[32:48] = hashlib.blake2b(bytes(body), digest_size=16).digest()
        raw = raw[:HEADER] + body
    try:
        rec = decode(np.frombuffer(bytes(raw), np.uint8))
    except KVABIError as e:
        assert str(e).startswith("kvabi_grant: ")
    else:
        assert len(rec.checksums) == len(rec.blocks)


def test_a_record_half_written_does_not_decode():
    raw = bytearray(encode(_record()))
    raw[HEADER + 40] ^= 1  # the body changed after the digest was taken
    with pytest.raises(KVABIError, match="digest does not match"):
        decode(np.frombuffer(bytes(raw), np.uint8))


def test_notifications():
    nonce = bytes(range(16))
    assert parse_notification(notify_message(7, nonce)) == (7, nonce)
    for bad in (b"", b"kvabi.pull", b"kvabi.pull:7", b"kvabi.pull:x:" + b"0" * 32,
                b"kvabi.pull:7:" + b"0" * 31, b"kvabi.pull:-1:" + b"0" * 32,
                b"kvabi.pull:7:" + b"g" * 32, b"\xff\xfe", b"kvabi.pull:" + b"9" * 40 + b":" +
                b"0" * 32):
        assert parse_notification(bad) is None, bad


def test_only_the_live_nonce_releases_a_grant_once_and_grants_expire():
    t = GrantTable(4, record_bytes(2, 70, 32))
    a, b = _record(b"a" * 16), _record(b"b" * 16)
    t.write(1, a, "req-a", deadline=100.0)
    t.write(2, b, "req-b", deadline=200.0)
    assert read_header(t._rows[1]) == (LIVE, b"a" * 16)
    assert read_header(t._rows[0]) is None  # never written
    assert t.release(1, b"b" * 16) is None  # another request's nonce: refused
    assert t.release(3, b"a" * 16) is None  # the right nonce in another slot
    assert t.release(1, b"a" * 16) == "req-a"
    assert t.release(1, b"a" * 16) is None  # a replayed notification
    assert read_header(t._rows[1]) == (RELEASED, b"a" * 16)  # a replayed read learns it
    assert t.expire(now=150.0) == []
    assert t.expire(now=200.0) == ["req-b"]
    assert read_header(t._rows[2]) == (EXPIRED, b"b" * 16) and not t.live


def test_grant_book_bounds_and_reuses_slots():
    book = GrantBook(2)
    s1, n1 = book.issue("a")
    s2, n2 = book.issue("b")
    assert {s1, s2} == {0, 1} and n1 != n2 and len(n1) == 16
    assert book.issue("c") is None and book.issue("a") is None
    book.release("a")
    book.release("zzz")  # unknown: nothing
    s3, _ = book.issue("c")
    assert s3 == s1 and len(book) == 2


def _views(layers, blocks, bs, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(blocks, bs, h, d, generator=g).to(dtype),
             torch.randn(blocks, bs, h, d, generator=g).to(dtype)) for _ in range(layers)]


@pytest.mark.parametrize("dtype,d", [(torch.float32, 8), (torch.float16, 8),
                                     (torch.bfloat16, 8), (torch.float16, 3)])
def test_token_checksums_follow_the_formula(dtype, d):
    """Per token: the 64-bit words of each layer's K and V row (the elements' own width
    where a row is not a whole number of words), times fixed odd weights, summed modulo
    2**64, folded to 32 bits; in views of any strides (keys transposed here)."""
    bs, h, layers = 4, 2, 3
    views = [(k.transpose(1, 3).contiguous().transpose(1, 3), v)
             for k, v in _views(layers, 6, bs, h, d, dtype, 1)]
    slots = np.array([5, -1, 0, 23, 9])
    got = token_checksums(views, slots, bs)
    from kvabi_vllm.connector_checksum import _weights

    row = h * d * torch.tensor([], dtype=dtype).element_size()
    words = row // 8 if row % 8 == 0 else h * d
    w = _weights(layers, words)
    for i, s in enumerate(slots):  # a test oracle: one token at a time, Python integers
        if s < 0:
            assert got[i] == 0
            continue
        total = 0
        for layer, (k, v) in enumerate(views):
            for kv, x in enumerate((k, v)):
                raw = x[s // bs, s % bs].contiguous().view(torch.uint8).numpy().tobytes()
                if row % 8 == 0:
                    vals = [int.from_bytes(raw[j:j + 8], "little", signed=True)
                            for j in range(0, row, 8)]
                else:
                    isz = row // (h * d)
                    vals = [int.from_bytes(raw[j:j + isz], "little", signed=True)
                            for j in range(0, row, isz)]
                total += sum(a * int(b) for a, b in zip(vals, w[layer, kv]))
        x = total % 2**64
        x = x - 2**64 if x >= 2**63 else x  # as a signed 64-bit word
        assert int(got[i]) == (x ^ (x >> 32)) & 0xFFFFFFFF


def test_token_checksums_see_swaps_shifts_and_transposes():
    bs, h, d = 4, 2, 8
    views = _views(2, 4, bs, h, d, torch.float32, 2)
    slots = np.arange(16)
    base = token_checksums(views, slots, bs)
    swapped = [(v, k) for k, v in views]
    assert (token_checksums(swapped, slots, bs) != base).all()
    shifted = [(k.roll(1, dims=3), v) for k, v in views]
    assert (token_checksums(shifted, slots, bs) != base).all()
    heads = [(k.flip(2), v) for k, v in views]
    assert (token_checksums(heads, slots, bs) != base).all()
    assert (token_checksums(views, np.roll(slots, 1), bs) != base).all()
