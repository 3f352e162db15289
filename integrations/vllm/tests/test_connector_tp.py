"""P/D between engines of different tensor-parallel sizes with KvabiConnector over NIXL:
engine A runs TP 2 on vLLM's own CPU backend (LBHNC, 32-token blocks, keys stored
transposed: K and V parts), engine B TP 1 on the kvabi backend example.torch (cross-layer
BLHNC, 64-token blocks); each prefills prompts for the other (``kv_role="kv_both"``), so one
pair shows TP 2 -> 1 and TP 1 -> 2, with another backend, layout and block size on each
side.  Each side's tokens equal the same engine computing alone.  Faults: A's rank list
swapped in one request's parameters and A's handshakes naming another model in another
(each refused by B's negotiation before any byte moves; the requests fail and A frees the
blocks it held), and a B handshake naming an agent that never answers (A's request fails
within the stated pull timeout)."""
import json
import time

from kvabi_vllm.tools.checkpoints import distinct_tokens, prompts, write_checkpoint
from kvabi_vllm.tools.pd import KVABI_DECODE
from kvabi_vllm.tools.pd_tp import run_tp_pair

#: connecting to or reading from a peer gives up after this many seconds
PULL_TIMEOUT = 5.0


def swap_ranks_and_model(params):
    """The last but one request's handshakes, each part's rank list reversed; the last
    request's handshakes naming another model (the fingerprint covers the layout only)."""
    params[-2]["kvabi_handshakes"] = [{part: msgs[::-1] for part, msgs in g.items()}
                                      for g in params[-2]["kvabi_handshakes"]]
    other = []
    for g in params[-1]["kvabi_handshakes"]:
        part = {}
        for name, msgs in g.items():
            part[name] = [json.dumps({**json.loads(m), "model": "another-model"})
                          for m in msgs]
        other.append(part)
    params[-1]["kvabi_handshakes"] = other
    return params


def never_answering(params):
    """The last request's handshakes name an agent nobody runs, at a port nobody serves."""
    from kvabi.transfer.nixl import free_port

    last = params[-1]
    out = []
    for g in last["kvabi_handshakes"]:
        part = {}
        for name, msg in g.items():
            d = json.loads(msg)
            d.pop("metadata", None)
            d["agent"].update(name="kvabi-nobody", port=free_port())
            part[name] = json.dumps(d)
        out.append(part)
    last["kvabi_handshakes"] = out
    return params


def test_tp2_to_tp1_and_tp1_to_tp2(tmp_path):
    model = write_checkpoint("llama", tmp_path / "llama")  # 2 KV heads: one per TP-2 rank
    pa = prompts(5, lengths=(37, 70, 100, 45, 20), shared_prefix=0, seed=1)
    pb = prompts(4, lengths=(41, 66, 90, 50), shared_prefix=0, seed=2)
    sides = {"A": {"tp": 2, "block_size": 32, "prompts": pa},
             "B": {**KVABI_DECODE, "tp": 1, "prompts": pb}}
    t0 = time.monotonic()
    r = run_tp_pair(model, tmp_path / "pair", sides, pull_timeout=PULL_TIMEOUT,
                    edit_params=lambda name, p: swap_ranks_and_model(p) if name == "A" else
                    never_answering(p), expect_free=("A",))
    a, b = r["A"]["out"], r["B"]["out"]
    # B decoded A's prefills (TP 2 -> 1), A decoded B's (TP 1 -> 2): the single engine's
    assert distinct_tokens(b["single"][:3]) > 1 and distinct_tokens(a["single"][:3]) > 1
    assert b["pd"][:3] == b["single"][:3]
    assert a["pd"][:3] == a["single"][:3]
    assert b["finish"][:3] == a["finish"][:3] == ["length"] * 3
    # swapped ranks, another model: refused, the requests failed; A got its blocks back
    assert b["finish"][3:] == ["error", "error"], b["finish"]
    assert r["A"]["freed"] is not None and r["A"]["freed"]["held"] > 0
    # a rank that never answers: the request failed, within the pull timeout per worker
    assert a["finish"][3] == "error", a["finish"]
    log = (tmp_path / "pair" / "A.log").read_text()
    assert "did not answer within 5 s" in log
    assert "src_layouts[0].shard.rank: says rank 1 at position 0" in \
        (tmp_path / "pair" / "B.log").read_text()
    assert "model: remote rank 0 serves model 'another-model', this cache 'config:" in \
        (tmp_path / "pair" / "B.log").read_text()
    assert time.monotonic() - t0 < 600
