"""The P/D proxy under attack (``kvabi-vllm guard``'s proxy case, ``specs/security.md``
section 5.5): request bodies a client may send the proxy, each answered alone with a 4xx
naming what is wrong (never a 500, never a grant held for nobody), honest requests served
beside them, and the prefill server holding no blocks soon after (long before its
``hold_timeout_s``).

:func:`proxy_attacks` runs them against a running pair (``serving.pd_servers``); the
serving tests call it on their shared servers and ``kvabi-vllm guard`` on its own.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time

from .serving import MODEL

#: attack -> (what it tries, the request body (bytes), the status, what the message says)
ATTACKS = {
    "deep-array": ("a JSON body nested 100,000 arrays deep", b"[" * 100_000 + b"]" * 100_000,
                   400, r"request body: nested 100000 deep, more than the limit of 64"),
    "deep-object": ("a JSON body nested 100,000 objects deep",
                    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
                    400, r"request body: nested 100000 deep"),
    "duplicate-key": ("the prompt given twice (servers would disagree which one counts)",
                      b'{"model": "tiny", "prompt": "hi", "prompt": "ho", "max_tokens": 4}',
                      400, r"request body: duplicate key 'prompt'"),
    "nan": ("NaN as a temperature (not JSON)",
            b'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": NaN}',
            400, r"request body: NaN"),
    "not-utf8": ("bytes that are not UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}',
                 400, r"request body: not UTF-8"),
    "huge": ("a body of 17 MiB", b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}',
             413, r"request body: 1782\d+ bytes, more than the limit of 16777216"),
    "batch": ("a batch of two prompts (the prefill server returns the first's parameters)",
              json.dumps({"model": MODEL, "prompt": ["Hello", "World"],
                          "max_tokens": 4}).encode(),
              400, r"prompt: a batch of 2 prompts"),
    "token-batch": ("a batch of two tokenized prompts",
                    json.dumps({"model": MODEL, "prompt": [[72, 105], [72, 111]],
                                "max_tokens": 4}).encode(),
                    400, r"prompt: a batch of 2 prompts"),
    "n": ("n = 3 sequences of one prompt",
          json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "n": 3}).encode(),
          400, r"n: 3: the P/D proxy hands one sequence's KV"),
    "chat-n": ("a chat with n = 2", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "n": 2}).encode(), 400, r"n: 2: "),
    "beam": ("beam search", json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                        "use_beam_search": True}).encode(),
             400, r"use_beam_search: beam search keeps several sequences"),
    "stream-string": ("stream given as the string 'false'", json.dumps({
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": "false"}).encode(),
        400, r"stream: must be true or false, got 'false'"),
    # the prefill server accepts it (one token), the decode server refuses it: the grant
    # the prefill server issued must not stay held
    "decode-refuses": ("a request the decode server refuses after the prefill (max_tokens "
                       "beyond the model length)",
                       json.dumps({"model": MODEL, "prompt": "Hello there",
                                   "max_tokens": 100_000}).encode(),
                       400, r"max_tokens|maximum context length|model length"),
}
#: requests of the decode-refuses kind sent at once (each holds blocks until released)
REFUSED_AFTER_PREFILL = 6
HONEST = ("Hello there, how are you doing today?", "The quick brown fox jumps")


def _post(url: str, body: bytes, timeout: float):
    import httpx

    r = httpx.post(url + "/v1/completions" if b'"messages"' not in body[:200]
                   else url + "/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=timeout)
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:300]
    return r.status_code, str(message)


def _complete(url: str, prompt: str, timeout: float):
    import httpx

    r = httpx.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}, timeout=timeout)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def kv_usage(url: str) -> float:
    """The server's ``vllm:kv_cache_usage_perc`` (blocks held, held grants included)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    got = re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
    return max((float(v) for v in got), default=0.0)


def proxy_attacks(urls: dict, *, timeout: float = 120.0, free_within: float = 60.0) -> dict:
    """Every attack of :data:`ATTACKS` (the decode-refuses kind
    :data:`REFUSED_AFTER_PREFILL` times) at once through ``urls["proxy"]``, honest requests
    beside them, then the prefill server's blocks in use until none are (at most
    ``free_within`` seconds).  Returns ``{"attacks": {name: (status, message)}, "honest":
    {prompt: (through the proxy, from the decode server alone)}, "freed_s": seconds until the
    prefill server held no blocks (None: not within free_within), "usage_after": its last
    reading}``."""
    proxy = urls["proxy"]
    jobs = [(name, body) for name, (_, body, _, _) in ATTACKS.items()]
    jobs += [(f"decode-refuses-{i}", ATTACKS["decode-refuses"][1])
             for i in range(1, REFUSED_AFTER_PREFILL)]
    with cf.ThreadPoolExecutor(8) as ex:
        honest = {p: ex.submit(_complete, proxy, p, timeout) for p in HONEST}
        attacked = {name: ex.submit(_post, proxy, body, timeout) for name, body in jobs}
        got = {name: f.result() for name, f in attacked.items()}
        honest = {p: f.result() for p, f in honest.items()}
    alone = {p: _complete(urls["decode"], p, timeout) for p in HONEST}
    t0, usage = time.monotonic(), kv_usage(urls["prefill"])
    while usage > 0 and time.monotonic() - t0 < free_within:
        time.sleep(0.5)
        usage = kv_usage(urls["prefill"])
    return {"attacks": got, "honest": {p: (honest[p], alone[p]) for p in HONEST},
            "freed_s": time.monotonic() - t0 if usage == 0 else None, "usage_after": usage}


#: the servers' options (a short model length: the decode-refuses attack exceeds it)
SERVER_ARGS = ("--max-model-len", "512", "--max-num-seqs", "8", "--no-enable-prefix-caching")


def proxy_case(work, model=None) -> dict:
    """Start the quick start's pair behind the proxy in ``work`` (a tiny llama with a
    tokenizer written there unless ``model``) and run :func:`proxy_attacks`."""
    from pathlib import Path

    from .checkpoints import write_checkpoint
    from .serving import pd_servers

    work = Path(work)
    model = model or write_checkpoint("llama", work / "model", tokenizer=True)
    with pd_servers(model, work, server_args=SERVER_ARGS) as urls:
        return proxy_attacks(urls)


def summary(run: dict) -> tuple[list[str], bool]:
    """A line per attack and honest request, and whether every rule held."""
    lines, ok = [], True
    for name, (status, message) in sorted(run["attacks"].items()):
        kind = name if name in ATTACKS else name.rsplit("-", 1)[0]
        what, _, want, pattern = ATTACKS[kind]
        good = status == want and re.search(pattern, message) is not None
        ok &= good
        lines.append(f"proxy {name:<18} {status}  {what}; "
                     f"{'refused' if good else 'NOT refused as it should be'}: {message[:120]}")
    for prompt, (via, alone) in run["honest"].items():
        good = via == alone and len(via) > 0
        ok &= good
        lines.append(f"proxy honest {prompt[:20]!r:<24} "
                     f"{'the decode server' if good else 'NOT the decode server'}'s tokens")
    freed = run["freed_s"]
    ok &= freed is not None
    lines.append(f"proxy: the prefill server held no blocks "
                 f"{f'{freed:.1f} s after' if freed is not None else 'NOT within the wait'} "
                 f"(its hold_timeout_s is 120 s)")
    return lines, ok


__all__ = ["ATTACKS", "HONEST", "REFUSED_AFTER_PREFILL", "SERVER_ARGS", "kv_usage",
           "proxy_attacks", "proxy_case", "summary"]
