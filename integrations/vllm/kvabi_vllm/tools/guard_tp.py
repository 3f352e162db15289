"""P/D between tensor-parallel sizes under attack (``kvabi-vllm guard``'s TP case,
``specs/security.md`` 5.2): engine A (TP 2, vLLM's CPU backend, LBHNC, 32-token blocks)
prefills for engine B (TP 1, ``example.torch``, cross-layer BLHNC, 64-token blocks) and B
for A (``kvabi_vllm.tools.pd_tp``); a client rewrites A's parameters on their way to B:

- the producer ranks' handshake lists swapped (the grant tables left in order), a rank's
  handshake stating another rank's heads (descriptor and fingerprint restated), another
  model: each refused by the producer rank's record, naming the field;
- the grant tables and handshakes both reordered: refused because the record at position 0
  was written by producer rank 1 (the order of ranks is the producer's);
- B's connector corrupts one of A's prefills on arrival (the negative control): refused by
  a producer rank's per-head checksums.

Each refused request fails alone; every rank of A gets back every block it held (B tells
each rank whose record bound the grant).  B's own parameters name an agent nobody runs (A's
pull fails within its timeout).  :func:`tp_case` runs the pair; the TP test and ``kvabi-vllm
guard`` read it.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

#: A's decode ranks' pulls give up after this long
PULL_TIMEOUT = 5.0
#: B's: longer, so that B's honest pulls outlast A's engine stepping through its own
#: never-answering pull (on a loaded machine B's reads of A's memory were seen to wait for it)
B_PULL_TIMEOUT = 30.0
HONEST = 3
#: A's prefill that B's connector corrupts on arrival (after the honest ones)
CORRUPT = HONEST

#: A's prefills after CORRUPT, each rewritten one way: name -> (what, the refusal)
FAULTS = {
    "tp-swapped": ("the producer ranks' handshakes swapped (grant tables in order)",
                   r"kvabi_handshakes\[0\]\.\w+\[0\]: its layout is not the one the producer "
                   r"registered"),
    "tp-lying": ("producer rank 1's handshake stating rank 0's head (fingerprint restated)",
                 r"kvabi_handshakes\[0\]\.\w+\[1\]: its layout is not the one the producer "
                 r"registered"),
    "tp-model": ("every rank's handshake naming another model",
                 r"kvabi_handshakes\[0\]\.\w+\[0\]\.model: not the model identity the "
                 r"producer registered"),
    "tp-reordered": ("the grant tables and the handshakes both in reverse rank order",
                     r"kvabi_grants\[0\]: the record there was written by producer rank 1 of "
                     r"2, the parameters list it as rank 0 of 2"),
}


def _edit_messages(params, edit):
    """``params["kvabi_handshakes"]`` with every part's rank list passed through ``edit``."""
    params["kvabi_handshakes"] = [{part: edit(part, msgs) for part, msgs in g.items()}
                                  for g in params["kvabi_handshakes"]]


def _lie_about_heads(part, msgs):
    """Rank 1 says it holds head 0 (its descriptor and fingerprint restated to match)."""
    from kvabi import Layout

    d = json.loads(msgs[1])
    d["layout"]["shard"]["heads"] = [0]
    d["fingerprint"] = Layout.from_json(json.dumps(d["layout"])).fingerprint()
    return [msgs[0], json.dumps(d)]


def _reorder(params):
    _edit_messages(params, lambda part, msgs: msgs[::-1])
    params["kvabi_grants"] = params["kvabi_grants"][::-1]


EDITS = {
    "tp-swapped": lambda p: _edit_messages(p, lambda part, msgs: msgs[::-1]),
    "tp-lying": lambda p: _edit_messages(p, _lie_about_heads),
    "tp-model": lambda p: _edit_messages(p, lambda part, msgs: [
        json.dumps({**json.loads(m), "model": "another-model"}) for m in msgs]),
    "tp-reordered": _reorder,
}


def a_faults(params):
    """A's (TP 2) prefills after CORRUPT, each rewritten as :data:`FAULTS` says."""
    for i, name in enumerate(FAULTS):
        EDITS[name](params[CORRUPT + 1 + i])
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


def tp_case(work, model=None) -> dict:
    """Run the pair in ``work`` (a tiny llama written there unless ``model``); returns
    run_tp_pair's result plus ``logs`` (A's and B's) and ``wall_s``."""
    from .checkpoints import prompts, write_checkpoint
    from .pd import KVABI_DECODE
    from .pd_tp import run_tp_pair

    work = Path(work)
    model = str(model or write_checkpoint("llama", work / "llama"))  # 2 KV heads
    n_a = HONEST + 1 + len(FAULTS)
    pa = prompts(n_a, lengths=(37, 70, 100, 52, 45, 40, 33, 48), shared_prefix=0, seed=1)
    pb = prompts(HONEST + 1, lengths=(41, 66, 90, 50), shared_prefix=0, seed=2)
    # B numbers its own prefills first, then A's: the corrupted one is request len(pb) + 3
    corrupt = {"KVABI_TEST_CORRUPT_FROM": str(len(pb) + CORRUPT)}
    sides = {"A": {"tp": 2, "block_size": 32, "prompts": pa,
                   "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}},
             "B": {**KVABI_DECODE, "tp": 1, "prompts": pb, "pull_timeout": B_PULL_TIMEOUT,
                   "module": "kvabi_vllm.tools.corrupting_connector",
                   "env": {**KVABI_DECODE["env"], **corrupt}}}
    t0 = time.monotonic()
    r = run_tp_pair(model, work / "pair", sides, pull_timeout=PULL_TIMEOUT, max_tokens=8,
                    edit_params=lambda name, p: a_faults(p) if name == "A" else b_faults(p),
                    expect_free=("A", "B"))
    r["wall_s"] = time.monotonic() - t0
    r["logs"] = {n: (work / "pair" / f"{n}.log").read_text() for n in ("A", "B")}
    r["n_b"] = len(pb)
    return r


def summary(run: dict) -> tuple[list[str], bool]:
    """A line per attack of A's prefills (read by B) and B's ghost (read by A), and
    whether each was refused with its reason and every held block came back."""
    b, a = run["B"]["out"], run["A"]["out"]
    blog, alog = run["logs"]["B"], run["logs"]["A"]
    lines, ok = [], True
    honest = b["pd"][:HONEST] == b["single"][:HONEST] and \
        a["pd"][:HONEST] == a["single"][:HONEST]
    ok &= honest
    lines.append(f"tp honest: {'the single engines' if honest else 'NOT the single engines'}"
                 f"' tokens both ways (TP 2 -> 1 and 1 -> 2)")
    checks = [("tp-corrupt", CORRUPT, "bytes changed on arrival",
               r"is not what the producer computed \(global head \d+: checksum differs")]
    checks += [(name, CORRUPT + 1 + i, what, pattern)
               for i, (name, (what, pattern)) in enumerate(FAULTS.items())]
    for name, i, what, pattern in checks:
        req = f"load of request {run['n_b'] + i}-"
        said = [line for line in blog.splitlines() if req in line]
        good = b["finish"][i] == "error" and any(re.search(pattern, x) for x in said)
        ok &= good
        why = said[0].split("failed: ", 1)[-1][:160] if said else "no reason logged"
        lines.append(f"{name:<16} {what}; " + (f"refused: {why}" if good else
                                                f"NOT refused as it should be ({why})"))
    ghost = a["finish"][HONEST] == "error" and "agent 'kvabi-nobody'" in alog
    ok &= ghost
    lines.append(f"tp-ghost         B's handshakes naming an agent nobody runs; "
                 f"{'refused within the pull timeout' if ghost else 'NOT refused'}")
    freed = all(run[n].get("freed") == {"held": run[n]["out"]["held"]} for n in ("A", "B"))
    ok &= freed
    lines.append(f"tp: every block each engine held for the other came back: "
                 f"{'yes' if freed else 'NO'} (A {run['A'].get('freed')}, "
                 f"B {run['B'].get('freed')})")
    return lines, ok


__all__ = ["B_PULL_TIMEOUT", "CORRUPT", "FAULTS", "HONEST", "PULL_TIMEOUT", "a_faults",
           "b_faults", "summary", "tp_case"]
