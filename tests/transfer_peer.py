"""The two processes of the end-to-end NIXL test (run as ``python transfer_peer.py ROLE``).

``serve DIR``: writes KV for a mixed batch (a prefill, a decode, a chunked prefill) with
``cuda.triton`` on ``flashinfer.HND`` block 16 (reference if unavailable), registers the
cache with a NIXL agent, writes its handshake to DIR/handshake.json and waits for the
peer's READ notification.

``pull DIR``: pulls every token into ``tpu.combined`` block 32 (a slot-level relayout),
runs attention with ``tpu.jax`` (reference if unavailable) and saves its output, the
reference backend's output over the same tokens, and the pulled K/V, in DIR/result.npz.

Token values come from a fixed seed, so each side knows them without the other.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import kvabi
from kvabi import CommonAttentionMetadata, KVCache, KVSpec
from kvabi.layout.descriptor import Layout
from kvabi.util.tensors import convert, to_numpy
from kvabi.transfer import plan_transfer
from kvabi.transfer.nixl import NixlAgent

SPEC_A = KVSpec("full", block_size=16, num_kv_heads=2, head_dim=16, dtype="float32")
SPEC_B = KVSpec("full", block_size=32, num_kv_heads=2, head_dim=16, dtype="float32")
CTX = np.array([0, 20, 5])
QLEN = np.array([12, 1, 7])  # prefill, decode, chunked prefill
LAYERS = 2
HQ = 4
TIMEOUT = 90.0


def backend(name):
    try:
        b = kvabi.get_backend(name)
        if b.available()[0]:
            return b
    except kvabi.KVABIError:
        pass
    return kvabi.get_backend("reference")


def tables(block_size, num_blocks, seed):
    seq = CTX + QLEN
    need = -(-seq // block_size)
    ids = np.random.default_rng(seed).permutation(num_blocks)
    table = np.full((len(seq), int(need.max())), -1)
    start = 0
    for r, n in enumerate(need):
        table[r, :n] = ids[start:start + n]
        start += n
    return table


TABLE_A = tables(16, 8, 1)
TABLE_B = tables(32, 5, 2)


def tokens():
    """Per layer, per request: keys and values [seq, H, D] (float32), and the queries."""
    rng = np.random.default_rng(7)
    seq = CTX + QLEN
    kv = [[(rng.standard_normal((s, 2, 16)).astype(np.float32),
            rng.standard_normal((s, 2, 16)).astype(np.float32)) for s in seq]
          for _ in range(LAYERS)]
    query = rng.standard_normal((int(QLEN.sum()), HQ, 16)).astype(np.float32)
    return kv, query


def slots(table, block_size):
    """Slots of every token of every request, in request order."""
    out = []
    for r, s in enumerate(CTX + QLEN):
        j = np.arange(s)
        out.append(table[r, j // block_size] * block_size + j % block_size)
    return np.concatenate(out)


def write_all(be, layout, table, spec, num_blocks):
    """Write the context in one step, then the mixed batch's new tokens."""
    kv, _ = tokens()
    cache = KVCache.allocate(layout, be.framework, device=be.device())
    steps = [(CTX, np.zeros_like(CTX), [(0, c) for c in CTX]),
             (QLEN, CTX, [(c, c + q) for c, q in zip(CTX, QLEN)])]
    for qlen, ctx, rows in steps:
        meta = CommonAttentionMetadata.from_lengths(qlen, ctx, table, spec.block_size,
                                                    num_blocks=num_blocks)
        plan = be.plan(meta, spec, layout, num_q_heads=HQ)
        for layer in range(LAYERS):
            key = np.concatenate([kv[layer][r][0][a:z] for r, (a, z) in enumerate(rows)])
            val = np.concatenate([kv[layer][r][1][a:z] for r, (a, z) in enumerate(rows)])
            cache = be.write_kv(plan, cache, key=convert(key, be.framework, device=be.device()),
                                value=convert(val, be.framework, device=be.device()),
                                layer=layer)
    return cache


def attend(be, cache, layout, table, spec, num_blocks):
    _, query = tokens()
    meta = CommonAttentionMetadata.from_lengths(QLEN, CTX, table, spec.block_size,
                                                num_blocks=num_blocks)
    plan = be.plan(meta, spec, layout, num_q_heads=HQ)
    q = convert(query, be.framework, device=be.device())
    return np.stack([np.asarray(to_numpy(be.attention(plan, cache, query=q, layer=layer)),
                                np.float64) for layer in range(LAYERS)])


def serve(d):
    be = backend("cuda.triton")
    layout = Layout.preset("flashinfer.HND", SPEC_A, 8, LAYERS)
    cache = write_all(be, layout, TABLE_A, SPEC_A, 8)
    with NixlAgent("prefill") as agent:
        agent.register(cache)
        tmp = os.path.join(d, "handshake.tmp")
        with open(tmp, "w") as f:
            f.write(agent.handshake(cache))
        os.replace(tmp, os.path.join(d, "handshake.json"))  # the peer never sees half a file
        sender, msg = agent.wait_notification(b"kvabi.pull", timeout=TIMEOUT)
    print(json.dumps({"backend": be.name, "notified_by": sender, "message": msg.decode()}))


def pull(d):
    be = backend("tpu.jax")
    layout = Layout.preset("tpu.combined", SPEC_B, 5, LAYERS)
    path = os.path.join(d, "handshake.json")
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit("no handshake from the serving process")
        time.sleep(0.05)
    with open(path, "rb") as f:
        message = f.read()
    with NixlAgent("decode") as agent:
        dst = agent.register(KVCache.allocate(layout, "numpy", fill=0))
        peer = agent.connect(message, timeout=30)
        src_slots = slots(TABLE_A, 16)
        dst_slots = slots(TABLE_B, 32)
        plan = plan_transfer(peer.layout, layout, src_slots, dst_slots)
        agent.pull_plan(peer, plan, dst, timeout=30, notify=b"kvabi.pull done")
    pulled = np.stack([[np.asarray(dst.kv_view(layer, kv)) for kv in range(2)]
                       for layer in range(LAYERS)])
    cache = dst if be.framework == "numpy" else KVCache.wrap(
        layout, [convert(p, be.framework, device=be.device()) for p in dst])
    out = attend(be, cache, layout, TABLE_B, SPEC_B, 5)
    # The oracle: the reference backend over the same tokens in its own layout.
    ref = kvabi.get_backend("reference")
    ref_layout = Layout.preset("flash_attn", SPEC_A, 8, LAYERS)
    ref_cache = write_all(ref, ref_layout, TABLE_A, SPEC_A, 8)
    want = attend(ref, ref_cache, ref_layout, TABLE_A, SPEC_A, 8)
    np.savez(os.path.join(d, "result.npz"), out=out, want=want, pulled=pulled,
             regions=len(plan), src_layout=peer.layout.name)
    print(json.dumps({"backend": be.name, "regions": len(plan), "peer": peer.name}))


if __name__ == "__main__":
    {"serve": serve, "pull": pull}[sys.argv[1]](sys.argv[2])
