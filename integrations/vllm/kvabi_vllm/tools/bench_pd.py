"""``kvabi bench vllm``'s P/D section: KV transfer per request between two vLLM processes.

Side by side in one run, on the same prompts and the same tiny random checkpoint (32
layers, so per-layer and cross-layer region counts differ by what a real model shows):

- KvabiConnector, same layout (LBHNC, 32-token blocks on both sides);
- vLLM's NixlConnector, same layout (it forces LBHNC);
- KvabiConnector with relayout (prefill LBHNC/32, decode cross-layer BLHNC/64);
- KvabiConnector cross-layer (BLHNC/32 on both sides): regions per request against the
  per-layer run;
- KvabiConnector from vLLM's CPU backend to the kvabi backend example.torch (through the
  attention-backend plugin) on cross-layer BLHNC/64.

Transfer time per request is the time in NIXL READs on the decode side (KvabiConnector:
post to completion, measured around its READs; NixlConnector: NIXL's own post + transfer
telemetry).  ``python -m kvabi_vllm.tools.bench_pd --help``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from .pd import KVABI_DECODE

#: (label, prefill side, decode side)
RUNS = (
    ("kvabi same layout", {"block_size": 32}, {"block_size": 32}),
    ("vLLM NixlConnector", {"block_size": 32, "connector": "NixlConnector", "module": ""},
     {"block_size": 32, "connector": "NixlConnector", "module": ""}),
    ("kvabi relayout", {"block_size": 32}, {"block_size": 64, "layout": "BLHNC"}),
    ("kvabi cross-layer", {"block_size": 32, "layout": "BLHNC"},
     {"block_size": 32, "layout": "BLHNC"}),
    ("kvabi relayout, other backend", {"block_size": 32}, KVABI_DECODE),
)


def _per_request(result: dict) -> dict:
    """Median READ seconds, bytes, regions per request of one decode side's result."""
    if result.get("nixl"):
        x = np.array(result["nixl"], float)  # post s, transfer s, bytes, descriptors
        secs, nbytes, regions = x[:, 0] + x[:, 1], x[:, 2], x[:, 3]
    else:
        # s, regions, bytes, read s, grant record s, checksums s
        x = np.array([p[1:] for p in result["pulls"]], float)
        secs, regions, nbytes = x[:, 3], x[:, 1], x[:, 2]
        # the whole pull: connecting, the grant record, READs, checksums of every token
        whole = [float(np.median(x[:, i])) for i in (0, 4, 5)]
    n = len(result["pd"])
    pulled = x[:, 0] + x[:, 1] if result.get("nixl") else x[:, 0]  # whole pull, per request
    return {"requests": int(len(secs)), "read_s": float(np.median(secs)),
            "pull_s": None if result.get("nixl") else whole,
            "bytes": float(np.median(nbytes)), "regions": float(np.median(regions)),
            "gbps": float(np.median(nbytes) / np.median(secs) / 1e9),
            "tokens_equal": result["pd"] == result["single"],
            # the batch's times per request: P/D, its pulls, the same engine's own decode
            "pd_ms": result["generate_s"] / n * 1e3,
            "transfer_ms": float(pulled.sum()) / n * 1e3,
            "decode_ms": (result["single_s"] - result["single_prefill_s"]) / n * 1e3}


def run(args=None, *, requests: int = 6, prompt_len: int = 256, layers: int = 32,
        workdir=None, progress=print) -> dict:
    """Run the pairs; returns {label: per-request figures}, the goal lines and the printed
    ``report``.  ``args`` (``kvabi bench vllm``'s options) only chooses quiet output with
    ``--json``: this section keeps its own model (``layers`` deep) and prompts."""
    if args is not None and getattr(args, "json", False):
        progress = lambda *_: None  # noqa: E731
    from .checkpoints import prompts, write_checkpoint
    from .pd import run_pair

    work = Path(workdir or tempfile.mkdtemp(prefix="kvabi-bench-pd-"))
    model = write_checkpoint("llama", work / "model", layers=layers)
    ps = prompts(requests, lengths=(prompt_len,), shared_prefix=0, seed=3)
    out = {}
    for label, pre, dec in RUNS:
        dl = dec.get("layout") or dec.get("env", {}).get("KVABI_VLLM_LAYOUT", "LBHNC")
        progress(f"  P/D: {label} (prefill {pre.get('layout', 'LBHNC')}/{pre['block_size']}, "
                 f"decode {dl}/{dec['block_size']}) ...")
        out[label] = _per_request(run_pair(model, ps, work / label.replace(" ", "_"),
                                           prefill=pre, decode=dec, max_tokens=4))
    same, nixl, rel, cross, other = (out[r[0]] for r in RUNS)
    out["goals"] = [
        ("KvabiConnector same layout >= NixlConnector throughput per request",
         same["gbps"] / nixl["gbps"], 1.0, ">="),
        ("relayout >= 1/2 of same-layout throughput", rel["gbps"] / same["gbps"], 0.5, ">="),
        ("vLLM's CPU attention -> kvabi backend relayout >= 1/2 of same-layout throughput",
         other["gbps"] / same["gbps"], 0.5, ">="),
        ("cross-layer >= 32x fewer regions than per-layer",
         same["regions"] / cross["regions"], 32.0, ">="),
    ] + [(f"{label}: P/D per request <= transfer + 1.1x the engine's own decode "
          f"((P/D - transfer) / decode)",
          (out[label]["pd_ms"] - out[label]["transfer_ms"]) / out[label]["decode_ms"], 1.1,
          "<=") for label in ("kvabi same layout", "kvabi relayout, other backend")]
    out["report"] = report(out)
    return out


def report(out: dict) -> str:
    lines = ["P/D transfer per request (decode side's NIXL READs; medians over requests; "
             "GB/s = median bytes / median time; P/D, transfer and the engine's own "
             "decode: the batch's times per request):",
             f"  {'run':30s} {'read ms':>9s} {'pull ms':>20s} {'MiB':>7s} {'regions':>8s} "
             f"{'GB/s':>7s} {'P/D ms':>8s} {'xfer ms':>8s} {'decode ms':>9s}  tokens"]
    for label, *_ in RUNS:
        r = out[label]
        pull = "-" if r.get("pull_s") is None else \
            "{:.1f} ({:.1f}, {:.1f})".format(*(v * 1e3 for v in r["pull_s"]))
        lines.append(f"  {label:30s} {r['read_s'] * 1e3:9.2f} {pull:>20s} "
                     f"{r['bytes'] / 2**20:7.2f} {r['regions']:8.0f} {r['gbps']:7.2f} "
                     f"{r['pd_ms']:8.1f} {r['transfer_ms']:8.1f} {r['decode_ms']:9.1f}  "
                     f"{'= single engine' if r['tokens_equal'] else 'DIFFER'}")
    lines.append("  (pull ms: a request's whole pull (of it: the grant record read and "
                 "checked, the checksums of every token); xfer ms: the batch's pulls per "
                 "request)")
    for what, measured, goal, sense in out["goals"]:
        # no verdict word: on a loaded machine a figure past its goal means slow here
        lines.append(f"  goal: {what}: {sense} {goal:g}x; measured: {measured:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvabi_vllm.tools.bench_pd",
                                 description="P/D KV transfer per request: KvabiConnector vs "
                                             "vLLM's NixlConnector, relayout, cross-layer")
    ap.add_argument("--requests", type=int, default=6,
                    help="prompts per pair, each one request (default 6)")
    ap.add_argument("--prompt-len", type=int, default=256,
                    help="tokens per prompt, all moved (default 256)")
    ap.add_argument("--layers", type=int, default=32,
                    help="layers of the Llama-like model (default 32: per-layer and "
                         "cross-layer region counts differ as in a real model)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    out = run(requests=a.requests, prompt_len=a.prompt_len, layers=a.layers,
              progress=(lambda *_: None) if a.json else print)
    print(json.dumps(out, indent=1) if a.json else out["report"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
