"""P/D between engines of different tensor-parallel sizes with KvabiConnector over NIXL:
engine A runs TP 2 on vLLM's own CPU backend (LBHNC, 32-token blocks, keys stored
transposed), engine B TP 1 on the kvabi backend example.torch (cross-layer BLHNC, 64-token
blocks); each prefills prompts for the other (``kv_role="kv_both"``), so one pair shows
TP 2 -> 1 and TP 1 -> 2, with another backend, layout and block size on each side.  Each
side's tokens equal the same engine computing alone.

The negative control: B's connector overwrites a block of what it received for one of A's
prefills (the corrupting connector): the per-head checksums of the two producer ranks'
records catch it and the request fails.  Faults, each one request beside the honest ones:
A's rank lists swapped, A's rank 1 lying
about its heads (its descriptor and fingerprint restated), A's handshakes naming another
model (each refused by B's negotiation before any KV moves, naming the field; the requests
fail and both of A's ranks free the blocks they held), and B's KV handshakes naming an
agent that never answers (A's request fails within the pull timeout; B is still told and
frees)."""
import json
import time

from kvabi import Layout

from kvabi_vllm.tools.checkpoints import distinct_tokens, prompts, write_checkpoint
from kvabi_vllm.tools.pd import KVABI_DECODE
from kvabi_vllm.tools.pd_tp import run_tp_pair

#: A's decode ranks' pulls (connect, grant records, READs, checks) give up after this long
PULL_TIMEOUT = 5.0
#: B's: longer, so that B's honest pulls outlast A's engine stepping through its own
#: never-answering pull (on a loaded machine B's reads of A's memory were seen to wait for it)
B_PULL_TIMEOUT = 30.0
HONEST = 3
#: A's prefill that B's connector corrupts on arrival (after the honest ones)
CORRUPT = HONEST


def _edit_messages(params, edit):
    """``params["kvabi_handshakes"]`` with every part's rank list passed through ``edit``."""
    params["kvabi_handshakes"] = [{part: edit(part, msgs) for part, msgs in g.items()}
                                  for g in params["kvabi_handshakes"]]


def _lie_about_heads(part, msgs):
    """Rank 1 says it holds head 0 (its descriptor and fingerprint restated to match)."""
    d = json.loads(msgs[1])
    d["layout"]["shard"]["heads"] = [0]
    d["fingerprint"] = Layout.from_json(json.dumps(d["layout"])).fingerprint()
    return [msgs[0], json.dumps(d)]


def a_faults(params):
    """A's (TP 2) last three prefills: ranks swapped, rank 1 lying, another model."""
    _edit_messages(params[CORRUPT + 1], lambda part, msgs: msgs[::-1])
    _edit_messages(params[CORRUPT + 2], _lie_about_heads)
    _edit_messages(params[CORRUPT + 3], lambda part, msgs: [
        json.dumps({**json.loads(m), "model": "another-model"}) for m in msgs])
    return params


def b_faults(params):
    """B's (TP 1) last prefill: its KV handshakes name an agent nobody runs."""
    from kvabi.transfer.nixl import free_port

    def nobody(part, msg):
        d = json.loads(msg)
        d.pop("metadata", None)
        d["agent"].update(name="kvabi-nobody", port=free_port())
        return json.dumps(d)
    _edit_messages(params[HONEST], nobody)
    return params


def test_tp2_to_tp1_and_tp1_to_tp2(tmp_path):
    model = write_checkpoint("llama", tmp_path / "llama")  # 2 KV heads: one per TP-2 rank
    pa = prompts(HONEST + 4, lengths=(37, 70, 100, 52, 45, 40, 33), shared_prefix=0, seed=1)
    pb = prompts(HONEST + 1, lengths=(41, 66, 90, 50), shared_prefix=0, seed=2)
    # B numbers its own prefills first, then A's: the corrupted one is request len(pb) + 3
    corrupt = {"KVABI_TEST_CORRUPT_FROM": str(len(pb) + CORRUPT)}
    sides = {"A": {"tp": 2, "block_size": 32, "prompts": pa,
                   "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}},
             "B": {**KVABI_DECODE, "tp": 1, "prompts": pb, "pull_timeout": B_PULL_TIMEOUT,
                   "module": "kvabi_vllm.tools.corrupting_connector",
                   "env": {**KVABI_DECODE["env"], **corrupt}}}
    t0 = time.monotonic()
    r = run_tp_pair(model, tmp_path / "pair", sides, pull_timeout=PULL_TIMEOUT, max_tokens=8,
                    edit_params=lambda name, p: a_faults(p) if name == "A" else b_faults(p),
                    expect_free=("A", "B"))
    wall = time.monotonic() - t0
    a, b = r["A"]["out"], r["B"]["out"]
    alog = (tmp_path / "pair" / "A.log").read_text()
    blog = (tmp_path / "pair" / "B.log").read_text()
    # B decoded A's prefills (TP 2 -> 1), A decoded B's (TP 1 -> 2): the engine's own tokens
    assert distinct_tokens(b["single"][:HONEST]) > 1 and distinct_tokens(a["single"][:HONEST]) > 1
    assert b["pd"][:HONEST] == b["single"][:HONEST]
    assert a["pd"][:HONEST] == a["single"][:HONEST]
    assert b["finish"][:HONEST] == a["finish"][:HONEST] == ["length"] * HONEST
    # ... read from both producer ranks, and each of A's ranks from B's one
    assert "reads producer ranks [0, 1] of 2: relayout" in blog, blog[-3000:]
    assert "(rank 0 of 2) reads producer ranks [0] of 1: relayout" in alog
    assert "(rank 1 of 2) reads producer ranks [0] of 1: relayout" in alog
    # the negative control: bytes changed on arrival are caught by a producer rank's sums
    assert b["finish"][CORRUPT] == "error", b["finish"]
    assert f"load of request {len(pb) + CORRUPT}-" in blog and \
        "is not what the producer computed (global head 0: checksum differs" in blog
    # swapped ranks, a rank lying about its heads, another model: refused by field
    assert b["finish"][CORRUPT + 1:] == ["error"] * 3, b["finish"]
    assert "src_layouts[0].shard.rank: says rank 1 at position 0" in blog
    assert "src_layouts[1].shard.heads: rank 1 of 2 holds [1] of 2 heads, it says [0]" in blog
    assert "model: remote rank 0 serves model 'another-model', this cache 'config:" in blog
    # ... and both of A's ranks got back every block they held (B told them it is done)
    assert r["A"]["freed"] == {"held": a["held"]} and a["held"] > 0
    # a rank that never answers: the request failed within the pull timeout; B freed
    assert a["finish"][HONEST] == "error", a["finish"]
    assert "agent 'kvabi-nobody'" in alog and "did not answer within" in alog
    assert a["generate_s"] < PULL_TIMEOUT + 30
    assert r["B"]["freed"] == {"held": b["held"]} and b["held"] > 0
    print(f"pair wall {wall:.1f} s; A generate {a['generate_s']:.1f} s, "
          f"B generate {b['generate_s']:.1f} s")
