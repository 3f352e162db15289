"""Transfers between shardings over NIXL, across processes: prefill ranks each in their own
process (``shard_peer.py``), decode ranks as several NIXL agents here.  Each decode rank
pulls from every prefill rank that holds its heads; its bytes equal the model's KV of its
global heads (the same-TP reference, from ``shard_oracle``), guards untouched, per-chunk
checksums compared.  Fault injection: ranks swapped, a shard lying about its heads, a
fingerprint not its descriptor's, bytes changed after their sums, a peer killed before and
during a pull; each is detected before wrong bytes are used, within the stated timeout.
Skipped, with the reason, without nixl."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import attrs
import numpy as np
import pytest

from kvabi import KVABIError, KVCache
from kvabi.model.shard import Shard
from kvabi.transfer import nixl as kv_nixl
from kvabi.transfer.checksum import KVChecksums
from kvabi.transfer.handshake import make_handshake, parse_handshake
from shard_oracle import check_components, check_rank, component_cache, guarded_cache
from shard_peer import CASES, LAYERS, TOKENS, content, layout, slots

ok, why = kv_nixl.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

HERE = pathlib.Path(__file__).parent
#: every pull here must end (done or refused) within this many seconds
PULL_TIMEOUT = 10.0
#: decode side: case -> (preset, block size)
DECODE = {"gqa": ("flashinfer.HND", 8), "replicated": ("kvbm.fully_contiguous", 4),
          "mla": ("vllm.BLHNC", 8), "corrupt": ("flashinfer.HND", 8),
          "int8": ("vllm.int8_per_token_head", 8)}
DECODE_BLOCKS = 6


class Group:
    """The prefill ranks of one tensor-parallel engine, one process each."""

    def __init__(self, tmp, tp):
        self.dir, self.tp = tmp, tp
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE), os.environ.get("PYTHONPATH", "")]))
        self.procs = [subprocess.Popen([sys.executable, str(HERE / "shard_peer.py"), "serve",
                                        str(tmp), str(r), str(tp)], env=env)
                      for r in range(tp)]
        self.ranks = None

    def ready(self):
        if self.ranks is None:
            self.ranks = [self._wait(r) for r in range(self.tp)]
        return self

    def _wait(self, r):
        path = self.dir / f"rank{r}.json"
        deadline = time.monotonic() + 120
        while not path.exists():
            if time.monotonic() > deadline or self.procs[r].poll() is not None:
                raise RuntimeError(f"prefill rank {r} did not start")
            time.sleep(0.05)
        return json.loads(path.read_text())

    def messages(self, case):
        return [r[case]["handshake"] for r in self.ranks]

    def sums(self, case):
        return [KVChecksums.from_json(r[case]["sums"]) for r in self.ranks]

    def notes(self, r):
        path = self.dir / f"rank{r}.notes"
        return path.read_text().split("\n")[:-1] if path.exists() else []

    def stop(self):
        for p in self.procs:  # they hold nothing that outlives them: no graceful exit
            p.kill()
            p.wait(timeout=60)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Prefill TP 2 and TP 1, started together (a NIXL agent takes seconds to start)."""
    started = {tp: Group(tmp_path_factory.mktemp(f"tp{tp}"), tp) for tp in (1, 2)}
    yield {tp: g.ready() for tp, g in started.items()}
    for g in started.values():
        g.stop()


@pytest.fixture(scope="module")
def decode_agents(groups):
    """Two NIXL agents in this process for the decode ranks (rank r uses agent r % 2)."""
    agents = [kv_nixl.NixlAgent(f"decode-a{r}-{os.getpid()}") for r in range(2)]
    yield agents
    for a in agents:
        a.close()


def _dst(case, rank, tp):
    kind, heads, _, _ = CASES[case]
    preset, bs = DECODE[case]
    lay = layout(preset, kind, heads, rank, tp, bs, DECODE_BLOCKS)
    return lay, slots(bs, DECODE_BLOCKS, 1)


@pytest.mark.parametrize("case", ["gqa", "replicated", "mla"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (2, 4), (1, 2), (2, 2)])
def test_decode_ranks_pull_their_heads(groups, decode_agents, case, prefill_tp, decode_tp):
    group = groups[prefill_tp]
    kind, heads, _, p_bs = CASES[case]
    src_slots = slots(p_bs, 8, 0)
    for rank in range(decode_tp):
        agent = decode_agents[rank % 2]
        peers = [agent.connect(m, timeout=30) for m in group.messages(case)]
        lay, dst_slots = _dst(case, rank, decode_tp)
        bufs, dst = guarded_cache(lay)
        before = [b.copy() for b in bufs]
        note = f"kvabi.pull {case} {prefill_tp}>{decode_tp} r{rank}".encode()
        out = agent.pull_shards(peers, dst, src_slots, dst_slots, timeout=PULL_TIMEOUT,
                                notify=note, checksums=group.sums(case))
        assert out is dst
        check_rank(bufs, before, lay, content(case), range(LAYERS), dst_slots)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_component_layouts_pull_with_their_scales(groups, decode_agents, prefill_tp,
                                                  decode_tp):
    """int8 codes and their float32 scales per (token, head), another block size on each
    side: every unit of every component is the model's record of its global head, and the
    checksums (over every component) agree."""
    group = groups[prefill_tp]
    src_slots = slots(CASES["int8"][3], 8, 0)
    srcs = [parse_handshake(m).layout for m in group.messages("int8")]
    for rank in range(decode_tp):
        agent = decode_agents[rank % 2]
        peers = [agent.connect(m, timeout=30) for m in group.messages("int8")]
        lay, dst_slots = _dst("int8", rank, decode_tp)
        bufs, dst = component_cache(lay)
        before = [b.copy() for b in bufs]
        agent.pull_shards(peers, dst, src_slots, dst_slots, timeout=PULL_TIMEOUT,
                          checksums=group.sums("int8"))
        check_components(bufs, before, lay, content("int8"), range(LAYERS), dst_slots, srcs)


def test_every_prefill_rank_is_notified(groups, decode_agents):
    """A decode rank notifies every prefill rank of the group, read or not (a replica
    another rank reads learns that its blocks are free too)."""
    group = groups[2]
    agent = decode_agents[0]
    peers = [agent.connect(m, timeout=30) for m in group.messages("mla")]
    lay, dst_slots = _dst("mla", 0, 1)
    _, dst = guarded_cache(lay)
    agent.pull_shards(peers, dst, slots(4, 8, 0), dst_slots, notify=b"kvabi.pull note",
                      timeout=PULL_TIMEOUT)
    deadline = time.monotonic() + PULL_TIMEOUT
    while any("kvabi.pull note" not in group.notes(r) for r in range(2)):
        assert time.monotonic() < deadline, [group.notes(r) for r in range(2)]
        time.sleep(0.02)


def test_a_plain_notification_reaches_the_rank_named(groups, decode_agents):
    """NixlAgent.notify: a message without a READ, to one rank only; bad input refused."""
    group = groups[2]
    agent = decode_agents[0]
    peers = [agent.connect(m, timeout=30) for m in group.messages("mla")]
    agent.notify(peers[1], "kvabi.pull gave up")
    deadline = time.monotonic() + PULL_TIMEOUT
    while "kvabi.pull gave up" not in group.notes(1):
        assert time.monotonic() < deadline, group.notes(1)
        time.sleep(0.02)
    assert "kvabi.pull gave up" not in group.notes(0)
    with pytest.raises(KVABIError, match="^peer: must be a connected Peer, got str"):
        agent.notify("rank1", b"x")
    with pytest.raises(KVABIError, match="^message: must be bytes"):
        agent.notify(peers[0], 7)


# -- fault injection ---------------------------------------------------------------------------
def _retold(message, **shard):
    """The handshake as a consistent liar would send it: the shard changed and the
    fingerprint recomputed, so every field agrees with every other."""
    h = parse_handshake(message)
    lay = attrs.evolve(h.layout, shard=attrs.evolve(h.layout.shard, **shard))
    return make_handshake(agent_name=h.agent_name, host=h.host, port=h.port,
                          memory=h.memory, layout=lay,
                          planes=[tuple(p) for p in h.planes.tolist()])


def _pull(agent, messages, case="gqa", **kw):
    peers = [agent.connect(m, timeout=30) for m in messages]
    lay, dst_slots = _dst(case, 0, 1)
    bufs, dst = guarded_cache(lay)
    return agent.pull_shards(peers, dst, slots(CASES[case][3], 8, 0), dst_slots,
                             timeout=PULL_TIMEOUT, **kw)


def test_ranks_swapped(groups, decode_agents):
    with pytest.raises(KVABIError, match=r"src_layouts\[0\].shard.rank: says rank 1 at "
                                         r"position 0 \(ranks swapped\?\)"):
        _pull(decode_agents[0], groups[2].messages("gqa")[::-1])


def test_a_shard_lying_about_its_heads(groups, decode_agents):
    msgs = groups[2].messages("gqa")
    liar = _retold(msgs[1], heads=(0, 1))  # rank 1 says it holds rank 0's heads
    with pytest.raises(KVABIError, match=r"src_layouts\[1\].shard.heads: rank 1 of 2 holds "
                                         r"\[2, 3\] of 4 heads, it says \[0, 1\]"):
        _pull(decode_agents[0], [msgs[0], liar])
    with pytest.raises(KVABIError, match=r"src_layouts\[1\].shard.rank: says rank 0"):
        _pull(decode_agents[0], [msgs[0], _retold(msgs[1], rank=0)])


def test_a_fingerprint_that_is_not_its_descriptors(groups, decode_agents):
    d = json.loads(groups[2].messages("gqa")[1])
    d["layout"]["shard"]["heads"] = [0, 1]  # the descriptor changed, its label did not
    with pytest.raises(KVABIError, match="fingerprint: the message says kv2:"):
        decode_agents[0].connect(json.dumps(d), timeout=5)


def test_bytes_changed_after_their_sums(groups, decode_agents):
    with pytest.raises(KVABIError, match="checksum: global head .* differ from rank"):
        _pull(decode_agents[1], groups[2].messages("corrupt"), case="corrupt",
              checksums=groups[2].sums("corrupt"))


def _scaled(message, kv_scales):
    """The handshake as the rank would send it for a per-tensor quantized cache."""
    h = parse_handshake(message)
    return make_handshake(agent_name=h.agent_name, host=h.host, port=h.port,
                          memory=h.memory, layout=h.layout,
                          planes=[tuple(p) for p in h.planes.tolist()], kv_scales=kv_scales)


SCALES = [(0.25, 0.5), (0.125, 0.75)]  # per layer (k_scale, v_scale)


def test_kv_scales_compared_per_rank_before_any_byte_moves(groups, decode_agents):
    msgs = groups[2].messages("gqa")
    agent = decode_agents[1]
    lay, dst_slots = _dst("gqa", 0, 1)
    src_slots = slots(CASES["gqa"][3], 8, 0)
    # every rank under this cache's scales: pulled, bytes as the model's
    peers = [agent.connect(_scaled(m, SCALES), timeout=30) for m in msgs]
    bufs, dst = guarded_cache(lay)
    before = [b.copy() for b in bufs]
    agent.pull_shards(peers, dst, src_slots, dst_slots, timeout=PULL_TIMEOUT,
                      kv_scales=SCALES)
    check_rank(bufs, before, lay, content("gqa"), range(LAYERS), dst_slots)
    other = [SCALES[0], (0.125, 1.5)]
    cases = [  # (the ranks' scales, this cache's, the refusal)
        ([SCALES, other], SCALES, r"^peers\[1\]\.kv_scales\[1\]\.v_scale: the peer's codes "
                                  r"are under 1\.5, this cache reads them with 0\.75"),
        ([SCALES, SCALES], None, r"^peers\[0\]\.kv_scales: one side stores codes under "
                                 r"static scales and this cache has none"),
        ([None, None], SCALES, r"^peers\[0\]\.kv_scales: .* the peer's cache has none"),
    ]
    for theirs, ours, match in cases:
        peers = [agent.connect(_scaled(m, sc), timeout=30) for m, sc in zip(msgs, theirs)]
        bufs, dst = guarded_cache(lay)
        before = [b.copy() for b in bufs]
        with pytest.raises(KVABIError, match=match):
            agent.pull_shards(peers, dst, src_slots, dst_slots, timeout=PULL_TIMEOUT,
                              kv_scales=ours)
        assert all(np.array_equal(b, o) for b, o in zip(bufs, before))  # nothing moved


def test_a_peer_killed_before_and_during_a_pull(groups, decode_agents):
    """Last in this module: it kills prefill TP 1's process.  Killed while READs are in
    flight, the pull either completed before the kill (its checksums match) or raises,
    never returns wrong bytes; killed before the pull, it raises a KVABIError within the
    timeout, never hangs."""
    group = groups[1]
    agent = decode_agents[0]
    peers = [agent.connect(m, timeout=30) for m in group.messages("gqa")]
    lay, dst_slots = _dst("gqa", 0, 1)
    src_slots = slots(4, 8, 0)
    sums = group.sums("gqa")
    killer = threading.Timer(0.002, group.procs[0].send_signal, (signal.SIGKILL,))
    killer.start()
    try:
        for _ in range(200):  # pulls until one meets the dead rank
            bufs, dst = guarded_cache(lay)
            before = [b.copy() for b in bufs]
            agent.pull_shards(peers, dst, src_slots, dst_slots, timeout=PULL_TIMEOUT,
                              checksums=sums)
            check_rank(bufs, before, lay, content("gqa"), range(LAYERS), dst_slots)
    except KVABIError as e:
        assert "transfer:" in str(e)
    else:
        pytest.fail("200 pulls from a killed rank all succeeded")
    finally:
        killer.join()
    group.procs[0].wait(timeout=10)
    t1 = time.monotonic()
    with pytest.raises(KVABIError, match="transfer: "):
        _, dst = guarded_cache(lay)
        agent.pull_shards(peers, dst, src_slots, dst_slots, timeout=PULL_TIMEOUT)
    assert time.monotonic() - t1 < PULL_TIMEOUT + 5
