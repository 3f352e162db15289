"""Serving P/D as people serve vLLM, over HTTP on loopback with the ``openai`` client.

Started once for the module, each with the real command: a prefill server (``kvabi-vllm
serve``, vLLM's own CPU attention, LBHNC, 32-token blocks, KvabiConnector kv_producer), a
decode server (``kvabi-vllm serve`` on the kvabi backend example.torch, cross-layer BLHNC,
64-token blocks, KvabiConnector kv_consumer) and ``kvabi-vllm proxy`` in front of them.

Every answer through the proxy equals the decode server's own answer to the same request
(one server computing alone: prefix caching is off, so nothing it computed before is
reused); the decode server's ``/metrics`` shows the pulls that made it; concurrent
requests, streamed or not, completions and chat, each get their own answer; requests the
servers or the proxy refuse fail alone, with a status and a message, and the next request is
served; every call is bounded by a timeout."""
import concurrent.futures as cf
import re
import time

import httpx
import openai
import pytest

from kvabi_vllm.tools.checkpoints import write_checkpoint
from kvabi_vllm.tools.serving import MODEL, pd_servers

START_TIMEOUT = 420.0  # two vLLM servers starting side by side on two shared cores
CALL_TIMEOUT = 120.0
PROMPTS = ["Hello there, how are you doing today?", "The quick brown fox jumps",
           "kvabi moves KV caches between layouts", "One two three four five six seven",
           "What is a prefill?", "Serving P/D over HTTP", "A", "Block sizes differ here"]
GREEDY = {"temperature": 0.0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """{"proxy", "prefill", "decode": base URLs, "logs": {name: path}}, all serving."""
    root = tmp_path_factory.mktemp("serving")
    model = write_checkpoint("llama", root / "model", tokenizer=True)
    args = ["--max-model-len", "512", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    with pd_servers(model, root, server_args=args, proxy_timeout=CALL_TIMEOUT,
                    start_timeout=START_TIMEOUT) as urls:  # a start failure shows the logs
        yield urls


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=CALL_TIMEOUT,
                         max_retries=0)


def complete(url: str, prompt: str, max_tokens: int = 8) -> tuple[list[int], str]:
    r = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                       **GREEDY)
    return list(r.choices[0].token_ids), r.choices[0].text


def stream(url: str, prompt: str, max_tokens: int = 8) -> tuple[list[int], str]:
    ids, text = [], ""
    for chunk in client(url).completions.create(model=MODEL, prompt=prompt,
                                                max_tokens=max_tokens, stream=True, **GREEDY):
        for c in chunk.choices:
            ids += list(getattr(c, "token_ids", None) or [])
            text += c.text
    return ids, text


def pulls(url: str) -> float:
    """Pulls the decode server counted, relayouted or not (its /metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r'^vllm:kvabi_pulls_total\{[^}]*\} (\S+)$', text,
                                            re.M))


def wait_pulls(url: str, at_least: float) -> float:
    deadline = time.monotonic() + 30  # vLLM hands stats to its loggers after a step
    while (n := pulls(url)) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    return n


@pytest.fixture(scope="module")
def single(pd):
    """The decode server's own answers (one server computing alone), per prompt."""
    with cf.ThreadPoolExecutor(8) as ex:
        return dict(zip(PROMPTS, ex.map(lambda p: complete(pd["decode"], p), PROMPTS)))


def test_a_completion_through_the_proxy_equals_one_server_and_moved_kv(pd, single):
    before = pulls(pd["decode"])
    for p in PROMPTS[:3]:
        ids, text = complete(pd["proxy"], p)
        assert len(ids) == 8 and (ids, text) == single[p], p
    assert min(len(set(single[p][0])) for p in PROMPTS) > 1, "degenerate answers"
    assert wait_pulls(pd["decode"], before + 3) >= before + 3


def test_streaming_through_the_proxy_gives_the_same_answer(pd, single):
    for p in PROMPTS[3:5]:
        assert stream(pd["proxy"], p) == single[p]


def test_chat_through_the_proxy_equals_one_server(pd):
    msgs = [{"role": "user", "content": "Say something about KV caches."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0.0,
              extra_body={"ignore_eos": True})
    want = client(pd["decode"]).chat.completions.create(**kw).choices[0].message.content
    got = client(pd["proxy"]).chat.completions.create(**kw).choices[0].message.content
    assert got == want and want


def test_concurrent_requests_each_get_their_own_answer(pd, single):
    calls = [(stream if i % 2 else complete, p) for i, p in enumerate(PROMPTS)]
    with cf.ThreadPoolExecutor(len(calls)) as ex:
        got = list(ex.map(lambda c: c[0](pd["proxy"], c[1]), calls))
    assert got == [single[p] for p in PROMPTS]


def test_bad_requests_fail_alone_and_the_next_request_is_served(pd, single):
    proxy = pd["proxy"]
    bad = {
        "too long": {"model": MODEL, "prompt": "x" * 2000, "max_tokens": 4},
        "negative max_tokens": {"model": MODEL, "prompt": "hi", "max_tokens": -1},
        "unknown model": {"model": "nope", "prompt": "hi", "max_tokens": 4},
        "not an object": [1, 2, 3],
    }

    def post(body):
        return httpx.post(proxy + "/v1/completions", json=body, timeout=CALL_TIMEOUT)

    with cf.ThreadPoolExecutor(8) as ex:
        good = [ex.submit(complete, proxy, p) for p in PROMPTS[:3]]
        refused = {k: ex.submit(post, b) for k, b in bad.items()}
        broken = ex.submit(lambda: httpx.post(proxy + "/v1/completions", content=b"{oops",
                                              timeout=CALL_TIMEOUT))
    assert [g.result() for g in good] == [single[p] for p in PROMPTS[:3]]
    for what, f in {**refused, "not JSON": broken}.items():
        r = f.result()
        assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
        assert r.json()["error"]["message"], what
    assert complete(proxy, PROMPTS[5]) == single[PROMPTS[5]]


def test_health_models_and_logs_say_what_runs(pd):
    assert httpx.get(pd["proxy"] + "/health", timeout=30).json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(pd["proxy"] + "/v1/models",
                                       timeout=30).json()["data"]] == [MODEL]
    decode, prefill = pd["logs"]["decode"].read_text(), pd["logs"]["prefill"].read_text()
    # the decode server's main process and its worker name the kvabi backend and layouts
    assert re.search(r"APIServer.*attention on kvabi backend example\.torch, kvabi layout "
                     r"\S+ in vLLM's layout BLHNC", decode), decode[-3000:]
    assert re.search(r"Worker.*on kvabi backend example\.torch, kvabi layout \S+@vllm\.BLHNC",
                     decode)
    assert re.search(r"KvabiConnector: 1 KV cache group\(s\)", prefill)
    assert "kvabi-vllm proxy: prefill" in pd["logs"]["proxy"].read_text()
