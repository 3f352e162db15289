"""The tensor-parallel figures of ``kvabi bench transfer``: pulls between engines of
different TP sizes against same-TP pulls of the same bytes, and what negotiating with a
64-layer peer costs (time and handshake bytes).

Heterogeneous pulls: a serving process holds the prefill engine's ranks, one NIXL agent
and one cache per rank (its shard of the KV heads); this process is one decode rank.
``TP 2 -> 1``: the decode rank holds all heads and reads half from each prefill rank;
its reference is ``TP 1 -> 1`` of the same layouts (one source holding all heads), the
same bytes.  ``TP 1 -> 2``: decode rank 0 reads its half of the heads from the one prefill
rank; its reference is ``TP 2 -> 2`` (rank 0 of each side), the same bytes.  Each pair is
timed alternately (best of ``repeat``), so that both see the same machine load.

What bounds the heterogeneous figures on one host (UCX over loopback: each descriptor is
one zero-copy ``cma`` get, copied inside the post): a layout whose rank's heads of a block
are one small piece (``flashinfer.HND``: 16 KiB per block, K/V and layer) either posts one
descriptor per piece (a fixed cost of a few microseconds each, about a 64 KiB copy) or
READs large spans staged and relayouts them locally, which moves every byte through memory
a second time; the same-TP reference READs a few 4 MiB regions.  Layouts whose rank's heads
of a block are large pieces (``vllm.BHLNC``: all layers of a block) pull at the
reference's speed.  A pull is staged only where staging saves descriptors
(:func:`~kvabi.transfer.staging.staging_pays`), direct otherwise (a rank reading half the
heads of each block of a larger source shard).
"""
from __future__ import annotations

import statistics
import time

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..memory.cache import KVCache
from ..model.shard import Shard
from ..model.spec import KVSpec
from ..transfer.shards import plan_shard_transfer
from .rig import ServingRig

#: the layouts compared (both sides the same preset: only the TP split differs)
PRESETS = ("flashinfer.HND", "vllm.BHLNC", "vllm.LBHNC")
#: the 64-layer model of the negotiation figures (Llama-3-70B-like KV: 8 heads x 128)
NEGOTIATE_LAYERS = 64


def rank_layout(spec: KVSpec, preset: str, rank: int, tp: int, num_blocks: int,
                layers: int) -> Layout:
    shard = Shard.tp(rank, tp, spec.num_kv_heads)
    local = attrs.evolve(spec, num_kv_heads=len(shard.heads))
    return attrs.evolve(Layout.preset(preset, local, num_blocks, layers), shard=shard)


def _serve(conn):
    """Child process: on request, one NIXL agent per rank of a group of agents, each
    registering a cache of its rank's layout; answers with the handshakes.  A group's
    agents are closed together (NIXL peers keep metadata of a known agent: memory
    registered again at a freed address under an old name is refused, so each group of
    caches gets agents of its own)."""
    from ..transfer.nixl import NixlAgent

    agents = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            for a, _ in agents.values():
                a.close()
            conn.send("bye")
            return
        if cmd == "ranks":
            group, layouts = args
            out = []
            for i, text in enumerate(layouts):
                if (group, i) not in agents:
                    agents[group, i] = (NixlAgent(f"bench-tp-{group}-rank{i}"), [])
                agent, held = agents[group, i]
                cache = agent.register(KVCache.allocate(Layout.from_json(text), "numpy",
                                                        fill=1))
                held.append(cache)
                out.append(agent.handshake(cache))
            conn.send(out)
        elif cmd == "close":
            for key in [k for k in agents if k[0] == args[0]]:
                agents.pop(key)[0].close()
            conn.send("ok")


class TPRig:
    """This process's decode agent and a spawned process holding prefill ranks."""

    def __init__(self):
        self._rig = ServingRig("bench-tp-decode", _serve)
        self.agent = self._rig.agent

    def group(self, agents: str, layouts):
        """Connected peers of prefill ranks holding ``layouts`` (one per rank), served by
        the group of agents named ``agents``."""
        msgs = self._rig._ask("ranks", agents, [lay.to_json() for lay in layouts],
                              timeout=300)
        return [self.agent.connect(m, timeout=60) for m in msgs]

    def close_group(self, agents: str) -> None:
        self._rig._ask("close", agents, timeout=300)

    def close(self):
        self._rig.close()


def heterogeneous_pulls(setup, spec: KVSpec, block_sets, side_by_side, presets=PRESETS,
                        say=lambda m: None) -> list[dict]:
    """Rows ``{preset, pair, ref, nbytes, regions, ref_regions, s, ref_s}`` (seconds: best
    of ``setup.repeat``, timed alternately with the reference)."""
    rig = TPRig()
    rows = []
    blocks = block_sets["contiguous"]
    slots = (blocks[:, None] * spec.block_size + np.arange(spec.block_size)).ravel()
    dst_slots = np.arange(slots.size)
    try:
        for preset in presets:
            def lays(rank, tp):
                return rank_layout(spec, preset, rank, tp, setup.num_blocks, setup.layers)

            for pair, (p_tp, d_tp), (rp_tp, rd_tp) in (("TP 2 -> 1", (2, 1), (1, 1)),
                                                       ("TP 1 -> 2", (1, 2), (2, 2))):
                say(f"  {preset}: {pair} against TP {rp_tp} -> {rd_tp}")
                key = f"{len(rows)}"
                peers = rig.group(key, [lays(r, p_tp) for r in range(p_tp)])
                ref = rig.group(key, [lays(r, rp_tp) for r in range(rp_tp)])
                d_lay = attrs.evolve(lays(0, d_tp), sizes={**lays(0, d_tp).sizes,
                                                           "B": setup.blocks})
                r_lay = attrs.evolve(lays(0, rd_tp), sizes={**lays(0, rd_tp).sizes,
                                                            "B": setup.blocks})
                dst = rig.agent.register(KVCache.allocate(d_lay, "numpy"))
                rdst = rig.agent.register(KVCache.allocate(r_lay, "numpy"))
                plan = plan_shard_transfer([p.layout for p in peers], d_lay, slots, dst_slots)
                rplan = plan_shard_transfer([p.layout for p in ref], r_lay, slots, dst_slots)
                t, t_ref = side_by_side(
                    lambda: rig.agent.pull_shard_plan(peers, plan, dst, timeout=300),
                    lambda: rig.agent.pull_shard_plan(ref, rplan, rdst, timeout=300),
                    setup.repeat)
                rows.append(dict(preset=preset, pair=pair, ref=f"TP {rp_tp} -> {rd_tp}",
                                 nbytes=plan.nbytes, regions=len(plan),
                                 ref_regions=len(rplan), s=t, ref_s=t_ref))
                assert plan.nbytes == rplan.nbytes
                rig.agent.deregister(dst)
                rig.agent.deregister(rdst)
                del dst, rdst
                rig.close_group(key)
    finally:
        rig.close()
    return rows


def negotiation(spec: KVSpec, repeat: int = 200) -> list[dict]:
    """Per case: the handshake's bytes (one prefill rank's message, without NIXL metadata,
    which a peer fetches from the listen port), and the median seconds of parsing the
    handshake of every prefill rank plus :func:`~kvabi.transfer.negotiate`; the first
    :meth:`~kvabi.transfer.Negotiation.cost` once."""
    from ..transfer.handshake import make_handshake, parse_handshake
    from ..transfer.negotiate import negotiate

    out = []
    L = NEGOTIATE_LAYERS
    for preset, p_tp, d_tp in (("flashinfer.HND", 1, 1), ("flashinfer.HND", 2, 1),
                               ("vllm.LBHNC", 1, 2), ("flash_attn", 4, 2)):
        srcs = [rank_layout(spec, preset, r, p_tp, 4096, L) for r in range(p_tp)]
        mine = rank_layout(spec, "flashinfer.NHD", 0, d_tp, 2048, L)
        msgs = [make_handshake(agent_name=f"prefill-rank{r}-0123abcd", host="10.0.0.17",
                               port=50000 + r, memory="VRAM", layout=lay,
                               planes=[(0x7F0000000000 + (i << 32), lay.plane_nbytes, r)
                                       for i in range(lay.num_planes)],
                               model="meta-llama/Llama-3.3-70B@6f6e")
                for r, lay in enumerate(srcs)]
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            n = negotiate(mine, [parse_handshake(m) for m in msgs])
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        c = n.cost()
        cost_s = time.perf_counter() - t
        out.append(dict(case=f"{preset} TP {p_tp} -> flashinfer.NHD TP {d_tp}",
                        planes=srcs[0].num_planes, bytes=max(len(m.encode()) for m in msgs),
                        ranks=p_tp, s=statistics.median(times), kind=n.kind,
                        cost_s=cost_s, regions_per_block=c.regions,
                        staging_bytes_per_block=c.staging_bytes))
    return out


def checksums(setup, spec: KVSpec, side_by_side) -> dict:
    """Seconds of :func:`~kvabi.transfer.checksum.kv_checksums` over one request (all
    layers, heads and tokens of a ``flashinfer.HND`` cache) and of a memcpy of the same
    bytes, timed alternately."""
    from ..transfer.checksum import kv_checksums

    lay = Layout.preset("flashinfer.HND", spec, setup.num_blocks, setup.layers)
    cache = KVCache.allocate(lay, "numpy", fill=1)
    slots = np.arange(setup.tokens) + (setup.num_blocks - setup.blocks) * spec.block_size
    nbytes = setup.layers * setup.tokens * 2 * spec.num_kv_heads * spec.head_dim * \
        spec.itemsize
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    t, t_ref = side_by_side(lambda: kv_checksums(cache, slots), lambda: np.copyto(b, a),
                            setup.repeat)
    return {"nbytes": nbytes, "s": t, "memcpy_s": t_ref}


def goals(fig: dict) -> list[tuple[str, bool | None, str]]:
    out = []
    x = fig.get("checksums")
    if x:
        gb = x["nbytes"] / 1e9
        out.append(("pull checksums cheap enough to leave on in tests", None,
                    f"{x['s'] * 1e3:.0f} ms for {x['nbytes'] >> 20} MiB = {gb / x['s']:.2f} "
                    f"GB/s (memcpy of the same bytes {gb / x['memcpy_s']:.2f} GB/s)"))
    for r in fig.get("tp_pulls", []):
        share = r["ref_s"] / r["s"]
        gb = r["nbytes"] / 1e9
        out.append((f"heterogeneous-TP pull >= 0.9x the same-TP pull of the same bytes "
                    f"({r['preset']}, {r['pair']} vs {r['ref']})", share >= 0.9,
                    f"{gb / r['s']:.2f} vs {gb / r['ref_s']:.2f} GB/s = {share:.2f}x "
                    f"({r['regions']} vs {r['ref_regions']} regions)"))
    if "tp_pulls" not in fig:
        out.append(("heterogeneous-TP pull >= 0.9x the same-TP pull", None,
                    "not measured (no nixl)"))
    for r in fig.get("negotiation", []):
        ok = r["s"] < 1e-3 and r["bytes"] < 4096
        out.append((f"negotiation + handshake < 1 ms and < 4 KiB, {NEGOTIATE_LAYERS} layers "
                    f"({r['case']})", ok,
                    f"{r['s'] * 1e3:.3f} ms for {r['ranks']} handshake(s) of {r['bytes']} "
                    f"bytes ({r['planes']} planes each), {r['kind']}; first cost(): "
                    f"{r['cost_s'] * 1e3:.1f} ms, {r['regions_per_block']} regions and "
                    f"{r['staging_bytes_per_block']} staging bytes per block"))
    return out


def measure(setup, spec, block_sets, side_by_side, *, nixl: bool, say,
            presets=PRESETS) -> dict:
    """``{"negotiation": rows, "tp_pulls": rows}`` (pulls only with ``nixl``)."""
    fig = {}
    say("negotiation + handshake of a 64-layer peer")
    fig["negotiation"] = negotiation(spec, repeat=20 if setup.repeat == 1 else 200)
    say("checksums of one request against a memcpy of the same bytes")
    fig["checksums"] = checksums(setup, spec, side_by_side)
    if nixl:
        say("heterogeneous-TP pulls against same-TP pulls of the same bytes")
        fig["tp_pulls"] = heterogeneous_pulls(setup, spec, block_sets, side_by_side,
                                              presets=presets, say=say)
    return fig

