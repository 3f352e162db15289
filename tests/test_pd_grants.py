"""Grants without an engine: a record survives its encoding; any bytes a peer serves decode
to a record or a KVABIError; only a notification naming a live grant's slot and nonce
releases it, once, and only once every decode rank has sent one; grants expire; per
(token, head) checksums follow their formula, see a swapped, shifted or transposed
element, and let a rank holding other heads check the heads it holds."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvabi import KVABIError

import kvabi
from kvabi.pd.digests import head_checksums
from kvabi.pd.grants import PENDING, GrantBook, GrantTable
from kvabi.pd.notify import notify_message, parse_notification
from kvabi.pd.record import (EXPIRED, HEADER, LIVE, RELEASED, GrantRecord, PartClaim, decode,
                             encode, read_header, record_bytes)


def _record(nonce=b"n" * 16, tokens=70, groups=2, heads=(2, 1)):
    rng = np.random.default_rng(tokens)
    return GrantRecord(LIVE, nonce, tokens, b"t" * 16,
                       tuple(rng.integers(1, 99, size=3) for _ in range(groups)),
                       tuple((PartClaim("k", b"a" * 16, b"b" * 16, b"s" * 16, b"m" * 16),
                              PartClaim("image.kt_v.n32.d32", b"c" * 16, b"d" * 16, b"e" * 16,
                                        b"f" * 16))
                             for _ in range(groups)),
                       tuple(rng.integers(0, 2**32, size=(tokens, heads[g % len(heads)]))
                             .astype(np.uint32) for g in range(groups)))


def test_record_round_trip():
    rec = _record()
    got = decode(np.frombuffer(encode(rec), np.uint8))
    assert (got.state, got.nonce, got.num_tokens, got.tokens) == (LIVE, rec.nonce, 70, rec.tokens)
    assert all(np.array_equal(a, b) for a, b in zip(got.blocks, rec.blocks))
    assert got.parts == rec.parts
    assert all(np.array_equal(a, b) for a, b in zip(got.checksums, rec.checksums))
    assert all(a.shape == (70, h) for a, h in zip(got.checksums, (2, 1)))
    assert len(encode(rec)) <= record_bytes(2, 70, 32, heads=2)


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
    assert parse_notification(notify_message(7, nonce)) == (7, nonce, 0, 1)
    assert parse_notification(notify_message(7, nonce, 3, 4)) == (7, nonce, 3, 4)
    z = b"0" * 32
    for bad in (b"", b"kvabi.pull", b"kvabi.pull:7", b"kvabi.pull:x:" + z + b":0/1",
                b"kvabi.pull:7:" + b"0" * 31 + b":0/1", b"kvabi.pull:-1:" + z + b":0/1",
                b"kvabi.pull:7:" + b"g" * 32 + b":0/1", b"\xff\xfe",
                b"kvabi.pull:" + b"9" * 40 + b":" + z + b":0/1",
                b"kvabi.pull:7:" + z,  # no decode rank
                b"kvabi.pull:7:" + z + b":2/2", b"kvabi.pull:7:" + z + b":0/0",
                b"kvabi.pull:7:" + z + b":0/65", b"kvabi.pull:7:" + z + b":-1/2",
                b"kvabi.pull:7:" + z + b":0/1:x", b"kvabi.pull:7:" + z + b":01",
                b"kvabi.pull:7:" + b"AB" * 16 + b":0/1",  # the nonce in lowercase only
                b"kvabi.pull:7:" + z + b":0/1\n", b" kvabi.pull:7:" + z + b":0/1"):
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


def test_a_grant_read_by_several_decode_ranks_is_released_once_all_are_done():
    t = GrantTable(4, record_bytes(2, 70, 32, heads=2))
    t.write(0, _record(b"a" * 16), "req-a", deadline=100.0)
    assert t.release(0, b"a" * 16, 1, 2) is PENDING
    assert t.release(0, b"a" * 16, 1, 2) is PENDING  # the same rank again: still one
    assert t.release(0, b"b" * 16, 0, 2) is None      # another nonce counts for nothing
    assert t.release(0, b"a" * 16, 0, 3) is None      # another size than the first's
    assert read_header(t._rows[0]) == (LIVE, b"a" * 16)
    assert t.release(0, b"a" * 16, 0, 2) == "req-a"
    assert t.release(0, b"a" * 16, 0, 2) is None and not t.live
    # a slot written again starts counting afresh
    t.write(0, _record(b"c" * 16), "req-c", deadline=100.0)
    assert t.release(0, b"c" * 16, 0, 2) is PENDING
    assert t.expire(now=100.0) == ["req-c"] and t.release(0, b"c" * 16, 1, 2) is None


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


M64 = 2**64


def _mix(x):
    """splitmix64 of a Python integer (the published constants): the weights' source."""
    x = (x + 0x9E3779B97F4A7C15) % M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % M64
    return x ^ (x >> 31)


def _cache(layers, blocks, bs, h, d, dtype, seed, shard=None):
    spec = kvabi.KVSpec("full", block_size=bs, num_kv_heads=h, head_dim=d, dtype=dtype)
    lay = kvabi.Layout.preset("vllm.LBHNC", spec, num_blocks=blocks, num_layers=layers)
    if shard is not None:
        import attrs

        lay = attrs.evolve(lay, shard=shard)
    c = kvabi.KVCache.allocate(lay, "torch")
    g = torch.Generator().manual_seed(seed)
    for p in c:
        p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return c


@pytest.mark.parametrize("dtype,d", [("float32", 8), ("float16", 8), ("bfloat16", 8),
                                     ("float16", 3)])
def test_head_checksums_follow_the_formula(dtype, d):
    """Per token and head: the head's 32-bit words (bytes where its row is not a whole
    number of words) of each layer's K and V, times odd splitmix64 weights of (layer, K/V,
    word), summed modulo 2**64, folded to 32 bits; 0 where the slot is -1."""
    bs, h, layers = 4, 2, 3
    c = _cache(layers, 6, bs, h, d, dtype, 1)
    slots = np.array([5, -1, 0, 23, 9])
    got = head_checksums(c, slots)
    assert got.shape == (5, h) and got.dtype == np.uint32
    row = d * c.layout.itemsize
    wb = 4 if row % 4 == 0 else 1
    words = row // wb
    for i, s in enumerate(slots):  # a test oracle: one token and head at a time, integers
        for head in range(h):
            if s < 0:
                assert got[i, head] == 0
                continue
            total = 0
            for layer in range(layers):
                for kv in range(2):
                    x = c.kv_view(layer, kv)[s // bs, s % bs, head]
                    raw = x.contiguous().view(torch.uint8).numpy().tobytes()
                    base = (layer * 2 + kv) * words
                    total += sum(int.from_bytes(raw[j * wb:(j + 1) * wb], "little") *
                                 (_mix(base + j) | 1) for j in range(words))
            x = total % M64
            assert int(got[i, head]) == (x ^ (x >> 32)) & 0xFFFFFFFF


def test_head_checksums_see_swaps_shifts_and_transposes():
    bs, h, d = 4, 2, 8
    c = _cache(2, 4, bs, h, d, "float32", 2)
    slots = np.arange(16)
    base = head_checksums(c, slots)

    def edited(edit):
        e = _cache(2, 4, bs, h, d, "float32", 2)
        for layer in range(2):
            k, v = e.kv_view(layer, 0), e.kv_view(layer, 1)
            edit(k, v)
        return head_checksums(e, slots)

    def swap(k, v):
        t = k.clone()
        k.copy_(v)
        v.copy_(t)
    assert (edited(swap) != base).all()
    assert (edited(lambda k, v: k.copy_(k.roll(1, dims=3))) != base).all()
    assert (edited(lambda k, v: k.copy_(k.flip(2))) != base).all()
    assert (head_checksums(c, np.roll(slots, 1)) != base).all()


def test_a_rank_holding_other_heads_checks_the_heads_it_holds():
    """The checksums of two TP-2 shards (one KV head each, copied from a whole cache) are
    the whole cache's columns of their global heads: a decode rank compares by global
    head, whatever split the producer had."""
    from kvabi import Shard

    bs, d = 8, 16
    whole = _cache(3, 5, bs, 2, d, "float32", 3)
    slots = np.array([3, 17, 8, 39, 0])
    want = head_checksums(whole, slots)
    for rank in range(2):
        part = _cache(3, 5, bs, 1, d, "float32", 9, shard=Shard.tp(rank, 2, 2))
        for layer in range(3):
            for kv in range(2):
                part.kv_view(layer, kv).copy_(whole.kv_view(layer, kv)[:, :, rank:rank + 1])
        got = head_checksums(part, slots)
        assert np.array_equal(got[:, 0], want[:, rank])
        assert not np.array_equal(got[:, 0], want[:, 1 - rank])
