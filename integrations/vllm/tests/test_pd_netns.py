"""P/D between two hosts: a vLLM prefill engine in one network namespace, a decode engine in
another, joined by a veth pair the test makes (``kvabi.bench.netns``: private addresses of
its own namespaces only), KvabiConnector's NIXL agents listening on the veth addresses and
UCX on TCP as between two machines.  The decode side's greedy tokens equal the decode engine
computing alone, across backends, layouts and block sizes.

The short test (``make test-vllm``) runs one pair; the long one (``make thorough-vllm``)
runs layout pairs each over the veth and over loopback, and prints the per-request pull
figures side by side.  Skipped with the reason where namespaces cannot be made (not root,
no iproute2).  The namespaces are removed whatever happens."""
from __future__ import annotations

import os
import statistics

import pytest

from kvabi.bench import netns
from kvabi_vllm.tools.checkpoints import distinct_tokens, prompts, write_checkpoint
from kvabi_vllm.tools.pd import KVABI_DECODE, run_pair

LONG = os.environ.get("KVABI_HYPOTHESIS_PROFILE") == "thorough"
#: prefill on vLLM's CPU backend (LBHNC, 32-token blocks); decode sides
SAME = {"block_size": 32}
CROSS = KVABI_DECODE  # kvabi's example.torch backend, cross-layer BLHNC, 64-token blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _on(pair, side: str, conf: dict) -> dict:
    """``conf`` run inside namespace ``side``: NIXL listening on its veth address, UCX on
    TCP over its veth."""
    return {**conf, "prefix": pair.command(side, []),
            "env": {**conf.get("env", {}), **pair.env(side)},
            "extra": {**conf.get("extra", {}), "nixl_host": pair.addr[side]}}


def _pd(model, work, ps, prefill, decode, pair=None):
    if pair is not None:
        prefill, decode = _on(pair, "a", prefill), _on(pair, "b", decode)
    return run_pair(model, ps, work, prefill=prefill, decode=decode, max_tokens=8,
                    timeout=600)


def _check(r, n):
    assert len(r["pulls"]) == n and all(p[3] > 0 for p in r["pulls"]), r["pulls"]
    assert distinct_tokens(r["single"]) > 1  # varied tokens: the comparison shows something
    assert r["pd"] == r["single"], (r["pd"], r["single"])


def test_pd_between_two_hosts(model, tmp_path):
    """Prefill on vLLM's CPU backend (LBHNC, 32-token blocks) in namespace a, decode on
    kvabi's example.torch (cross-layer BLHNC, 64-token blocks) in namespace b: the KV moves
    over TCP on the veth (a relayout) and the decode tokens equal the single engine's."""
    ps = prompts(2, lengths=(37, 70), shared_prefix=0)
    with netns.VethPair() as pair:
        r = _pd(model, tmp_path / "pd", ps, SAME, CROSS, pair)
    assert not pair.exists()
    _check(r, len(ps))


@pytest.mark.skipif(not LONG, reason="long: run by make thorough-vllm")
@pytest.mark.parametrize("decode", [SAME, CROSS], ids=["same-layout", "relayout"])
def test_pd_two_hosts_beside_loopback(model, tmp_path, decode):
    """Each layout pair over the veth and over loopback: equal tokens both ways; the
    per-request pull figures (median seconds from the decode side's pull start to the bytes
    in place, and of its READs) printed side by side."""
    ps = prompts(4, lengths=(37, 70, 100, 260), shared_prefix=0)
    with netns.VethPair() as pair:
        veth = _pd(model, tmp_path / "veth", ps, SAME, decode, pair)
    assert not pair.exists()
    lo = _pd(model, tmp_path / "lo", ps, SAME, decode)
    for r in (veth, lo):
        _check(r, len(ps))
    line = []
    for name, r in (("veth TCP", veth), ("loopback", lo)):
        secs = statistics.median(p[1] for p in r["pulls"])
        reads = statistics.median(p[4] for p in r["pulls"])
        kib = sum(p[3] for p in r["pulls"]) / len(r["pulls"]) / 1024
        line.append(f"{name}: pull {secs * 1e3:.1f} ms, READs {reads * 1e3:.1f} ms "
                    f"({kib:.0f} KiB per request)")
    print(f"\nLBHNC/32 -> {decode.get('env', {}).get('VLLM_KV_CACHE_LAYOUT', 'LBHNC')}/"
          f"{decode['block_size']}: " + "; ".join(line))
