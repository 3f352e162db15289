"""Both sides of a P/D pull between two hosts (network namespaces the test made), each in its
own process:

``python netns_peer.py serve DIR TP HOST SIZE``: the prefill ranks of a TP-sized engine, one
NIXL agent each (listening on HOST).  Each rank's shard of the model's KV (``shard_oracle``,
from a fixed seed: the pulling side knows it without asking) is written at the engine's
slots of a ``flashinfer.NHD`` cache (16-token blocks), registered and summed; it writes
``DIR/rank<R>.json`` (the handshake and the sums) and serves until ``DIR/stop`` exists.

``python netns_peer.py pull OUT HOST SIZE REPEAT DIR [DIR2]``: decode rank 0 of a TP 1 engine
on a ``flashinfer.HND`` cache with 32-token blocks (another layout, block size and TP size)
pulls the request from the group serving in DIR (``pull_shards`` with checksums), checks
every byte against the model's KV (guards and untouched bytes included), then times REPEAT
pulls (best kept, after one warm-up each); with DIR2, the same from a second group through a second agent made with
UCX's defaults (loopback on one host), timed alternately with the first.  Writes OUT (JSON).

SIZE: ``short`` (the test) or ``long`` (the figures: 16 MiB).  Every wait ends with an error
that says what it waited for.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import attrs
import numpy as np

from kvabi import KVSpec, Layout
from kvabi.bench.transfer_table import alternate
from kvabi.model.shard import Shard
from shard_oracle import check_rank, guarded_cache, model_kv, write_rank

#: SIZE -> (layers, tokens, KV heads, head dim)
SIZES = {"short": (2, 80, 4, 16), "long": (4, 1024, 8, 128)}
PREFILL = ("flashinfer.NHD", 16)
DECODE = ("flashinfer.HND", 32)
TIMEOUT = 180.0


def shape(size):
    layers, tokens, heads, dim = SIZES[size]
    return layers, tokens, heads, dim


def layout(size, preset, block_size, rank, tp):
    layers, tokens, heads, dim = shape(size)
    shard = Shard.tp(rank, tp, heads)
    spec = KVSpec("full", block_size=block_size, num_kv_heads=len(shard.heads), head_dim=dim,
                  dtype="float16")
    blocks = 2 * -(-tokens // block_size)  # room to scatter the request
    return attrs.evolve(Layout.preset(preset, spec, blocks, layers), shard=shard)


def slots(block_size, num_blocks, tokens, seed):
    """The engine's slots of the request's tokens (scattered blocks)."""
    need = -(-tokens // block_size)
    blocks = np.random.default_rng(100 + seed).permutation(num_blocks)[:need]
    pos = np.arange(tokens)
    return blocks[pos // block_size] * block_size + pos % block_size


def content(size):
    layers, tokens, heads, dim = shape(size)
    return model_kv(np.random.default_rng(7), layers, tokens, True, heads, dim, 2)


def wait_for(path: Path, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what} ({path})")
        time.sleep(0.02)


def serve(d, tp, host, size):
    from kvabi.transfer.checksum import kv_checksums
    from kvabi.transfer.nixl import NixlAgent

    agents = []
    for rank in range(tp):
        lay = layout(size, *PREFILL, rank, tp)
        bufs, cache = guarded_cache(lay, np.random.default_rng(rank))
        s = slots(lay.size("N"), lay.num_blocks, shape(size)[1], 0)
        write_rank(bufs, lay, content(size), range(lay.num_layers), s)
        agent = NixlAgent(f"prefill-r{rank}-{os.getpid()}", host=host)
        agent.register(cache)
        agents.append((agent, bufs, cache))
        out = {"handshake": agent.handshake(cache),
               "sums": kv_checksums(cache, s, chunk=16).to_json()}
        tmp = Path(d) / f"rank{rank}.tmp"
        tmp.write_text(json.dumps(out))
        tmp.replace(Path(d) / f"rank{rank}.json")
    deadline = time.monotonic() + TIMEOUT
    while not (Path(d) / "stop").exists() and time.monotonic() < deadline:
        for agent, _, _ in agents:
            agent.drain_notifications()
        time.sleep(0.02)
    for agent, _, _ in agents:
        agent.close()


def _group(agent, d, tp):
    from kvabi.transfer.checksum import KVChecksums

    ranks = []
    for r in range(tp):
        path = Path(d) / f"rank{r}.json"
        wait_for(path, f"prefill rank {r} of the group in {d} to publish its handshake")
        ranks.append(json.loads(path.read_text()))
    peers = [agent.connect(r["handshake"], timeout=60) for r in ranks]
    return peers, [KVChecksums.from_json(r["sums"]) for r in ranks]


def pull(out, host, size, repeat, dirs):
    from kvabi.transfer.nixl import NixlAgent

    tp = 2
    dst_l = layout(size, *DECODE, 0, 1)
    layers, tokens = shape(size)[:2]
    src = slots(PREFILL[1], layout(size, *PREFILL, 0, tp).num_blocks, tokens, 0)
    dst_s = slots(dst_l.size("N"), dst_l.num_blocks, tokens, 1)
    kv = content(size)
    agents = [NixlAgent(f"decode-{os.getpid()}", host=host)]
    if len(dirs) > 1:  # a second agent with UCX's defaults: loopback (shared memory)
        ucx = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("UCX_")}
        agents.append(NixlAgent(f"decode-lo-{os.getpid()}"))
        os.environ.update(ucx)
    result = {"nbytes": None, "best_s": [], "descriptors": []}
    pulls = []
    for agent, d in zip(agents, dirs):
        peers, sums = _group(agent, d, tp)
        bufs, dst = guarded_cache(dst_l)
        before = [b.copy() for b in bufs]
        agent.register(dst)
        agent.pull_shards(peers, dst, src, dst_s, checksums=sums, timeout=120)
        check_rank(bufs, before, dst_l, kv, range(layers), dst_s)
        from kvabi.transfer.shards import plan_shard_transfer

        plan = plan_shard_transfer([p.layout for p in peers], dst_l, src, dst_s)
        result["nbytes"] = plan.nbytes
        result["descriptors"].append(agent.descriptors(peers, plan, dst))
        pulls.append(lambda a=agent, p=peers, pl=plan, c=dst: a.pull_shard_plan(
            p, pl, c, timeout=120))
    result["best_s"] = alternate(pulls, repeat)
    for d in dirs:
        (Path(d) / "stop").touch()
    Path(out).write_text(json.dumps(result))
    for a in agents:
        a.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        pull(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6:])
