"""NIXL transfers: two agents in one process (UCX loopback), and two real processes end to
end (cuda.triton on flashinfer.HND block 16 -> tpu.jax on tpu.combined block 32, or the
reference backend where those are unavailable).  Skipped, with the reason, without nixl."""
from __future__ import annotations

import base64
import json
import os
import pathlib
import subprocess
import sys
import time

import attrs
import numpy as np
import pytest

from kvabi import KVABIError, KVCache, KVSpec
from kvabi.layout.descriptor import Layout
from kvabi.transfer import TransferPlan, plan_block_transfer, plan_transfer
from kvabi.transfer import nixl as kv_nixl

ok, why = kv_nixl.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
HERE = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def agents():
    a, b = kv_nixl.NixlAgent("src-agent"), kv_nixl.NixlAgent("dst-agent")
    yield a, b
    a.close()
    b.close()


def _random(layout, seed, framework="numpy"):
    cache = KVCache.allocate(layout, "numpy")
    rng = np.random.default_rng(seed)
    for p in cache:
        p[...] = rng.standard_normal(p.shape).astype(p.dtype)
    if framework == "torch":
        import torch

        t = KVCache.allocate(layout, "torch")
        for p, q in zip(cache, t):
            q.copy_(torch.from_numpy(np.ascontiguousarray(p)))
        return t
    return cache


def _check_moved(src, dst, s, t):
    """Token ``s[i]`` of ``src`` (4-token blocks) is at slot ``t[i]`` of ``dst`` (8-token
    blocks) in every layer and K/V; every other destination slot is still zero."""
    for layer in range(2):
        for kv in range(2):
            got, want = _view(dst, layer, kv), _view(src, layer, kv)
            np.testing.assert_array_equal(got[t // 8, t % 8], want[s // 4, s % 4])
            rest = np.setdiff1d(np.arange(32), t)
            assert not got[rest // 8, rest % 8].any()


def _view(cache, layer, kv):
    v = cache.kv_view(layer, kv)
    return v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else v


@pytest.mark.parametrize("framework, staged", [("numpy", None), ("numpy", True),
                                               ("numpy", False), ("torch", True),
                                               ("torch", False)])
def test_pull_relayout_in_one_process(agents, framework, staged):
    if framework == "torch":
        pytest.importorskip("torch")
    a_agent, b_agent = agents
    src_l = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    dst_l = Layout.preset("kvbm.fully_contiguous", attrs.evolve(SPEC, block_size=8), 4, 2)
    src = a_agent.register(_random(src_l, 1, framework))
    dst = b_agent.register(KVCache.allocate(dst_l, framework))
    peer = b_agent.connect(a_agent.handshake(src))
    s = np.array([4, 5, 6, 7, 0, 1, 22])
    t = np.array([8, 9, 10, 11, 12, 13, 31])
    assert b_agent.pull(peer, dst, s, t, notify=b"kvabi.pull 1", staged=staged) is dst
    assert a_agent.wait_notification(b"kvabi.pull 1", timeout=10) == ("dst-agent",
                                                                        b"kvabi.pull 1")
    _check_moved(src, dst, s, t)


def test_metadata_in_the_message(agents):
    """The peer's metadata may travel in the handshake (no fetch from its listen port)."""
    a_agent, b_agent = agents
    lay = Layout.preset("vllm.BLNHC", SPEC, 4, 2)
    src = a_agent.register(_random(lay, 4))
    dst = b_agent.register(KVCache.allocate(lay, "numpy"))
    msg = json.loads(a_agent.handshake(src, include_metadata=True))
    assert msg["metadata"]
    msg["agent"]["port"] = kv_nixl.free_port()  # nobody listens there: unused
    peer = b_agent.connect(json.dumps(msg), timeout=30)
    b_agent.pull(peer, dst, [0, 1, 2, 3], [12, 13, 14, 15])
    for layer in range(2):
        for kv in range(2):
            np.testing.assert_array_equal(dst.kv_view(layer, kv)[3], src.kv_view(layer, kv)[0])
    msg["agent"]["name"] = "impostor"
    with pytest.raises(KVABIError, match="metadata: describes agent 'src-agent'"):
        b_agent.connect(json.dumps(msg), timeout=2)


def test_regions_checked_against_peer_planes_before_posting(agents):
    a_agent, b_agent = agents
    lay = Layout.preset("flash_attn", SPEC, 4, 1)
    src = a_agent.register(_random(lay, 2))
    dst = b_agent.register(KVCache.allocate(lay, "numpy"))
    peer = b_agent.connect(a_agent.handshake(src))
    plan = plan_transfer(lay, lay, [0, 1], [2, 3])
    evil = attrs.evolve(plan, regions=plan.regions + np.array([0, lay.plane_nbytes, 0, 0, 0]))
    with pytest.raises(KVABIError, match="src bytes .* outside plane"):
        b_agent.pull_plan(peer, evil, dst, timeout=5)
    assert not any(p.any() for p in dst)
    other = Layout.preset("flashinfer.NHD", SPEC, 4, 1)
    with pytest.raises(KVABIError, match="plan.src_layout: is not the peer's layout"):
        b_agent.pull_plan(peer, plan_transfer(other, lay, [0], [0]), dst)
    with pytest.raises(KVABIError, match="staged: an unstaged pull READs into dst"):
        b_agent.pull(peer, KVCache.allocate(lay, "numpy"), [0], [0], staged=False)
    with pytest.raises(KVABIError, match="plan: must be a TransferPlan"):
        b_agent.pull_plan(peer, plan.regions, dst)


def test_lying_peer_fails_cleanly(agents):
    """A peer whose message names memory it never registered: NIXL refuses the READ and
    the caller gets a KVABIError, with nothing reported done."""
    a_agent, b_agent = agents
    lay = Layout.preset("flash_attn", SPEC, 4, 1)
    src = a_agent.register(_random(lay, 3))
    dst = b_agent.register(KVCache.allocate(lay, "numpy"))
    msg = json.loads(a_agent.handshake(src, include_metadata=True))
    # passes kvabi's checks: the peer's claims are consistent
    msg["planes"]["address"] = [a + (1 << 40) for a in msg["planes"]["address"]]
    peer = b_agent.connect(json.dumps(msg))
    with pytest.raises(KVABIError, match="transfer: .*src-agent"):
        b_agent.pull(peer, dst, [0, 1], [0, 1], timeout=30)
    # Fetched from a known agent, metadata must hold the planes the message names.
    del msg["metadata"]
    with pytest.raises(KVABIError, match="did not answer within 1 s with metadata of the "
                                         "planes in its message"):
        b_agent.connect(json.dumps(msg), timeout=1)


def test_unreachable_peer(agents):
    _, b_agent = agents
    lay = Layout.preset("flash_attn", SPEC, 4, 1)
    src = kv_nixl.NixlAgent("lonely")
    try:
        src.register(KVCache.allocate(lay, "numpy"))
        msg = json.loads(src.handshake(src._regs[0][0]))
    finally:
        src.close()
    msg["agent"] = {"name": "nobody", "host": "127.0.0.1", "port": kv_nixl.free_port()}
    with pytest.raises(KVABIError, match="peer: agent 'nobody' at 127.0.0.1:.* did not answer"):
        b_agent.connect(json.dumps(msg), timeout=1.0)


def test_refused_handshakes_change_nothing(agents):
    """Messages naming a connected agent (or carrying its metadata) that are refused: at a
    dead port, with another agent's or stale or broken metadata.  The connected peers'
    NIXL metadata stays: pulls from them still deliver every byte."""
    a_agent, b_agent = agents
    lay = Layout.preset("flash_attn", SPEC, 4, 1)
    src = a_agent.register(_random(lay, 5))
    stale = json.loads(a_agent.handshake(src, include_metadata=True))["metadata"]
    peer = b_agent.connect(a_agent.handshake(src))
    src2 = a_agent.register(_random(lay, 6))  # planes the stale metadata does not hold
    peer2 = b_agent.connect(a_agent.handshake(src2))
    dst = b_agent.register(KVCache.allocate(lay, "numpy"))

    def pulls_still_work():
        for p, s in ((peer, src), (peer2, src2)):
            for q in dst:
                q[...] = 0
            b_agent.pull(p, dst, [0, 5], [9, 2], timeout=30)
            for kv in range(2):
                np.testing.assert_array_equal(dst.kv_view(0, kv)[[2, 0], [1, 2]],
                                              s.kv_view(0, kv)[[0, 1], [0, 1]])

    pulls_still_work()
    src3 = a_agent.register(_random(lay, 7))  # new planes: only a fresh fetch has them
    dead = json.loads(a_agent.handshake(src3))
    dead["agent"]["port"] = kv_nixl.free_port()
    with pytest.raises(KVABIError, match="peer: agent 'src-agent' at 127.0.0.1:.* did not "
                                         "answer"):
        b_agent.connect(json.dumps(dead), timeout=1.0)
    pulls_still_work()
    other = kv_nixl.NixlAgent("other-agent")
    try:
        other_md = other._agent.get_agent_metadata()
    finally:
        other.close()
    head = b"nixlSerDes|Agent" + len(b"src-agent").to_bytes(8, "little") + b"src-agent"
    for name, md, match in [
            ("impostor", base64.b64decode(stale), "metadata: describes agent 'src-agent', "
                                                  "the message names 'impostor'"),
            ("src-agent", other_md, "metadata: describes agent 'other-agent'"),
            ("src-agent", head + b"|Conns" + b"\xff" * 40, "peer: connecting to 'src-agent'"),
            ("src-agent", b"not nixl", "metadata: not NIXL agent metadata"),
            ("src-agent", head[:20], "metadata: not NIXL agent metadata")]:
        msg = json.loads(a_agent.handshake(src))
        msg["agent"]["name"] = name
        msg["metadata"] = base64.b64encode(md).decode()
        with pytest.raises(KVABIError, match=match):
            b_agent.connect(json.dumps(msg), timeout=2)
        pulls_still_work()
    assert not b_agent._agent.check_remote_metadata("other-agent")
    for c in (src, src2, src3):
        a_agent.deregister(c)
    b_agent.deregister(dst)


def test_metadata_agent_name():
    md = b"nixlSerDes|Agent" + (5).to_bytes(8, "little") + b"abcde|Conns..."
    assert kv_nixl.metadata_agent_name(md) == "abcde"
    for bad in (b"", md[:23], md[:26], b"nixlSerDes|Agent" + (2**63).to_bytes(8, "little"),
                b"nixlSerDes|Agent" + (0).to_bytes(8, "little") + b"x",
                b"nixlSerDes|Agent" + (1).to_bytes(8, "little") + b"\xff"):
        with pytest.raises(KVABIError, match="metadata: not NIXL agent metadata"):
            kv_nixl.metadata_agent_name(bad)


def test_refusals(agents):
    a_agent, b_agent = agents
    lay = Layout.preset("flash_attn", SPEC, 4, 1)
    with pytest.raises(KVABIError, match="cache: must be a KVCache"):
        a_agent.register([np.zeros(3)])
    with pytest.raises(KVABIError, match="not registered"):
        a_agent.handshake(KVCache.allocate(lay, "numpy"))
    with pytest.raises(KVABIError, match="agent.name: the peer has this agent's own name"):
        src = a_agent.register(KVCache.allocate(lay, "numpy"))
        a_agent.connect(a_agent.handshake(src))
    with pytest.raises(KVABIError, match="kvabi_abi: the peer speaks ABI 3.0"):
        d = json.loads(a_agent.handshake(src))
        d["kvabi_abi"] = [3, 0]
        b_agent.connect(json.dumps(d))
    stranger = kv_nixl.Peer(b_agent.connect(a_agent.handshake(src)).handshake)
    with pytest.raises(KVABIError, match="peer: not connected"):
        b_agent.pull_plan(stranger, plan_transfer(lay, lay, [0], [0]),
                          b_agent.register(KVCache.allocate(lay, "numpy")))
    with pytest.raises(KVABIError, match="timeout: must be > 0"):
        b_agent.connect(a_agent.handshake(src), timeout=0)
    # Arguments checked by name before anything is posted (were AttributeError, or a
    # NIXL type error after the plan was built, or silently truthy).
    peer = b_agent.connect(a_agent.handshake(src))
    dst = b_agent.register(KVCache.allocate(lay, "numpy"))
    with pytest.raises(KVABIError, match="^peer: not connected"):
        b_agent.pull(None, dst, [0], [0])
    for bad in (None, 5, ["x"]):
        with pytest.raises(KVABIError, match="^notify: must be bytes"):
            b_agent.pull(peer, dst, [0], [0], notify=bad)
    with pytest.raises(KVABIError, match="^prefix: must be bytes"):
        a_agent.wait_notification(5, timeout=0.01)
    with pytest.raises(KVABIError, match="^include_metadata: must be true or false"):
        a_agent.handshake(src, include_metadata="yes")
    for kw, match in ((dict(name="bad\nname"), "^name: must be 1-128 characters"),
                      (dict(name="ok", host="h\n"), "^host: must be a host name"),
                      (dict(name="ok", port="80"), "^port: must be an integer"),
                      (dict(name="ok", port=2**20), "^port: must be <= 65535")):
        with pytest.raises(KVABIError, match=match):
            kv_nixl.NixlAgent(**kw)
    assert not any(dst[0].ravel())
    assert isinstance(plan_transfer(lay, lay, [0], [0]), TransferPlan)


@pytest.mark.parametrize("staged", [None, False])
def test_jax_caches(agents, staged):
    """A jax CPU cache registers without a copy (a peer READs its buffer); a jax
    destination is pulled through the staging buffer and comes back as a new handle."""
    jnp = pytest.importorskip("jax.numpy")
    a_agent, b_agent = agents
    src_l = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    dst_l = Layout.preset("kvbm.fully_contiguous", attrs.evolve(SPEC, block_size=8), 4, 2)
    host = _random(src_l, 3)
    src = a_agent.register(host.replace([jnp.asarray(p) for p in host]))
    rows = a_agent._registration(src)[2]
    assert rows[0, 0] == src[0].unsafe_buffer_pointer()  # the array's own buffer
    peer = b_agent.connect(a_agent.handshake(src))
    s, t = np.array([4, 5, 6, 7, 0, 1, 22]), np.array([8, 9, 10, 11, 12, 13, 31])
    if staged is False:
        with pytest.raises(KVABIError, match="staged: an unstaged pull"):
            b_agent.pull(peer, KVCache.allocate(dst_l, "jax"), s, t, staged=False)
        return
    dst = KVCache.allocate(dst_l, "jax")
    out = b_agent.pull(peer, dst, s, t)
    assert out is not dst and out.framework == "jax"
    got = KVCache.wrap(dst_l, [np.asarray(p) for p in out])
    for layer in range(2):
        for kv in range(2):
            g, w = got.kv_view(layer, kv), host.kv_view(layer, kv)
            np.testing.assert_array_equal(g[t // 8, t % 8], w[s // 4, s % 4])
            rest = np.setdiff1d(np.arange(32), t)
            assert not np.asarray(g[rest // 8, rest % 8]).any()


def test_two_processes_end_to_end(tmp_path):
    """Process A writes a mixed batch's KV and serves it; process B pulls it over NIXL into
    another backend's layout (other block size: a slot-level relayout) and attends.  B's
    output must equal the reference backend's over the same tokens, and the pulled K/V the
    tokens themselves."""
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = str(HERE / "transfer_peer.py")
    serve = subprocess.Popen([sys.executable, script, "serve", str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pull = subprocess.run([sys.executable, script, "pull", str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=240)
        assert pull.returncode == 0, pull.stderr[-3000:]
        out, err = serve.communicate(timeout=60)
        assert serve.returncode == 0, err[-3000:]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    served = json.loads(out.strip().splitlines()[-1])
    pulled = json.loads(pull.stdout.strip().splitlines()[-1])
    assert served["notified_by"] == "decode" and pulled["peer"] == "prefill"
    r = np.load(tmp_path / "result.npz")
    np.testing.assert_allclose(r["out"], r["want"], rtol=1e-4, atol=1e-5)
    sys.path.insert(0, str(HERE))
    try:
        import transfer_peer as tp
    finally:
        sys.path.pop(0)
    kv, _ = tp.tokens()
    t = tp.slots(tp.TABLE_B, 32)
    seq = tp.CTX + tp.QLEN
    for layer in range(tp.LAYERS):
        for k in range(2):
            want = np.concatenate([kv[layer][i][k] for i in range(len(seq))])
            got = r["pulled"][layer, k][t // 32, t % 32]
            np.testing.assert_array_equal(got, want)
    print(f"served by {served['backend']}, attended by {pulled['backend']}, "
          f"{pulled['regions']} regions")


@pytest.mark.gpu
def test_vram_planes(agents):
    """CUDA planes register as VRAM with the same code; a DRAM peer pulls into them."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    a_agent, b_agent = agents
    lay = Layout.preset("flash_attn", SPEC, 4, 1)
    src = a_agent.register(_random(lay, 5))
    dst = b_agent.register(KVCache.allocate(lay, "torch", device="cuda"))
    assert b_agent._registration(dst)[3] == "VRAM"
    peer = b_agent.connect(a_agent.handshake(src))
    b_agent.pull(peer, dst, [0, 1, 2], [5, 6, 7])
    for kv in range(2):
        got = dst.kv_view(0, kv).cpu().numpy()
        np.testing.assert_array_equal(got[[1, 1, 1], [1, 2, 3]],
                                      src.kv_view(0, kv)[[0, 0, 0], [0, 1, 2]])


@pytest.mark.parametrize("staged", [None, False])
def test_pull_block_plan_staged(agents, staged):
    """A whole-block relayout plan pulled staged (the source blocks in their own byte order,
    then strided copies) or direct: the same tokens arrive, nothing else is written."""
    a_agent, b_agent = agents
    src_l = Layout.preset("flashinfer.HND", SPEC, 8, 2)
    dst_l = Layout.preset("tpu.combined", attrs.evolve(SPEC, block_size=8), 4, 2)
    src = a_agent.register(_random(src_l, 5))
    dst = b_agent.register(KVCache.allocate(dst_l, "numpy"))
    peer = b_agent.connect(a_agent.handshake(src))
    sb, db = [6, 1, 3, 2], [3, 0]
    plan = plan_block_transfer(src_l, dst_l, sb, db)
    assert plan.pattern is not None
    assert b_agent.pull_plan(peer, plan, dst, staged=staged) is dst
    # staged: the READ and the copies go by the pattern, the plan's regions never built
    assert plan.built == (staged is False)
    # what a pull posts: one descriptor per region direct, a few per plane staged
    n = b_agent.descriptors(peer, plan, dst, staged=staged)
    assert n == len(plan) if staged is False else 1 <= n < len(plan)
    same = plan_block_transfer(src_l, src_l, sb, sb)
    own = b_agent.register(KVCache.allocate(src_l, "numpy"))
    assert b_agent.descriptors(peer, same, own) == len(same)  # large regions: direct
    with pytest.raises(KVABIError, match="plan: must be a TransferPlan or ShardPlan"):
        b_agent.descriptors(peer, "plan", dst)
    with pytest.raises(KVABIError, match="peer: not connected"):
        b_agent.descriptors(object(), plan, dst)
    b_agent.deregister(own)
    s = (np.array(sb)[:, None] * 4 + np.arange(4)).ravel()
    t = (np.array(db)[:, None] * 8 + np.arange(8)).ravel()
    _check_moved(src, dst, s, t)


def test_connected_peer_cannot_be_changed(agents):
    """A Peer is trusted by identity at every pull: rebinding its layout or handshake, or
    writing its planes, is refused, so a pull cannot be redirected past the peer's
    registered planes (into a neighbouring cache the source registered: the guard here)."""
    a_agent, b_agent = agents
    small = Layout.preset("flash_attn", SPEC, 2, 1)
    big = Layout.preset("flash_attn", SPEC, 8, 1)
    src = a_agent.register(_random(small, 7))
    guard = a_agent.register(_random(big, 8))  # registered next to it: must never be read
    dst = b_agent.register(KVCache.allocate(big, "numpy"))
    peer = b_agent.connect(a_agent.handshake(src))
    wide = b_agent.connect(a_agent.handshake(guard))
    with pytest.raises(AttributeError):
        peer.layout = big
    with pytest.raises(AttributeError):
        peer.handshake = wide.handshake
    with pytest.raises(AttributeError):
        peer.handshake.planes = wide.handshake.planes
    rows = peer.handshake.planes
    with pytest.raises(ValueError):
        rows[:, 1] = big.plane_nbytes
    with pytest.raises(ValueError):  # not even through its base: an immutable buffer
        b = rows
        while isinstance(b, np.ndarray):
            b.flags.writeable = True
            b = b.base
    assert peer.layout == small and peer.name == "src-agent"
    assert (peer.handshake.plane_nbytes == small.plane_nbytes).all()
    with pytest.raises(KVABIError, match="handshake: must be a Handshake"):
        kv_nixl.Peer("src-agent")
    # A plan reaching beyond the peer's planes is refused before anything is posted.
    far = plan_transfer(big, big, [12, 13], [0, 1])
    with pytest.raises(KVABIError, match="plan.src_layout: is not the peer's layout"):
        b_agent.pull_plan(peer, far, dst)
    evil = attrs.evolve(plan_transfer(small, big, [0, 1], [0, 1]), src_layout=small)
    evil = attrs.evolve(evil, regions=evil.regions + np.array([0, small.plane_nbytes, 0, 0, 0]))
    with pytest.raises(KVABIError, match="src bytes .* outside plane"):
        b_agent.pull_plan(peer, evil, dst, timeout=5)
    assert not any(p.any() for p in dst)
    # The peer still serves exactly its own bytes.
    b_agent.pull(peer, dst, [0, 1, 6], [8, 9, 30], timeout=30)
    for kv in range(2):
        got, want = dst.kv_view(0, kv), src.kv_view(0, kv)
        np.testing.assert_array_equal(got[[2, 2, 7], [0, 1, 2]], want[[0, 0, 1], [0, 1, 2]])
        assert not np.delete(got.reshape(32, -1), [8, 9, 30], axis=0).any()


class _Guard:
    """Counts entries; refuses them once ``abandoned``."""

    def __init__(self, abandoned=False):
        self.abandoned, self.entered = abandoned, 0

    def __enter__(self):
        if self.abandoned:
            raise KVABIError("pull: abandoned")
        self.entered += 1

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("dst_preset", ["kvbm.fully_contiguous", "flashinfer.HND"])
def test_guarded_pull_copies_under_the_guard_and_never_after_it_refuses(agents, dst_preset):
    """A guarded pull is staged: its bytes reach dst only inside the guard; a guard that
    refuses (the caller gave up) leaves dst untouched although the READ completed."""
    a_agent, b_agent = agents
    src_l = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    dst_l = Layout.preset(dst_preset, attrs.evolve(SPEC, block_size=8), 4, 2)
    src = a_agent.register(_random(src_l, 7))
    dst = b_agent.register(KVCache.allocate(dst_l, "numpy"))
    peer = b_agent.connect(a_agent.handshake(src))
    s, t = np.array([4, 5, 6, 7, 0, 1, 22]), np.array([8, 9, 10, 11, 12, 13, 31])
    with pytest.raises(KVABIError, match="abandoned"):
        b_agent.pull(peer, dst, s, t, notify=b"kvabi.guard 0", guard=_Guard(abandoned=True))
    assert a_agent.wait_notification(b"kvabi.guard 0", timeout=10)[1] == b"kvabi.guard 0"
    assert not any(np.asarray(p).any() for p in dst)  # the READ landed in staging only
    g = _Guard()
    b_agent.pull(peer, dst, s, t, notify=b"kvabi.guard 1", guard=g)
    assert g.entered == 1
    _check_moved(src, dst, s, t)
    with pytest.raises(KVABIError, match="staged: a guarded pull is staged"):
        b_agent.pull(peer, dst, s, t, guard=_Guard(), staged=False)


def test_drain_notifications_takes_every_message_once(agents):
    a_agent, b_agent = agents
    lay = Layout.preset("vllm.BLNHC", SPEC, 4, 2)
    src = a_agent.register(_random(lay, 8))
    dst = b_agent.register(KVCache.allocate(lay, "numpy"))
    peer = b_agent.connect(a_agent.handshake(src))
    b_agent.pull(peer, dst, [0], [1], notify=b"drain 0")
    a_agent.wait_notification(b"drain 0", timeout=10)
    a_agent.drain_notifications()  # what earlier tests left
    for note in (b"drain 1", b"kvabi.pull:x"):
        b_agent.pull(peer, dst, [0], [1], notify=note)
    got = []
    for _ in range(2000):
        got += a_agent.drain_notifications()
        if len(got) >= 2:
            break
        time.sleep(0.005)
    assert sorted(m for _, m in got) == [b"drain 1", b"kvabi.pull:x"]
    assert {s for s, _ in got} == {"dst-agent"}
    assert a_agent.drain_notifications() == []


def test_disconnect_forgets_the_peer():
    a, b = kv_nixl.NixlAgent("disc-src"), kv_nixl.NixlAgent("disc-dst")
    try:
        lay = Layout.preset("vllm.BLNHC", SPEC, 4, 2)
        src = a.register(_random(lay, 9))
        dst = b.register(KVCache.allocate(lay, "numpy"))
        msg = a.handshake(src, include_metadata=True)
        p1, p2 = b.connect(msg), b.connect(msg)
        b.disconnect(p1)
        b.pull(p2, dst, [0], [1])  # the agent's other peer still works
        with pytest.raises(KVABIError, match="not connected"):
            b.pull(p1, dst, [0], [1])
        b.disconnect(p2)
        with pytest.raises(KVABIError, match="not connected"):
            b.disconnect(p2)
        p3 = b.connect(msg)  # the metadata is loaded again
        b.pull(p3, dst, [2], [3])
    finally:
        a.close()
        b.close()


def test_an_agent_whose_picked_port_was_taken_meanwhile_picks_another(monkeypatch):
    """A port picked free may be taken by another process before NIXL binds it (servers
    starting at once): the agent picks again; a port the caller gave is refused, naming it."""
    import socket

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real, picks = kv_nixl.free_port, []

    def pick(host="127.0.0.1"):
        picks.append(port if not picks else real(host))
        return picks[-1]
    monkeypatch.setattr(kv_nixl, "free_port", pick)
    try:
        agent = kv_nixl.NixlAgent("retry-port")
        assert len(picks) == 2 and agent.port == picks[1] != port
        agent.close()
        with pytest.raises(KVABIError, match=rf"^nixl: could not create agent 'given-port' "
                                             rf"listening on 127\.0\.0\.1:{port}: "):
            kv_nixl.NixlAgent("given-port", port=port)
    finally:
        taken.close()
