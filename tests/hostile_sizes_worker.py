"""Runs hostile-size cases in a process of its own, under an address-space limit the caller
sets (``python hostile_sizes_worker.py`` with JSON cases on stdin, one JSON result per case
on stdout).

Each case names an untrusted reader (``op``) and the text or numbers a peer, a client or a
file states (``doc``: a layout descriptor, ``docs``: one per remote rank, ``text``, ...).
The result says what the reader answered (``ok``, or the exception's type and message), the
peak of memory it allocated (tracemalloc: numpy's allocations included) and its seconds.
A reader that tried to allocate beyond the limit answers ``MemoryError`` here instead of
taking the machine down.
"""
from __future__ import annotations

import json
import sys
import time
import tracemalloc

import numpy as np

from kvabi import KVABIError, KVCache, KVSpec, Layout, ModelKV, TPView
from kvabi.model.shard import check_group, shard_of
from kvabi.transfer import negotiate, plan_shard_block_transfer, plan_shard_transfer
from kvabi.transfer.checksum import KVChecksums, kv_checksums
from kvabi.transfer.handshake import parse_handshake


def local_layout(case) -> Layout:
    """The receiver's own (trusted) layout of a case: a preset of a small spec."""
    spec = KVSpec("full", block_size=case.get("block_size", 16), num_kv_heads=case.get(
        "heads", 2), head_dim=case.get("head_dim", 64), dtype=case.get("dtype", "bfloat16"))
    lay = Layout.preset(case.get("preset", "flashinfer.HND"), spec, 8, case.get("layers", 2))
    if "shard" in case:
        import attrs

        lay = attrs.evolve(lay, shard=case["shard"])
    return lay


def message(doc: dict) -> str:
    """A handshake carrying ``doc``, its fingerprint computed here (the label a sender
    would put on it)."""
    lay = Layout.from_json(doc)
    n = lay.num_planes if lay.num_planes <= 4096 else 1
    return json.dumps({"kvabi_abi": [2, 0], "message": "kvabi.transfer.handshake",
                       "agent": {"name": "peer", "host": "127.0.0.1", "port": 5600},
                       "memory": "DRAM", "layout": doc, "fingerprint": lay.fingerprint(),
                       "planes": {"address": [4096] * n, "nbytes": 2**61, "device": 0}})


def run(case):
    op = case["op"]
    if op == "layout":  # parse and label a descriptor
        return Layout.from_json(case["doc"]).fingerprint()
    if op == "handshake":
        return parse_handshake(message(case["doc"])).fingerprint
    if op == "negotiate":
        remote = [Layout.from_json(d) for d in case["docs"]]
        n = negotiate(local_layout(case), remote, standard=case.get("standard", True))
        return [n.kind, n.cost().regions, n.staged]
    if op == "plan_shard":
        remote = [Layout.from_json(d) for d in case["docs"]]
        slots = np.arange(case.get("tokens", 16))
        plan = plan_shard_transfer(remote, local_layout(case), slots, slots,
                                   standard=case.get("standard", False))
        return len(plan)
    if op == "plan_shard_blocks":
        remote = [Layout.from_json(d) for d in case["docs"]]
        plan = plan_shard_block_transfer(remote, local_layout(case), case["src_blocks"],
                                         case["dst_blocks"], standard=case.get("standard",
                                                                               False))
        return len(plan)
    if op == "staging":  # what a staged pull of whole blocks would hold for the READ
        from kvabi.transfer import plan_block_transfer
        from kvabi.transfer.staging import block_staging_limit, stage, stage_blocks

        remote = Layout.from_json(case["doc"])
        plan = plan_block_transfer(remote, local_layout(case), case["src_blocks"],
                                   case["dst_blocks"])
        piece = stage_blocks(plan.pattern, remote, plan.dst_layout, [],
                             most=block_staging_limit(plan.nbytes))
        held = piece.nbytes if piece is not None else stage(plan.check().regions).nbytes
        if held > 2 * block_staging_limit(plan.nbytes):
            raise RuntimeError(f"staging would hold {held} bytes for a plan of "
                               f"{plan.nbytes}")
        return held
    if op == "check_group":
        shards = [shard_of(Layout.from_json(d)) for d in case["docs"]]
        return len(check_group(shards, standard=case.get("standard", False)))
    if op == "tp_view":
        view = TPView(ModelKV.from_hf_config(case["config"]), case["tp"])
        rank = case.get("rank", 0)
        lays = view.layouts(rank, "flashinfer.HND", 4)
        return [len(view.shard(rank).heads), lays[0].fingerprint()]
    if op == "checksums_json":
        c = KVChecksums.from_json(case["text"])
        return [len(c.heads), c.tokens, c.chunk]
    if op == "checksums":  # a peer's chunk size, used to sum a small local cache
        lay = local_layout(case)
        cache = KVCache.allocate(lay, "numpy")
        return kv_checksums(cache, np.arange(case.get("tokens", 5)),
                            chunk=case["chunk"]).values.shape[0]
    raise SystemExit(f"unknown op {op!r}")


def main() -> None:
    cases = json.load(sys.stdin)
    for case in cases:
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            got = {"ok": repr(run(case))[:200]}
        except KVABIError as e:
            got = {"error": "KVABIError", "message": str(e)[:300]}
        except BaseException as e:  # noqa: BLE001 - reported, the test names it
            got = {"error": type(e).__name__, "message": str(e)[:300]}
        got["seconds"] = time.perf_counter() - t0
        got["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
