"""KvabiConnector moves fp8 caches with their scales: a P/D pair of real vLLM engines over
NIXL, prefill and decode on vLLM's CPU backend with other block sizes (a relayout of codes),
per-layer static scales in the handshakes, compared by the puller before any byte moves."""
import json

from kvabi_vllm.tools.checkpoints import prompts, write_checkpoint
from kvabi_vllm.tools.pd import run_pair

FP8_SCALES = [[0.031, 0.043], [0.057, 0.027], [0.022, 0.061], [0.049, 0.035]]


def other_scales_last(params):
    """The last request's handshakes claim value scales twice the prefill side's."""
    last = params[-1]
    for g, parts in enumerate(last["kvabi_handshakes"]):
        edited = {}
        for part, text in parts.items():
            msg = json.loads(text)
            msg["kv_scales"] = [[k, 2 * v] for k, v in msg["kv_scales"]]
            edited[part] = json.dumps(msg)
        last["kvabi_handshakes"][g] = edited
    return params


def test_pd_fp8_cache_moves_with_its_scales(tmp_path):
    """The decode side's tokens equal the decode engine computing alone; a request whose
    handshakes carry other scales than the decode engine's layers is refused before any
    byte moves and fails instead of decoding codes under the wrong scales."""
    model = write_checkpoint("llama", tmp_path / "llama")
    ps = prompts(2, lengths=(37, 70), shared_prefix=0)
    fp8 = {"kv_cache_dtype": "fp8", "kv_scales": FP8_SCALES}
    r = run_pair(model, ps + ps[:1], tmp_path / "pd", prefill={"block_size": 32, **fp8},
                 decode={"block_size": 64, **fp8}, max_tokens=8,
                 edit_params=other_scales_last)
    n = len(ps)
    assert min(len(set(t)) for t in r["single"]) > 1
    assert len(r["pulls"]) == n and all(p[3] > 0 for p in r["pulls"])
    assert r["pd"][:n] == r["single"][:n]
    assert r["finish"] == ["length"] * n + ["error"], r["finish"]
