"""``kv_transfer_params`` as a hostile client sends them: every malformed value is refused
with a KVABIError naming the field (never another exception), at the decode engine's
scheduler side, before anything is pulled; honest parameters (and a decode prompt that
extends the prefilled one) are accepted."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvabi
from kvabi import KVABIError
from kvabi.transfer.handshake import make_handshake

from kvabi.pd.digests import tokens_digest
from kvabi.pd.params import ParamsReader
from kvabi.pd.record import table_layout
from json_edit import DELETE, edited

BS, BLOCKS, N = 32, 64, 70   # the producer's block size and blocks; tokens prefilled
PROMPT = list(range(1000, 1000 + N))


def _msg(layout, address=1 << 20):
    return make_handshake(agent_name="producer", host="127.0.0.1", port=5555, memory="DRAM",
                          layout=layout, planes=[(address + i * (1 << 30), layout.plane_nbytes, 0)
                                                 for i in range(layout.num_planes)])


SPEC = kvabi.KVSpec("full", block_size=BS, num_kv_heads=2, head_dim=32, dtype="float32")
KV = _msg(kvabi.Layout.preset("vllm.LBHNC", SPEC, num_blocks=BLOCKS, num_layers=2))
GRANTS = _msg(table_layout(8, 4096))


def honest(groups=1):
    return {"kvabi_pd": [1, 0], "do_remote_prefill": True, "do_remote_decode": False,
            "remote_num_tokens": N, "remote_block_ids": [[5, 9, 12]] * groups,
            "remote_engine_id": "p", "remote_request_id": "r0",
            "kvabi_handshakes": [{"kv": KV}] * groups, "kvabi_grants": GRANTS,
            "kvabi_grant": {"slot": 3, "nonce": "ab" * 16}}


def reader(windows=(None,)):
    return ParamsReader(consumer=True, windows=windows)


def test_honest_params_are_read():
    e = reader().read(honest(), PROMPT)
    r = e.remote
    assert r.num_tokens == N and r.slot == 3 and r.nonce == bytes.fromhex("ab" * 16)
    assert r.blocks[0].tolist() == [5, 9, 12] and r.block_size == BS
    assert r.tokens == tokens_digest(PROMPT)
    with pytest.raises(ValueError):  # read-only: the worker trusts what was checked
        r.blocks[0][0] = 1


def test_a_longer_decode_prompt_pulls_the_prefilled_prefix():
    e = reader().read(honest(), PROMPT + [1, 2, 3])
    assert e.remote.num_tokens == N and e.remote.tokens == tokens_digest(PROMPT)


def test_no_params_or_other_roles():
    plain = reader().read(None, PROMPT)
    assert plain.remote is None and plain.host and not plain.remote_decode
    assert ParamsReader(consumer=False, windows=(None,)).read(honest(), PROMPT).remote is None
    assert reader().read({"kvabi_host": False}, PROMPT).host is False
    assert reader().read({"do_remote_decode": True}, PROMPT).remote_decode is True


def _set(p, path, value):
    return edited(p, path, value)


_DEL = DELETE
NEGATIVE = [
    # (what the client sent, the field the refusal names)
    (("kvabi_pd",), _DEL, "kvabi_pd: missing"),
    (("kvabi_pd",), [2, 0], r"kvabi_pd: protocol 2.0, this engine reads major 1"),
    (("kvabi_pd",), [1], r"kvabi_pd: must be \[major, minor\]"),
    (("kvabi_pd",), [1, True], r"kvabi_pd: must be \[major, minor\]"),
    (("kvabi_pd",), "1.0", r"kvabi_pd: must be \[major, minor\]"),
    (("kvabi_pd",), [1, 7], None),  # a newer minor: read
    (("remote_num_tokens",), _DEL, "remote_num_tokens: missing"),
    (("kvabi_grant",), _DEL, "kvabi_grant: missing"),
    (("remote_num_tokens",), "70", "remote_num_tokens: must be an integer"),
    (("remote_num_tokens",), 70.0, "remote_num_tokens: must be an integer"),
    (("remote_num_tokens",), True, "remote_num_tokens: must be an integer"),
    (("remote_num_tokens",), 0, "remote_num_tokens: must be >= 1"),
    (("remote_num_tokens",), N + 1, "remote_num_tokens: 71 exceeds this request's prompt"),
    (("do_remote_prefill",), "yes", "do_remote_prefill: must be true or false"),
    (("kvabi_host",), 0, "kvabi_host: must be true or false"),
    (("remote_block_ids",), [], r"remote_block_ids: must list 1 KV cache groups, got 0"),
    (("remote_block_ids",), {"0": [5]}, "remote_block_ids: must list 1 KV cache groups"),
    (("remote_block_ids",), [[[5, 9, 12]]], r"remote_block_ids\[0\]: must list the 3 blocks"),
    (("remote_block_ids", 0), [], r"remote_block_ids\[0\]: must list the 3 blocks .* got 0"),
    (("remote_block_ids", 0), [5, 9], r"remote_block_ids\[0\]: must list the 3 blocks .* got 2"),
    (("remote_block_ids", 0), [5, 9, None], r"remote_block_ids\[0\]\[2\]: must be an integer"),
    (("remote_block_ids", 0), [5, 9, -1], r"remote_block_ids\[0\]\[2\]: the null block"),
    (("remote_block_ids", 0), [5, 9, 9], r"remote_block_ids\[0\]: block 9 appears twice"),
    (("remote_block_ids", 0), [5, 9, -2], r"remote_block_ids\[0\]\[2\]: must be >= 0"),
    (("remote_block_ids", 0), [5, 0, 9], None),  # block 0 is a block like any other
    (("remote_block_ids", 0), [5, 9, BLOCKS], r"remote_block_ids\[0\]\[2\]: must be <= 63"),
    (("remote_block_ids", 0), [5, 9, 2**64 + 12], r"remote_block_ids\[0\]\[2\]: must be <= 63"),
    (("remote_block_ids", 0), [5, 9, 1.0], r"remote_block_ids\[0\]\[2\]: must be an integer"),
    (("kvabi_handshakes",), [], "kvabi_handshakes: must list 1 KV cache groups"),
    (("kvabi_handshakes",), "x", "kvabi_handshakes: must list 1 KV cache groups"),
    (("kvabi_handshakes", 0), {}, r"kvabi_handshakes\[0\]: must be an object of 1 to 8"),
    (("kvabi_handshakes", 0), [KV], r"kvabi_handshakes\[0\]: must be an object"),
    (("kvabi_handshakes", 0), {"kv": {"kvabi_abi": [1, 1]}},
     r"kvabi_handshakes\[0\].kv: must be a handshake message"),
    (("kvabi_handshakes", 0), {"kv": "{}"}, r"kvabi_handshakes\[0\].kv: "),
    (("kvabi_handshakes", 0), {"image.kv_packed.n32.d32": KV},
     r"kvabi_handshakes\[0\]: the producer serves no token layout"),
    (("kvabi_grants",), KV, "kvabi_grants: not a grant table"),
    (("kvabi_grants",), 5, "kvabi_grants: must be a handshake message"),
    (("kvabi_grant",), "3:abab", "kvabi_grant: must be an object of exactly slot and nonce"),
    (("kvabi_grant", "slot"), 8, "kvabi_grant.slot: 8 is beyond the producer's 8 grant slots"),
    (("kvabi_grant", "slot"), "3", "kvabi_grant.slot: must be an integer"),
    (("kvabi_grant", "nonce"), "AB" * 16, "kvabi_grant.nonce: must be 32 lowercase hex"),
    (("kvabi_grant", "nonce"), "ab" * 15, "kvabi_grant.nonce: must be 32 lowercase hex"),
    (("kvabi_grant", "extra"), 1, "kvabi_grant: must be an object of exactly slot and nonce"),
]


@pytest.mark.parametrize("path,value,field", NEGATIVE,
                         ids=[f"{'.'.join(map(str, p))}={v!r:.20}" if v is not _DEL else
                              f"{'.'.join(map(str, p))} missing" for p, v, _ in NEGATIVE])
def test_malformed_params_are_refused_by_field(path, value, field):
    if field is None:  # accepted
        reader().read(_set(honest(), path, value), PROMPT)
        return
    with pytest.raises(KVABIError, match=field):
        reader().read(_set(honest(), path, value), PROMPT)


@pytest.mark.parametrize("params", [[1, 2], "do_remote_prefill", 7, [honest()]])
def test_params_that_are_no_object_are_refused(params):
    with pytest.raises(KVABIError, match="kv_transfer_params: must be an object"):
        reader().read(params, PROMPT)


def test_a_shorter_decode_prompt_is_refused():
    with pytest.raises(KVABIError, match="remote_num_tokens: 70 exceeds this request's "
                                         "prompt of 69 tokens"):
        reader().read(honest(), PROMPT[:-1])


def test_null_blocks_only_before_a_sliding_window():
    w = 20  # the decode side computes position 69 again: it needs positions 50..69
    p = _set(honest(), ("remote_block_ids", 0), [-1, 9, 12])  # positions 0..31: droppable
    assert reader(windows=(w,)).read(p, PROMPT).remote.blocks[0].tolist() == [-1, 9, 12]
    with pytest.raises(KVABIError, match=r"remote_block_ids\[0\]\[0\]: the null block"):
        reader(windows=(None,)).read(p, PROMPT)
    p2 = _set(honest(), ("remote_block_ids", 0), [5, -1, 12])  # 32..63 holds 50..63
    with pytest.raises(KVABIError, match=r"remote_block_ids\[0\]\[1\]: the null block"):
        reader(windows=(w,)).read(p2, PROMPT)


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) |
                     st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                         c, max_size=3),
                     max_leaves=8)


def _paths(p, prefix=()):
    yield prefix
    if isinstance(p, dict):
        for k, v in p.items():
            if k not in ("kvabi_grants",) and not (isinstance(v, str) and len(v) > 100):
                yield from _paths(v, prefix + (k,))
            else:
                yield prefix + (k,)
    elif isinstance(p, list):
        for i, v in enumerate(p):
            yield from _paths(v, prefix + (i,))


PATHS = [p for p in _paths(honest()) if p]


@given(st.sampled_from(PATHS), _json)
def test_any_value_anywhere_is_read_or_refused_by_name(path, value):
    """A random JSON value at a random place: an Entry or a KVABIError, nothing else."""
    try:
        reader().read(_set(honest(), path, value), PROMPT)
    except KVABIError as e:
        assert str(e).split(":")[0].strip()  # names a field


def test_ids_are_vectorized_and_checked_whole():
    bs = 4
    spec = kvabi.KVSpec("full", block_size=bs, num_kv_heads=2, head_dim=32, dtype="float32")
    msg = _msg(kvabi.Layout.preset("vllm.LBHNC", spec, num_blocks=5000, num_layers=2))
    n = 4000 * bs
    p = honest()
    p.update(remote_num_tokens=n, kvabi_handshakes=[{"kv": msg}],
             remote_block_ids=[list(range(1, 4001))])
    got = reader().read(p, list(range(n)))
    assert np.array_equal(got.remote.blocks[0], np.arange(1, 4001))
    p["remote_block_ids"][0][-1] = np.int64(3999)  # a duplicate, the last one
    with pytest.raises(KVABIError, match="block 3999 appears twice"):
        reader().read(p, list(range(n)))


# -- a producer of tensor-parallel size 2: a list of messages per place, one per rank -------
def _rank_msg(rank, bs=BS, ranks=2):
    import attrs

    spec = kvabi.KVSpec("full", block_size=bs, num_kv_heads=1, head_dim=32, dtype="float32")
    lay = attrs.evolve(kvabi.Layout.preset("vllm.LBHNC", spec, num_blocks=BLOCKS, num_layers=2),
                       shard=kvabi.Shard.tp(rank, ranks, ranks))
    return _msg(lay, address=(1 << 20) + rank * (1 << 34))


KV_TP = [_rank_msg(0), _rank_msg(1)]
GRANTS_TP = [_msg(table_layout(8, 4096), address=(1 << 20) + r * (1 << 34)) for r in range(2)]


def honest_tp():
    return {**honest(), "kvabi_handshakes": [{"kv": list(KV_TP)}],
            "kvabi_grants": list(GRANTS_TP)}


def test_a_tensor_parallel_producer_is_read_rank_by_rank():
    r = reader().read(honest_tp(), PROMPT).remote
    assert r.ranks == 2 and r.grants == tuple(GRANTS_TP)
    assert r.handshakes[0]["kv"] == tuple(KV_TP)
    assert [lay.shard.heads for lay in r.layouts[0]["kv"]] == [(0,), (1,)]
    assert r.blocks[0].tolist() == [5, 9, 12] and r.block_size == BS
    # TP 1: a message, or a list of one, read alike
    one = reader().read(_set(_set(honest(), ("kvabi_grants",), [GRANTS]),
                             ("kvabi_handshakes", 0, "kv"), [KV]), PROMPT).remote
    plain = reader().read(honest(), PROMPT).remote
    assert one.ranks == plain.ranks == 1 and one.handshakes == plain.handshakes


NEGATIVE_TP = [
    (("kvabi_handshakes", 0, "kv"), [KV_TP[0]],
     r"kvabi_handshakes\[0\].kv: 1 producer ranks, kvabi_grants lists 2"),
    (("kvabi_handshakes", 0, "kv"), KV_TP[0],
     r"kvabi_handshakes\[0\].kv: 1 producer ranks, kvabi_grants lists 2"),
    (("kvabi_handshakes", 0, "kv"), [], r"kvabi_handshakes\[0\].kv: must be a handshake "
                                        r"message or a list of 1 to 64"),
    (("kvabi_handshakes", 0, "kv"), [KV_TP[0], 5],
     r"kvabi_handshakes\[0\].kv\[1\]: must be a handshake message \(a string\)"),
    (("kvabi_handshakes", 0, "kv"), [KV_TP[0], "{}"], r"kvabi_handshakes\[0\].kv\[1\]: "),
    (("kvabi_handshakes", 0, "kv"), [KV_TP[0], _rank_msg(1, bs=16)],
     r"kvabi_handshakes\[0\].kv\[1\]: block size 16, the producer's first says 32"),
    (("kvabi_grants",), [GRANTS_TP[0]] * 65, r"kvabi_grants: must be a handshake message or "
                                             r"a list of 1 to 64 \(one per producer rank\), "
                                             r"got a list of 65"),
    (("kvabi_grants",), [GRANTS_TP[0], KV_TP[1]], r"kvabi_grants\[1\]: not a grant table"),
    (("kvabi_grants",), [GRANTS_TP[0], None],
     r"kvabi_grants\[1\]: must be a handshake message"),
    (("kvabi_grants",), {"0": GRANTS_TP[0]}, r"kvabi_grants: must be a handshake message or "
                                             r"a list"),
    (("kvabi_grants",), GRANTS, r"kvabi_handshakes\[0\].kv: 2 producer ranks, kvabi_grants "
                                r"lists 1"),
]


@pytest.mark.parametrize("path,value,field", NEGATIVE_TP,
                         ids=[f"{'.'.join(map(str, p))}={v!r:.20}" for p, v, _ in NEGATIVE_TP])
def test_malformed_rank_lists_are_refused_by_field(path, value, field):
    with pytest.raises(KVABIError, match=field):
        reader().read(_set(honest_tp(), path, value), PROMPT)


PATHS_TP = [p for p in _paths(honest_tp()) if p]


@given(st.sampled_from(PATHS_TP), _json)
def test_any_value_anywhere_in_rank_lists_is_read_or_refused_by_name(path, value):
    try:
        reader().read(_set(honest_tp(), path, value), PROMPT)
    except KVABIError as e:
        assert str(e).split(":")[0].strip()
