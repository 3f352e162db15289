"""Every public entry point of ``kvabi.transfer`` (and the shard checks it relies on) with
each argument in turn replaced by a hostile value (a string, the string ``"false"``, a bool,
a float, a negative or huge number, ragged, string, float, bool or object arrays, another
kind of object): the call either succeeds or raises a ``KVABIError`` whose message starts
with a field (``specs/security.md`` section 2); no ``TypeError``, ``AttributeError``,
``IndexError`` or ``ValueError`` from deep inside.  Every call first succeeds with its
valid arguments, so a refusal is the hostile value's.
"""
from __future__ import annotations

import fractions
import re

import attrs
import numpy as np
import pytest

from kvabi import KVABIError, KVCache, KVSpec, Layout
from kvabi.model.shard import Shard, check_group
from kvabi.transfer import (HostPool, ShardPlan, TransferPlan, check_compatible,
                            cross_layer_twin, execute, execute_shards, negotiate,
                            plan_block_transfer, plan_shard_block_transfer,
                            plan_shard_transfer, plan_tp_transfer, plan_transfer)
from kvabi.transfer.checksum import KVChecksums, check_checksums, kv_checksums
from kvabi.transfer.handshake import make_handshake, parse_handshake
from kvabi.transfer.kv_scales import check_same_scales, parse_kv_scales, scales_to_json

FIELD = re.compile(r"^[A-Za-z_][\w.\[\]'-]*: ")
SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
A = Layout.preset("flashinfer.NHD", SPEC, 6, 2)
B = Layout.preset("flashinfer.HND", SPEC, 6, 2)
RANKS = [attrs.evolve(A, shard=Shard.tp(i, 2, 4)) for i in range(2)]
DST = [attrs.evolve(B, shard=Shard.tp(i, 2, 4)) for i in range(2)]

BAD = {"None": None, "str": "x", "'false'": "false", "True": True, "1.5": 1.5, "-1": -1,
       "2**70": 2**70, "[]": [], "[[1]]": [[1]], "dict": {"a": 1},
       "str array": np.array(["a"]), "object": object(), "nan": float("nan"), "Layout": A,
       "[Fraction]": [fractions.Fraction(1, 2)], "bytes": b"x",
       "2-D ints": np.zeros((2, 2), np.int64), "float array": np.array([0.5]),
       "bool array": np.array([True]), "[2**62]": np.array([2**62]), "[-1]": np.array([-1])}


def calls():
    """name -> (function, args, kwargs): valid arguments, each to be replaced in turn."""
    ca, cb = KVCache.allocate(A, "numpy"), KVCache.allocate(B, "numpy")
    rc = [KVCache.allocate(r, "numpy") for r in RANKS]
    dc = KVCache.allocate(DST[0], "numpy")
    plan = plan_transfer(A, B, [0, 1], [2, 3])
    splan = plan_shard_transfer(RANKS, DST[0], [0, 1], [0, 1])
    sums = kv_checksums(ca, [0, 1])
    pool = HostPool(A, 4)
    held = pool.offload(ca, [0])
    return {
        "plan_transfer": (plan_transfer, (A, B, [0, 1], [2, 3]), {"layers": None}),
        "plan_block_transfer": (plan_block_transfer, (A, B, [0], [1]), {"layers": None}),
        "check_compatible": (check_compatible, (A, B), {}),
        "execute": (execute, (plan, ca, cb), {}),
        "execute_shards": (execute_shards, (splan, rc, dc), {}),
        "negotiate": (negotiate, (DST[0], RANKS), {"standard": True}),
        "plan_shard_transfer": (plan_shard_transfer, (RANKS, DST[0], [0, 1], [0, 1]),
                                {"layers": None, "standard": True}),
        "plan_shard_block_transfer": (plan_shard_block_transfer, (RANKS, DST[0], [0], [1]),
                                      {"layers": None, "standard": True}),
        "plan_tp_transfer": (plan_tp_transfer, (RANKS, DST, [0], [1]),
                             {"layers": None, "standard": True}),
        "ShardPlan": (ShardPlan, (splan.src_layouts, splan.dst_layout, splan.parts,
                                  splan.runs), {}),
        "TransferPlan": (TransferPlan, (plan.regions, A, B), {}),
        "kv_checksums": (kv_checksums, (ca, [0, 1]), {"layers": None, "chunk": 16}),
        "check_checksums": (check_checksums, (sums, sums, (0, 1), "rank 0"), {}),
        "KVChecksums.from_json": (KVChecksums.from_json, (sums.to_json(),), {}),
        "parse_handshake": (parse_handshake, (make_handshake(
            agent_name="a", host="h", port=5, memory="DRAM", layout=A,
            planes=[(4096, A.plane_nbytes, 0)] * A.num_planes),), {}),
        "make_handshake": (make_handshake, (), dict(
            agent_name="a", host="h", port=5, memory="DRAM", layout=A,
            planes=[(4096, A.plane_nbytes, 0)] * A.num_planes, metadata=None, model=None,
            kv_scales=None)),
        "parse_kv_scales": (parse_kv_scales, ([[1.0, 1.0]] * 2, 2), {}),
        "scales_to_json": (scales_to_json, ([[1.0, 1.0]] * 2,), {}),
        "check_same_scales": (check_same_scales, (((1.0, 1.0),) * 2, ((1.0, 1.0),) * 2), {}),
        "cross_layer_twin": (cross_layer_twin, (A, 4), {"num_layers": None}),
        "check_group": (check_group, ([Shard.tp(0, 1, 2)],), {"standard": True}),
        "Shard": (Shard, ([0, 1], 2), {"rank": 0, "ranks": 1}),
        "Shard.tp": (Shard.tp, (0, 2, 4), {}),
        "HostPool": (HostPool, (A, 4), {"num_layers": None}),
        "HostPool.offload": (pool.offload, (ca, [0]), {}),
        "HostPool.onload": (pool.onload, (cb, held, [1]), {}),
        "HostPool.free": (pool.free, (held,), {}),
    }


CALLS = calls()


def _cases():
    for name, (_, args, kw) in CALLS.items():
        for where in [i for i in range(len(args))] + list(kw):
            yield pytest.param(name, where, id=f"{name}[{where}]")


def _run(f, args, kw):
    try:
        f(*args, **kw)
    except KVABIError as e:
        return None if FIELD.match(str(e)) else f"KVABIError without a field: {e}"
    except Exception as e:  # noqa: BLE001 - what this test exists to find
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("name,where", list(_cases()))
def test_each_argument_hostile_in_turn(name, where):
    f, args, kw = calls()[name]
    f(*args, **kw)  # the valid call succeeds
    fresh = name.startswith("HostPool")  # a pool's state changes with each call
    bad = []
    for label, value in BAD.items():
        f, args, kw = calls()[name] if fresh else (f, args, kw)
        args, kw = list(args), dict(kw)
        if isinstance(where, int):
            args[where] = value
        else:
            kw[where] = value
        why = _run(f, args, kw)
        if why:
            bad.append(f"{label}: {why[:200]}")
    assert not bad, f"{name}({where}=...):\n" + "\n".join(bad)


def test_standard_false_as_a_string_is_refused_never_read_as_true():
    """A lying rank (rank 1 stating rank 0's heads) passes only with standard=False; the
    string "false" must not switch the check off (nor on: it is refused by name)."""
    liar = [RANKS[0], attrs.evolve(RANKS[1], shard=Shard(heads=[0, 1], of=4, rank=1,
                                                          ranks=2))]
    for f, args in ((negotiate, (DST[0], RANKS)),
                    (plan_shard_transfer, (RANKS, DST[0], [0], [0])),
                    (plan_shard_block_transfer, (RANKS, DST[0], [0], [1])),
                    (plan_tp_transfer, (RANKS, DST, [0], [1])),
                    (check_group, ([r.shard for r in RANKS],))):
        with pytest.raises(KVABIError, match=r"^standard: must be true or false, got "
                                             r"'false'"):
            f(*args, standard="false")
    with pytest.raises(KVABIError, match=r"shard.heads: rank 1 of 2 holds \[2, 3\]"):
        check_group([r.shard for r in liar])
    with pytest.raises(KVABIError, match="^standard"):
        check_group([r.shard for r in liar], standard="false")
