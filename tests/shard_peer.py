"""A prefill rank of a tensor-parallel engine, in its own process, for the NIXL tests of
transfers between shardings (run as ``python shard_peer.py serve DIR RANK TP``).

For each case of :data:`CASES` it allocates its rank's cache (its shard of the model's KV
heads), writes the model's KV of its heads at the engine's slots (``shard_oracle``: from a
fixed seed, so the pulling side knows it without asking), registers the caches with one
NIXL agent, sums them (``kv_checksums``), and writes ``DIR/rank<R>.json``: the handshake and
the sums of each case.  Case ``corrupt`` is ``gqa`` with one byte changed after its sums (a
block reused before the peer read it).  It serves until killed (or for two minutes),
appending every notification it receives to ``DIR/rank<R>.notes`` as it arrives.
"""
from __future__ import annotations

import json
import os
import sys
import time

import attrs
import numpy as np

from kvabi import KVSpec, Layout
from kvabi.model.shard import Shard
from shard_oracle import (component_cache, component_model, model_kv, write_components,
                          write_rank)

LAYERS = 2
TOKENS = 21
#: case -> (kind, global KV heads, prefill preset, prefill block size)
CASES = {
    "gqa": ("full", 4, "flashinfer.NHD", 4),
    "replicated": ("full", 2, "vllm.BLHNC", 8),
    "mla": ("mla", 1, "vllm.LBNHC", 4),
    "corrupt": ("full", 4, "flashinfer.NHD", 4),
    # a component layout: int8 codes with a float32 scale per (token, head)
    "int8": ("full", 4, "vllm.int8_per_token_head", 4),
}
NUM_BLOCKS = 8
TIMEOUT = 120.0


def content(case):
    """The model's KV of ``case`` (``corrupt`` holds ``gqa``'s; ``int8``: a record per
    component, :func:`shard_oracle.component_model`)."""
    kind, heads, preset, _ = CASES[case]
    rng = np.random.default_rng(0 if case == "corrupt" else list(CASES).index(case))
    if case == "int8":
        return component_model(rng, layout(preset, kind, heads, 0, 1, 4, NUM_BLOCKS), LAYERS,
                               TOKENS, heads)
    return model_kv(rng, LAYERS, TOKENS, kind != "mla", heads, 8, 2)


def slots(block_size, num_blocks, seed):
    """The engine's slots of the request's tokens (scattered blocks, one block table)."""
    need = -(-TOKENS // block_size)
    blocks = np.random.default_rng(100 + seed).permutation(num_blocks)[:need]
    pos = np.arange(TOKENS)
    return blocks[pos // block_size] * block_size + pos % block_size


def layout(preset, kind, heads, rank, tp, block_size, num_blocks):
    shard = Shard.tp(rank, tp, heads)
    spec = KVSpec(kind, block_size=block_size, num_kv_heads=len(shard.heads), head_dim=8,
                  dtype="float16")
    return attrs.evolve(Layout.preset(preset, spec, num_blocks, LAYERS), shard=shard)


def serve(d, rank, tp):
    from kvabi.transfer.checksum import kv_checksums
    from kvabi.transfer.nixl import NixlAgent

    agent = NixlAgent(f"prefill-tp{tp}-r{rank}-{os.getpid()}")
    out, keep = {}, []
    for case, (kind, heads, preset, bs) in CASES.items():
        lay = layout(preset, kind, heads, rank, tp, bs, NUM_BLOCKS)
        bufs, cache = component_cache(lay, np.random.default_rng(rank))
        s = slots(bs, NUM_BLOCKS, 0)
        if case == "int8":
            write_components(bufs, lay, content(case), range(LAYERS), s)
        else:
            write_rank(bufs, lay, content(case), range(LAYERS), s)
        sums = kv_checksums(cache, s, chunk=8)
        if case == "corrupt":
            bufs[0][bufs[0].size // 2] ^= 0xFF
        agent.register(cache)
        keep.append((bufs, cache))
        out[case] = {"handshake": agent.handshake(cache), "sums": sums.to_json()}
    tmp = os.path.join(d, f"rank{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, os.path.join(d, f"rank{rank}.json"))
    deadline = time.monotonic() + TIMEOUT
    with open(os.path.join(d, f"rank{rank}.notes"), "a") as notes:
        while time.monotonic() < deadline:
            for sender, msgs in agent._agent.update_notifs().items():
                for m in msgs:
                    notes.write(m.decode() + "\n")
                    notes.flush()
                msgs.clear()
            time.sleep(0.01)
    agent.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
