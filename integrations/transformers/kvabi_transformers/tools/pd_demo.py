"""``kvabi-transformers pd-demo``: one prompt prefilled by vLLM and decoded by transformers,
and the reverse, over HTTP through ``kvabi proxy``, as people serve both engines
(``kvabi-vllm serve`` from vLLM's own environment, ``kvabi-transformers serve`` here).

It prints both engines' layouts, the relayout each consumer negotiated with the other's
layout (from the servers' logs), the tokens of each direction and whether they equal the
decoding server's own tokens for the same prompt.  Exit status 0 when both directions do.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .pd_servers import MODEL, Engine, call, pd_servers

#: the pair the demo starts: its layouts and block sizes differ on each side
TRANSFORMERS = Engine("transformers", block_size=16, backend="example.torch",
                      layout="flashinfer.HND")
VLLM = Engine("vllm", block_size=32)
PROMPT = "Prefill on one engine, decode on another: the KV moves, the tokens stay."


def complete(url: str, prompt: str, max_tokens: int) -> tuple[list, str]:
    status, got = call(url + "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}, timeout=300)
    if status != 200:
        raise RuntimeError(f"{url}: {status} {str(got)[:500]}")
    c = got["choices"][0]
    return list(c["token_ids"]), c["text"]


def negotiated(log: Path) -> list[str]:
    """The negotiation lines a consumer logged (what it reads, and the relayout)."""
    return [m.group(1) for m in re.finditer(r"(group \d+ part \S+ \(rank.*)", log.read_text())]


def vllm_layouts(log: Path) -> list[str]:
    """What vLLM's connector said it serves (its cache groups' layouts)."""
    return [m.group(1) for m in re.finditer(r"(\d+ KV cache group\(s\): .*)", log.read_text())]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="kvabi-transformers pd-demo",
        description="One prompt prefilled by vLLM and decoded by transformers, and the "
                    "reverse, over HTTP through kvabi proxy; prints both engines' layouts "
                    "and the relayout each consumer negotiated.")
    p.add_argument("--vllm-python", required=True,
                   help="the Python of vLLM's environment (e.g. .venv-vllm/bin/python)")
    p.add_argument("--tokens", type=int, default=12, help="tokens to generate (default 12)")
    p.add_argument("--workdir", default=None, help="where checkpoint and logs go (default: "
                                                   "a temporary directory)")
    a = p.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvabi-pd-demo-"))
    model = work / "llama"
    print(f"P/D across engines: a random Llama-like checkpoint in {model}; servers' logs in "
          f"{work}", flush=True)
    subprocess.run([a.vllm_python, "-m", "kvabi_vllm.tools.checkpoints", str(model)],
                   check=True, capture_output=True, timeout=600)
    engines = {"transformers": TRANSFORMERS, "vllm": VLLM}
    print("  starting " + "; ".join(f"{k}: {e.describe()}" for k, e in engines.items())
          + " (a few minutes on a small CPU) ...", flush=True)
    ok = True
    with pd_servers(model, work, engines, {"v2t": ("vllm", "transformers"),
                                           "t2v": ("transformers", "vllm")},
                    vllm_python=a.vllm_python) as run:
        urls, logs = run["urls"], run["logs"]
        for direction, (prefill, decode) in (("v2t", ("vllm", "transformers")),
                                             ("t2v", ("transformers", "vllm"))):
            got, text = complete(urls[direction], PROMPT, a.tokens)
            own, _ = complete(urls[decode], PROMPT, a.tokens)
            same = got == own
            ok &= same
            print(f"  prefilled by {prefill}, decoded by {decode} (through the proxy): "
                  f"{got}\n    {'equal to' if same else 'DIFFERENT FROM'} {decode}'s own "
                  f"tokens {own}; text {text!r}")
        # after the requests: transformers starts its batching manager (and the P/D
        # connector whose parts this reports) with the first request
        status = call(urls["transformers"] + "/kvabi/status", timeout=60)[1]
        t = status["models"][0]
        print(f"  transformers serves {t['backend']} layouts {t['layouts']}, "
              f"{t['block_size']}-token blocks; P/D parts {t['pd']['parts']}")
        for line in vllm_layouts(logs["vllm"]):
            print(f"  vLLM serves {line}")
        for name in ("transformers", "vllm"):
            for line in negotiated(logs[name])[:2]:
                print(f"  {name} as consumer negotiated: {line}")
    print(f"  P/D across engines: {'tokens equal both ways' if ok else 'TOKENS DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
