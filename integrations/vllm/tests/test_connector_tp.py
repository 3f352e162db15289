"""P/D between engines of different tensor-parallel sizes with KvabiConnector over NIXL:
engine A runs TP 2 on vLLM's own CPU backend (LBHNC, 32-token blocks, keys stored
transposed), engine B TP 1 on the kvabi backend example.torch (cross-layer BLHNC, 64-token
blocks); each prefills prompts for the other (``kv_role="kv_both"``), so one pair shows
TP 2 -> 1 and TP 1 -> 2, with another backend, layout and block size on each side.  Each
side's tokens equal the same engine computing alone.

The negative control: B's connector overwrites a block of what it received for one of A's
prefills (the corrupting connector): the per-head checksums of the two producer ranks'
records catch it and the request fails.  Faults a client writes into A's parameters
(``kvabi_vllm.tools.guard_tp``, the TP case of ``kvabi-vllm guard``), each one request beside
the honest ones: A's rank lists swapped, A's rank 1 lying about its heads (its descriptor
and fingerprint restated), A's handshakes naming another model, A's grant tables and
handshakes both reordered; each is refused by the producer ranks' grant records before any
KV moves, naming the field, and both of A's ranks free the blocks they held.  B's KV
handshakes naming an agent that never answers: A's request fails within the pull timeout;
B is still told and frees."""
import re

from kvabi_vllm.tools import guard_tp
from kvabi_vllm.tools.checkpoints import distinct_tokens
from kvabi_vllm.tools.guard_tp import CORRUPT, FAULTS, HONEST, PULL_TIMEOUT


def test_tp2_to_tp1_and_tp1_to_tp2(tmp_path):
    r = guard_tp.tp_case(tmp_path)
    a, b = r["A"]["out"], r["B"]["out"]
    alog, blog = r["logs"]["A"], r["logs"]["B"]
    # B decoded A's prefills (TP 2 -> 1), A decoded B's (TP 1 -> 2): the engine's own tokens
    assert distinct_tokens(b["single"][:HONEST]) > 1 and distinct_tokens(a["single"][:HONEST]) > 1
    assert b["pd"][:HONEST] == b["single"][:HONEST], blog[-3000:]
    assert a["pd"][:HONEST] == a["single"][:HONEST], alog[-3000:]
    assert b["finish"][:HONEST] == a["finish"][:HONEST] == ["length"] * HONEST
    # ... read from both producer ranks, and each of A's ranks from B's one
    assert "reads producer ranks [0, 1] of 2: relayout" in blog, blog[-3000:]
    assert "(rank 0 of 2) reads producer ranks [0] of 1: relayout" in alog
    assert "(rank 1 of 2) reads producer ranks [0] of 1: relayout" in alog
    # the negative control: bytes changed on arrival are caught by a producer rank's sums
    assert b["finish"][CORRUPT] == "error", b["finish"]
    assert f"load of request {r['n_b'] + CORRUPT}-" in blog and \
        "is not what the producer computed (global head 0: checksum differs" in blog
    # what a client rewrote in A's parameters: refused by the producer ranks' records,
    # naming the field, each request failing alone
    assert b["finish"][CORRUPT + 1:] == ["error"] * len(FAULTS), b["finish"]
    for i, (name, (_, pattern)) in enumerate(FAULTS.items()):
        said = [x for x in blog.splitlines() if f"load of request {r['n_b'] + CORRUPT + 1 + i}-"
                in x]
        assert any(re.search(pattern, x) for x in said), (name, said)
    # ... and both of A's ranks got back every block they held (B told them it is done)
    assert r["A"]["freed"] == {"held": a["held"]} and a["held"] > 0
    # a rank that never answers: the request failed within the pull timeout; B freed
    assert a["finish"][HONEST] == "error", a["finish"]
    assert "agent 'kvabi-nobody'" in alog and "did not answer within" in alog
    assert a["generate_s"] < PULL_TIMEOUT + 30
    assert r["B"]["freed"] == {"held": b["held"]} and b["held"] > 0
    lines, ok = guard_tp.summary(r)  # kvabi-vllm guard's reading of the same run
    assert ok, "\n".join(lines)
    print(f"pair wall {r['wall_s']:.1f} s; A generate {a['generate_s']:.1f} s, "
          f"B generate {b['generate_s']:.1f} s")
