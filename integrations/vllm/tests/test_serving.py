"""Serving P/D as people serve vLLM, over HTTP on loopback with the ``openai`` client.

Started once for the module, each with the real command and in a session of its own (as
separate terminals or service units start them: ``setsid``): a prefill server
(``kvabi-vllm serve``, vLLM's own CPU attention, LBHNC, 32-token blocks, KvabiConnector
kv_producer), a decode server (``kvabi-vllm serve`` on the kvabi backend example.torch,
cross-layer BLHNC, 64-token blocks, KvabiConnector kv_consumer) and ``kvabi-vllm proxy`` in
front of them.  Every wait says what it waited for.

Every answer through the proxy equals the decode server's own answer to the same request
(one server computing alone: prefix caching is off, so nothing it computed before is
reused); the decode server's ``/metrics`` shows the pulls that made it; concurrent
requests, streamed or not, completions and chat, each get their own answer; requests the
servers or the proxy refuse fail alone, with a status and a message, and the next request is
served; every call is bounded by a timeout.  The proxy's guard (``kvabi-vllm guard``'s proxy
case, ``kvabi_vllm.tools.guard_proxy``) runs on the same servers: hostile bodies, batches,
n > 1 and requests the decode server refuses, each a 400 naming its field, and the prefill
server holding no blocks soon after; a prefill server holding a grant nobody reads stays
idle."""
import concurrent.futures as cf
import os
import re
import time

import httpx
import openai
import psutil
import pytest

from kvabi_vllm.tools import guard_proxy
from kvabi_vllm.tools.checkpoints import write_checkpoint
from kvabi_vllm.tools.serving import MODEL, pd_servers

#: two vLLM servers starting side by side on two shared cores; a start whose logs stop
#: growing fails sooner, saying which server it waited for
START_TIMEOUT = 1200.0
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
    with pd_servers(model, root, server_args=guard_proxy.SERVER_ARGS,
                    proxy_timeout=CALL_TIMEOUT, start_timeout=START_TIMEOUT,
                    session=True) as urls:  # a start failure shows the logs
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


def wait_pulls(url: str, at_least: float, limit: float = 60.0) -> float:
    """Until the decode server's /metrics count ``at_least`` pulls (vLLM hands stats to its
    loggers after a step); AssertionError saying so after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while (n := pulls(url)) < at_least:
        assert time.monotonic() < deadline, \
            f"waited {limit:g} s for {at_least:g} pulls in {url}/metrics, it counts {n:g}"
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


def test_the_servers_run_in_sessions_of_their_own_and_move_kv(pd, single):
    """Started as separate terminals or service units start them (each its own session):
    P/D works, the KV pulled over NIXL between the two sessions."""
    for name, pid in pd["pids"].items():
        assert os.getsid(pid) == pid, f"{name} is not in a session of its own"
    before = pulls(pd["decode"])
    assert complete(pd["proxy"], PROMPTS[6]) == single[PROMPTS[6]]
    assert wait_pulls(pd["decode"], before + 1) >= before + 1


def test_the_proxy_refuses_what_it_cannot_hand_over_whole_and_holds_nothing(pd):
    """Every hostile body a 400 naming what is wrong (not a 500 from a RecursionError), a
    batch, n > 1 and beam search refused before the prefill server sees them, requests the
    decode server refuses after the prefill released at once: honest requests beside them
    get the decode server's own tokens, and the prefill server holds no blocks seconds
    later (not after its hold_timeout_s of 120 s)."""
    run = guard_proxy.proxy_attacks(pd, timeout=CALL_TIMEOUT, free_within=60.0)
    lines, ok = guard_proxy.summary(run)
    assert ok, "\n".join(lines)
    for name, (status, message) in run["attacks"].items():
        kind = name if name in guard_proxy.ATTACKS else name.rsplit("-", 1)[0]
        _, _, want, pattern = guard_proxy.ATTACKS[kind]
        assert status == want and re.search(pattern, message), (name, status, message)
    assert run["freed_s"] is not None, f"the prefill server still holds blocks: {run}"


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants so far."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def test_a_prefill_server_holding_a_grant_nobody_reads_stays_idle(pd):
    """A grant held for a decode engine that never comes (kv_transfer_params asked of the
    prefill server directly) costs the prefill server about what it costs idle, measured
    side by side: vLLM stepped such an engine every millisecond and its message queues
    spun, about 1.2 cores until the grant expired (kvabi_vllm.engine_idle)."""
    pid, window = pd["pids"]["prefill"], 6.0
    time.sleep(2)  # whatever the earlier tests left settles
    c0 = _cpu_seconds(pid)
    time.sleep(window)
    idle = _cpu_seconds(pid) - c0
    r = httpx.post(pd["prefill"] + "/v1/completions", json={
        "model": MODEL, "prompt": "Hello, nobody reads this", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}, timeout=CALL_TIMEOUT)
    params = r.json()["kv_transfer_params"]
    assert params and "kvabi_grant" in params, r.text
    assert guard_proxy.kv_usage(pd["prefill"]) > 0, "the grant holds no blocks"
    time.sleep(1)
    c0 = _cpu_seconds(pid)
    time.sleep(window)
    holding = _cpu_seconds(pid) - c0
    assert guard_proxy.kv_usage(pd["prefill"]) > 0, "the grant was released meanwhile"
    # the spin this catches cost ~1.2 cores; a held grant's own polling measures 0.2-0.3
    # cores on a loaded 2-core host, so half a core separates the two with room
    assert holding <= max(5 * idle, 0.5 * window), \
        f"holding a grant: {holding / window:.2f} cores; idle: {idle / window:.2f} cores"
    # the grant freed the way the proxy frees one it does not hand over
    from kvabi.pd.release import GrantReleaser

    releaser = GrantReleaser()
    try:
        releaser.release_now(params)
        assert releaser.sent == 1 and releaser.failed == 0
        deadline = time.monotonic() + 60
        while guard_proxy.kv_usage(pd["prefill"]) > 0:
            assert time.monotonic() < deadline, "waited 60 s for the released grant's blocks"
            time.sleep(0.5)
    finally:
        releaser.close()
    print(f"prefill server: {idle / window:.3f} cores idle, {holding / window:.3f} holding "
          f"a grant")


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
