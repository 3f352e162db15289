"""fp8 scales under attack (``kvabi-vllm guard``'s fp8 case, ``specs/security.md`` 5.2,
*Binding*): a P/D pair of fp8 caches whose engines hold their codes under other per-layer
scales.  The honest parameters are refused by the scale comparison (the fix: start both
engines with the same scales); parameters whose handshakes a client rewrote to state the
decode engine's own scales must be refused too, by the producer's grant record (its scales
digest), instead of decoding the producer's codes under the wrong scales.

:func:`fp8_case` runs the pair (two in-process engines, ``kvabi_vllm.tools.pd``).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

#: the prefill engine's per-layer (k_scale, v_scale)
PRODUCER_SCALES = [[0.031, 0.043], [0.057, 0.027], [0.022, 0.061], [0.049, 0.035]]
#: the decode engine's: layer 2's value scale differs
DECODE_SCALES = [[0.031, 0.043], [0.057, 0.027], [0.022, 0.122], [0.049, 0.035]]

#: request -> (what it tries, what its refusal must say)
ATTACKS = {
    "fp8-honest": ("honest parameters between engines of other scales",
                   r"kvabi_handshakes\[0\]\.\w+\.kv_scales\[2\]\.v_scale: the peer's codes are "
                   r"under 0\.061"),
    "fp8-rewritten": ("the handshakes' kv_scales rewritten to the decode engine's own",
                      r"kvabi_handshakes\[0\]\.\w+\.kv_scales: not the scales the producer's "
                      r"cache holds its codes under"),
}


def restate_scales(params: dict, scales) -> dict:
    """``params`` with every part's handshake stating ``scales`` (what a client can do)."""
    p = copy.deepcopy(params)
    for g, parts in enumerate(p["kvabi_handshakes"]):
        edited = {}
        for part, text in parts.items():
            msg = json.loads(text)
            if "kv_scales" in msg:
                msg["kv_scales"] = [list(map(float, s)) for s in scales]
            edited[part] = json.dumps(msg)
        p["kvabi_handshakes"][g] = edited
    return p


def fp8_case(work, model=None) -> dict:
    """Run the pair in ``work`` (a tiny llama written there unless ``model``): one request
    per attack; returns ``{name: (finish reason, tokens, refusal reason)}``."""
    from .checkpoints import prompts, write_checkpoint
    from .pd import run_pair

    work = Path(work)
    model = str(model or write_checkpoint("llama", work / "llama"))
    ps = prompts(2, lengths=(40, 70), shared_prefix=0, seed=5)
    r = run_pair(model, ps, work / "pair",
                 prefill={"block_size": 32, "kv_cache_dtype": "fp8",
                          "kv_scales": PRODUCER_SCALES},
                 decode={"block_size": 64, "kv_cache_dtype": "fp8",
                         "kv_scales": DECODE_SCALES},
                 max_tokens=4, reference_runs=1,
                 edit_params=lambda p: [p[0], restate_scales(p[1], DECODE_SCALES)])
    def base(rid):  # vLLM's engine adds a suffix to the ids its outputs carry
        return str(rid).rsplit("-", 1)[0]

    why = {base(rid): reason for rid, reason in r["refusals"]}
    return {name: (r["finish"][i], r["pd"][i], why.get(base(r["pd_ids"][i]), ""))
            for i, name in enumerate(ATTACKS)}


def summary(run: dict) -> tuple[list[str], bool]:
    """A line per request, and whether each was refused with its reason."""
    lines, ok = [], True
    for name, (what, pattern) in ATTACKS.items():
        finish, tokens, why = run[name]
        good = finish == "error" and not tokens and re.search(pattern, why) is not None
        ok &= good
        said = f"refused: {why}" if good else \
            f"NOT refused as it should be ({finish}, {len(tokens)} tokens; {why or 'no reason'})"
        lines.append(f"{name:<16} {what}; {said}")
    return lines, ok


__all__ = ["ATTACKS", "DECODE_SCALES", "PRODUCER_SCALES", "fp8_case", "restate_scales",
           "summary"]
