"""``kvabi bench vllm``'s serving section: P/D through ``kvabi-vllm proxy`` over HTTP against
one server, side by side.

The README's pair (:func:`kvabi_vllm.tools.serving.pd_servers`: prefill on vLLM's CPU
attention, LBHNC/32; decode on example.torch, BLHNC/64; KvabiConnector) behind the proxy.
Requests alternate between the proxy and the decode server itself (one server computing
its own prefill), one at a time, each streamed with the same prompt length and greedy
tokens; per path: median time to first token and median decode tokens/s (tokens after the
first over the time from the first to the last).  Prefix caching is off on both servers.
"""
from __future__ import annotations

import json
import statistics
import time


def _stream(url: str, prompt: list[int], new_tokens: int, timeout: float) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s) of one streamed completion."""
    import httpx

    from .serving import MODEL

    body = {"model": MODEL, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            n = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
            stamps += [time.perf_counter()] * n
    if len(stamps) != new_tokens:
        raise RuntimeError(f"{url}: streamed {len(stamps)} tokens, asked {new_tokens}")
    return stamps[0] - t0, (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


def run(model, workdir, *, requests: int = 6, prompt_len: int = 256, new_tokens: int = 32,
        progress=print) -> dict:
    """Figures per path ("proxy P/D", "one server") and the servers' settings."""
    from .checkpoints import prompts
    from .serving import pd_servers

    ps = prompts(requests, lengths=(prompt_len,), shared_prefix=0, seed=7)
    progress("  serving: starting the prefill and decode servers and the proxy ...")
    args = ["--max-model-len", str(prompt_len + new_tokens + 16), "--no-enable-prefix-caching"]
    with pd_servers(model, workdir, server_args=args) as urls:
        paths = {"proxy P/D": urls["proxy"], "one server": urls["decode"]}
        for url in paths.values():  # warm-up
            _stream(url, ps[0], 4, 300.0)
        got = {k: [] for k in paths}
        for i, p in enumerate(ps):
            for k in (paths if i % 2 == 0 else reversed(list(paths))):
                got[k].append(_stream(paths[k], p, new_tokens, 300.0))
            progress(f"  serving: request {i + 1}/{requests}")
    out = {k: {"ttft_ms": statistics.median(t for t, _ in v) * 1e3,
               "tokens_per_s": statistics.median(r for _, r in v)} for k, v in got.items()}
    out["setting"] = {"requests": requests, "prompt_len": prompt_len,
                      "new_tokens": new_tokens}
    return out


def report(out: dict) -> str:
    s = out["setting"]
    lines = [f"Serving over HTTP (streamed completions, {s['prompt_len']} prompt tokens, "
             f"{s['new_tokens']} greedy tokens, one request at a time, paths alternating, "
             f"medians of {s['requests']}): through kvabi-vllm proxy (prefill vLLM CPU "
             f"attention LBHNC/32 -> decode example.torch BLHNC/64) and one server (the "
             f"decode server computing its own prefill)",
             f"  {'path':12s} {'TTFT ms':>9s} {'tokens/s':>9s}"]
    for k in ("proxy P/D", "one server"):
        lines.append(f"  {k:12s} {out[k]['ttft_ms']:9.1f} {out[k]['tokens_per_s']:9.1f}")
    return "\n".join(lines)
