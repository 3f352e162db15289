"""P/D disaggregation between two vLLM processes with KvabiConnector over NIXL (UCX, DRAM):
prefill on vLLM's own CPU backend (LBHNC, 32-token blocks, keys stored transposed), decode on
the kvabi backend example.torch through the kvabi attention-backend plugin (cross-layer
BLHNC, 64-token blocks): another backend, layout and block size.  The decode side's tokens
equal the decode engine computing alone; a pulled block corrupted on the way changes them; a
tampered handshake is refused before any byte moves (the request fails, no tokens from
garbage)."""
import json
from pathlib import Path

from kvabi_vllm.tools.checkpoints import prompts, write_checkpoint
from kvabi_vllm.tools.pd import KVABI_DECODE, run_pair

HERE = Path(__file__).parent


def tamper_last(params):
    """The last request's handshake claims a plane smaller than its layout."""
    last = params[-1]
    msg = json.loads(last["kvabi_handshakes"][0]["kv"])
    msg["planes"][0]["nbytes"] = 1
    last["kvabi_handshakes"][0] = {**last["kvabi_handshakes"][0], "kv": json.dumps(msg)}
    return params


def test_pd_relayout_gives_the_single_engine_tokens_and_corruption_changes_them(tmp_path):
    model = write_checkpoint("llama", tmp_path / "llama")
    ps = prompts(3, lengths=(37, 70, 100), shared_prefix=0)
    n = len(ps)
    # the decode side's connector corrupts the pulls of requests n.. (the repeated prompts)
    r = run_pair(model, ps + ps + ps[:1], tmp_path / "pd", edit_params=tamper_last,
                 prefill={"block_size": 32},
                 decode={**KVABI_DECODE, "module": "corrupting_connector"},
                 max_tokens=12, env={"PYTHONPATH": str(HERE), "KVABI_TEST_CORRUPT_FROM": str(n)})
    assert min(len(set(t)) for t in r["single"]) > 1, "degenerate continuations compare nothing"
    # the decode side really ran the kvabi backend's cross-layer layout; vLLM's CPU cache
    # (keys [D, N], values [N, D]) is one layout of two components, pulled as one part
    (g0,) = r["layouts"]
    assert "@vllm.BLHNC" in g0["kv"], g0
    pulled = {p[0].split("-")[0] for p in r["pulls"]}
    assert pulled == {str(i) for i in range(2 * n)}, r["pulls"]  # not the tampered one
    assert all(p[2] > 0 and p[3] > 0 for p in r["pulls"])  # regions, bytes
    assert r["pd"][:n] == r["single"][:n]
    # negative control: the same prompts, one block per pulled part overwritten
    assert all(a != b for a, b in zip(r["pd"][n:2 * n], r["single"][n:2 * n]))
    # the tampered handshake: refused, the request fails instead of decoding garbage
    assert r["finish"][:2 * n] == ["length"] * (2 * n)
    assert r["finish"][2 * n] == "error", r["finish"]


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
    """fp8 caches with per-layer scales, prefill and decode on vLLM's CPU backend with
    other block sizes (a relayout of codes): the decode side's tokens equal the decode
    engine computing alone; a request whose handshakes carry other scales than the decode
    engine's layers is refused before any byte moves and fails instead of decoding codes
    under the wrong scales."""
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
