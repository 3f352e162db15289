"""KvabiConnector moves fp8 caches with their scales: P/D pairs of real vLLM engines over
NIXL, prefill and decode on vLLM's CPU backend with other block sizes (a relayout of codes),
per-layer static scales in the handshakes, bound by the producer's grant record and
compared by the puller before any byte moves."""
import re

from kvabi_vllm.tools import guard_fp8
from kvabi_vllm.tools.checkpoints import prompts, write_checkpoint
from kvabi_vllm.tools.pd import run_pair

FP8_SCALES = guard_fp8.PRODUCER_SCALES


def test_pd_fp8_cache_moves_with_its_scales(tmp_path):
    """The decode side's tokens equal the decode engine computing alone; a request whose
    handshakes a client rewrote to claim other value scales is refused by the producer's
    record before any byte moves, instead of decoding codes under the wrong scales."""
    model = write_checkpoint("llama", tmp_path / "llama")
    ps = prompts(2, lengths=(37, 70), shared_prefix=0)
    fp8 = {"kv_cache_dtype": "fp8", "kv_scales": FP8_SCALES}
    doubled = [[k, 2 * v] for k, v in FP8_SCALES]
    r = run_pair(model, ps + ps[:1], tmp_path / "pd", prefill={"block_size": 32, **fp8},
                 decode={"block_size": 64, **fp8}, max_tokens=8, reference_runs=1,
                 edit_params=lambda p: p[:-1] + [guard_fp8.restate_scales(p[-1], doubled)])
    n = len(ps)
    seen = f"finish {r['finish']}, refusals {r['refusals']}"  # what a failure shows
    assert min(len(set(t)) for t in r["single"]) > 1
    assert len(r["pulls"]) == n and all(p[3] > 0 for p in r["pulls"]), seen
    assert r["pd"][:n] == r["single"][:n], seen
    assert r["finish"] == ["length"] * n + ["error"], seen
    (_, why), = r["refusals"]
    assert re.search(r"kvabi_handshakes\[0\]\.\w+\.kv_scales: not the scales the producer",
                     why), why


def test_pd_fp8_scales_are_bound_by_the_producers_record(tmp_path):
    """Engines holding their codes under other scales: the honest request is refused by
    the scale comparison naming the layer and scale, and one whose handshakes claim the
    decode engine's own scales (accepted before the record bound scales: tokens decoded
    under the wrong scales, without an error) by the producer's record."""
    run = guard_fp8.fp8_case(tmp_path)
    lines, ok = guard_fp8.summary(run)
    assert ok, "\n".join(lines)
    for name, (finish, tokens, why) in run.items():
        assert finish == "error" and tokens == [], (name, run[name])
        assert re.search(guard_fp8.ATTACKS[name][1], why), (name, why)
