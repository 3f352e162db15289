"""P/D under attack, between two vLLM processes over NIXL (``kvabi_vllm.tools.pd_guard``,
the run of ``kvabi-vllm guard``): prefill on vLLM's CPU backend (LBHNC, 32-token blocks,
keys stored transposed), decode on the kvabi backend example.torch (cross-layer BLHNC,
64-token blocks) with a host tier.  For each
class of issue 23, the attacked request fails with its reason, the honest requests beside
it get their single-engine tokens, and the engine serves the next request; the tables of
both engines are empty again after, and the prefill engine's blocks all come back.

One pair of engines serves every test here (a module fixture): the decode process runs
its phases once and every test reads what it wrote."""
import re

import pytest

from kvabi_vllm.tools.pd_guard import ATTACKS as TRIED
from kvabi_vllm.tools.pd_guard import HONEST, PULL_TIMEOUT, attack_pair, summary


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return attack_pair(tmp_path_factory.mktemp("guard"))


def _tokens(run, rid):
    return run["results"][rid][0]


def _finish(run, rid):
    return run["results"][rid][1]


def test_honest_requests_beside_attacks_get_their_single_engine_tokens(run):
    assert min(len(set(run["single"][r])) for r in HONEST) > 1, "degenerate continuations"
    for rid in HONEST:
        assert _finish(run, rid) == "length", (rid, run["reasons"].get(rid))
        assert _tokens(run, rid) == run["single"][rid], rid
    # the decode side really ran the kvabi backend's cross-layer layout, read as K and V
    (g0,) = run["layouts"]
    assert "@vllm.BLHNC" in g0["kv"] and {"k", "v"} <= set(g0)
    pulled = {p[0].rsplit("-", 1)[0] for p in run["pulls"]}
    assert {"h1", "h2", "long", "v1", "v2", "after"} <= pulled
    assert all(p[2] > 0 and p[3] > 0 for p in run["pulls"])  # regions, bytes


#: attacked request -> the field its refusal names
ATTACKS = {
    # one request must not kill the decode engine: malformed parameters
    "a-missing": r"kvabi_grant: missing",
    "a-type": r"remote_block_ids: must list 1 KV cache groups, got str",
    "a-empty": r"kvabi_handshakes: must list 1 KV cache groups, got 0",
    "a-nested": r"remote_block_ids\[0\]: must list the 3 blocks",
    "a-notobject": r"kv_transfer_params: must be an object, got list",
    # wrong tokens with a normal finish: ids that are null, repeated, short, negative,
    # beyond int64, another request's, another request's grant; a shorter prompt
    "a-null": r"remote_block_ids\[0\]\[0\]: the null block",
    "a-repeated": r"remote_block_ids\[0\]: block \d+ appears twice",
    "a-short": r"remote_block_ids\[0\]: must list the 3 blocks .* got 2",
    "a-negative": r"remote_block_ids\[0\]\[0\]: must be >= 0",
    "a-int64": r"remote_block_ids\[0\]\[0\]: must be <= \d+",
    "a-otherids": r"remote_block_ids\[0\]: not the blocks the producer holds for this grant",
    "a-othergrant": r"kvabi_grant: issued for other tokens than this request's prompt",
    "a-forgednonce": r"kvabi_grant: slot \d+ holds another request's grant",
    "a-shorterprompt": r"remote_num_tokens: 70 exceeds this request's prompt of 69",
    # lying peers: a plane shifted, keys and values swapped, a tile order misstated, and
    # bytes changed on the way (the negative control's connector corrupts one block)
    "a-shifted": r"kvabi_handshakes\[0\]\.kv?: its planes .* are not the ones the producer",
    "a-swapped": r"kvabi_handshakes\[0\]\.kv?: its layout is not the one the producer",
    "a-tileorder": r"kvabi_handshakes\[0\]\.kv?: its layout is not the one the producer",
    "corrupt-1": r"kvabi_grant: the KV read for token \d+ of group 0 is not what the "
                 r"producer computed",
    # replays
    # (refused by the producer's record, or by this engine's memory of the grants it used)
    "replay": r"kvabi_grant: (already read|already used by request h1-)",
    # an unreachable producer
    "ghost": r"peer: agent 'kvabi-ghost' .* did not answer within",
}


def test_the_command_names_every_attack_and_says_every_rule_held(run):
    """``kvabi-vllm guard``'s summary over the same run: a line per request, all held."""
    assert set(ATTACKS) | {"frozen"} == set(TRIED)
    lines, ok = summary(run)
    assert ok, "\n".join(lines)
    for rid in set(TRIED) | set(HONEST):
        assert any(line.startswith(f"{rid} ") for line in lines), rid


@pytest.mark.parametrize("rid", sorted(ATTACKS))
def test_each_attacked_request_fails_with_its_reason(run, rid):
    assert _finish(run, rid) == "error", (rid, run["results"][rid])
    assert _tokens(run, rid) == []
    assert re.search(ATTACKS[rid], run["reasons"][rid]), run["reasons"][rid]
    assert re.search(re.escape(f"request {rid}"), run["log"])  # logged with the reason


def test_a_longer_decode_prompt_pulls_the_prefix_and_computes_the_rest(run):
    assert _tokens(run, "long") == run["single"]["long"]


def test_forged_notifications_free_nothing(run):
    """Three notifications naming the victims' grant slots with wrong nonces (one of them
    another live grant's) reached the producer; it ignored them and still held the
    victims' blocks, which the victims then read."""
    state = run["prefill_after_forged"]
    assert state["ignored"] >= 3
    assert state["held"] >= 2
    assert _tokens(run, "v1") == run["single"]["v1"]
    assert _tokens(run, "v2") == run["single"]["v2"]


def test_stalled_peers_fail_within_the_timeout_while_the_engine_steps(run):
    res = run["results"]
    # unreachable: failed within pull_timeout_s (plus a step), the plain request finished
    # long before (the engine kept stepping)
    assert res["ghost"][2] < PULL_TIMEOUT + 5
    assert res["plain-d"][2] < res["ghost"][2]
    # frozen (SIGSTOP): a READ the transport serves without the peer may still succeed;
    # either way within the timeout, with right tokens or none, and the plain one first
    frozen = res["frozen"]
    assert frozen[2] < PULL_TIMEOUT + 5
    assert frozen[0] == run["single"]["frozen"] or (frozen[1] == "error" and frozen[0] == [])
    assert res["plain-e"][0] == run["single"]["plain-e"]


def test_host_tier_keeps_no_pulled_kv_and_keeps_tenants_apart(run):
    h = run["host"]
    # h2's prompt was pulled: extending it loads nothing (only KV this engine computed)
    assert h["mid"]["loaded"] == h["before"]["loaded"]
    assert _tokens(run, "host-h2ext") == run["single"]["host-h2ext"]
    # another tenant's salt: no hit; the same salt: a hit, with the computed tokens
    assert h["after_b"]["loaded"] == h["mid"]["loaded"]
    assert h["after_a"]["loaded"] > h["after_b"]["loaded"]
    assert _tokens(run, "host-salt-b-ext") == run["single"]["host-salt-b-ext"]
    assert _tokens(run, "host-salt-a-ext") == run["single"]["host-salt-a-ext"]


def test_tables_are_empty_and_blocks_come_back_after_it_all(run):
    s, w = run["scheduler_tables"], run["worker_tables"]
    assert s["entries"] == 0, s
    assert w["pulls"] == 0 and w["peers"] <= 16, w
    end = run["prefill_end"]
    assert end["held"] == 0 and end["free_blocks"] == end["total_blocks"], end
    assert end["scheduler"]["entries"] == 0 and end["scheduler"]["held"] == 0, end
    assert end["worker"]["sent"] == 0 and end["worker"]["finished"] == 0, end
