"""KV between two hosts: a prefill engine's ranks in one network namespace, a decode rank in
another, joined by a veth pair the test makes (private addresses of its own namespaces only),
NIXL over UCX's TCP transport on the veth as between two machines (``kvabi.bench.netns``).
The decode rank pulls the request across layouts, block sizes and TP sizes; every byte is
checked against the model's KV (``shard_oracle``) and the serving ranks' checksums.

The short test runs in ``make test``; the long one (``make thorough``) pulls 16 MiB and
prints its figures beside loopback's (a second group on the decode rank's host, through an
agent with UCX's defaults), timed alternately.  Skipped with the reason where namespaces
cannot be made (not root, no iproute2) or without nixl.  Namespaces and the veth are removed
whatever happens."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from kvabi.bench import netns
from kvabi.transfer.nixl import available

HERE = pathlib.Path(__file__).parent
PEER = str(HERE / "netns_peer.py")
ok, why = available()
pytestmark = pytest.mark.skipif(not ok, reason=why)
LONG = os.environ.get("KVABI_HYPOTHESIS_PROFILE") == "thorough"


@pytest.fixture(scope="module")
def can_make():
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")


def _env(extra):
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return {**base, "PYTHONPATH": path, **extra}


def _run(pair, tmp, size, repeat, loopback=False):
    """Serve a TP 2 group in namespace a (and, with ``loopback``, another in b), pull from
    namespace b; the puller's result."""
    groups = [(tmp / "veth", "a", pair.addr["a"], pair.env("a"))]
    if loopback:
        groups.append((tmp / "lo", "b", "127.0.0.1", {}))
    procs = []
    for d, side, host, env in groups:
        d.mkdir()
        log = open(d / "serve.log", "w")
        procs.append((subprocess.Popen(
            pair.command(side, [sys.executable, PEER, "serve", d, 2, host, size]),
            env=_env(env), stdout=log, stderr=subprocess.STDOUT), log))
    out = tmp / "result.json"
    try:
        got = subprocess.run(
            pair.command("b", [sys.executable, PEER, "pull", out, pair.addr["b"], size,
                               repeat] + [d for d, *_ in groups]),
            env=_env(pair.env("b")), capture_output=True, text=True, timeout=600)
        logs = "".join((d / "serve.log").read_text() for d, *_ in groups)
        assert got.returncode == 0, (f"the decode rank failed:\n{got.stderr[-4000:]}\n"
                                     f"prefill ranks:\n{logs[-3000:]}")
        for p, _ in procs:
            p.wait(timeout=60)  # they stop once the puller is done (or at their timeout)
        return json.loads(out.read_text())
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()


def test_pd_pull_between_two_hosts(can_make, tmp_path):
    """TP 2 (flashinfer.NHD, 16-token blocks) in namespace a -> TP 1 (flashinfer.HND,
    32-token blocks) in namespace b over TCP on the veth: every byte as the model's KV,
    checksums equal; the namespaces are gone afterwards."""
    with netns.VethPair() as pair:
        r = _run(pair, tmp_path, "short", 1)
    assert not pair.exists()
    assert r["nbytes"] > 0 and len(r["best_s"]) == 1 and r["descriptors"][0] >= 1


@pytest.mark.skipif(not LONG, reason="long: run by make thorough")
def test_pd_pull_figures_beside_loopback(can_make, tmp_path):
    """16 MiB, best of 5, timed alternately: over the veth (TCP, as between two machines)
    and over loopback (UCX's defaults on one host: shared memory)."""
    with netns.VethPair() as pair:
        r = _run(pair, tmp_path, "long", 5, loopback=True)
    assert not pair.exists()
    veth, lo = r["best_s"]
    gb = r["nbytes"] / 1e9
    print(f"\nTP 2 flashinfer.NHD/16 -> TP 1 flashinfer.HND/32, {r['nbytes'] >> 20} MiB: "
          f"veth TCP {gb / veth:.2f} GB/s ({r['descriptors'][0]} descriptors), loopback "
          f"{gb / lo:.2f} GB/s ({r['descriptors'][1]} descriptors): {lo / veth:.2f}x")


def test_namespaces_removed_on_failure_and_after_a_killed_run(can_make):
    """A pair whose body raises is removed; namespaces of this module whose creating
    process is gone (a killed run) are removed by the next pair."""
    with pytest.raises(RuntimeError, match="inside"):
        with netns.VethPair() as pair:
            assert pair.exists()
            raise RuntimeError("inside")
    assert not pair.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = f"kvabi-{int(dead.stdout)}-0a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netns.VethPair():
            pass
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in names.split()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
