"""The engine-neutral P/D proxy (``kvabi proxy``, specs/pd.md 4.7) between two stand-in
servers (the standard library's HTTP server, recording what they get): the producer gets
the client's request with one token, no stream and the ask; the consumer gets the client's
own request with the producer's answer, and its answer reaches the client, streamed as it
comes; what the proxy refuses no server sees; servers' refusals go back alone."""
import asyncio
import http.client
import http.server
import json
import threading
import time

import pytest

from kvabi.pd.proxy import Proxy

ANSWER = {"kvabi_pd": [1, 0], "do_remote_prefill": True, "kvabi_grant": {"slot": 1}}


class Upstream(http.server.ThreadingHTTPServer):
    """A stand-in server: ``answer(path, body) -> (status, body bytes or a list of chunks)``;
    ``seen`` lists the bodies it got."""

    daemon_threads = True

    def __init__(self, answer):
        self.answer, self.seen = answer, []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                self._reply(*self.server.answer(self.path, None))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.server.seen.append(body)
                self._reply(*self.server.answer(self.path, body))

            def _reply(self, status, out):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if isinstance(out, list):  # streamed, chunked, with pauses
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for c in out:
                        self.wfile.write(f"{len(c):x}\r\n".encode() + c + b"\r\n")
                        self.wfile.flush()
                        time.sleep(0.05)
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


def producer_answer(path, body):
    if path == "/health" or path == "/v1/models":
        return 200, b'{"data": []}'
    if body.get("model") == "refuse-me":
        return 400, b'{"error": {"message": "model: no such model"}}'
    if body.get("model") == "no-params":
        return 200, b'{"choices": []}'
    return 200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": ANSWER}).encode()


def consumer_answer(path, body):
    if path == "/health":
        return 200, b"{}"
    if path == "/v1/models":
        return 200, b'{"data": [{"id": "tiny"}]}'
    if body.get("stream"):
        return 200, [f"data: {i}\n\n".encode() for i in range(4)] + [b"data: [DONE]\n\n"]
    return 200, json.dumps({"echo": body}).encode()


@pytest.fixture(scope="module")
def pair():
    p, d = Upstream(producer_answer), Upstream(consumer_answer)
    proxy = Proxy(p.url, d.url, timeout=10, max_body=4096, nixl_host=None)
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(proxy.serve("127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield p, d, server.sockets[0].getsockname()[1]
    loop.call_soon_threadsafe(server.close)
    p.shutdown()
    d.shutdown()


def _post(port, path, body, conn=None):
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    c.request("POST", path, raw, {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


def test_a_request_is_prefilled_then_decoded_with_the_answer(pair):
    p, d, port = pair
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "stream_options": {}}
    status, out = _post(port, "/v1/completions", body)
    assert status == 200
    got = p.seen[-1]
    assert got["max_tokens"] == 1 and got["stream"] is False and "stream_options" not in got
    assert got["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert json.loads(out)["echo"] == {**body, "kv_transfer_params": ANSWER}
    assert d.seen[-1] == {**body, "kv_transfer_params": ANSWER}


def test_a_stream_is_relayed_as_it_comes_and_the_connection_kept(pair):
    _, _, port = pair
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    c.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [], "stream": True, "max_completion_tokens": 5}),
        {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Transfer-Encoding") == "chunked"
    t0 = time.monotonic()
    first = r.read1(100)  # the first event, before the consumer has sent the rest
    assert first.startswith(b"data: 0") and time.monotonic() - t0 < 0.2
    rest = r.read()
    assert (first + rest).endswith(b"data: [DONE]\n\n")
    # the same connection carries the next request
    status, _ = _post(port, "/v1/completions", {"model": "tiny", "prompt": "a"}, conn=c)
    assert status == 200


REFUSED = [
    (b"not json", 400, "request body: not valid JSON"),
    (b"[1, 2]", 400, "request body: must be a JSON object"),
    (b'{"a": 1, "a": 2}', 400, "request body: duplicate key 'a'"),
    (b'{"a": NaN}', 400, "request body:"),
    (b'{"a": ' * 600 + b"1" + b"}" * 600, 413,
     "request body: 4201 bytes, more than the limit of 4096"),
    (b'{"a": ' * 70 + b"1" + b"}" * 70, 400, "request body: nested 70 deep"),
    ({"prompt": "a", "n": 2}, 400, "n: 2"),
    ({"prompt": "a", "n": True}, 400, "n: True"),
    ({"prompt": "a", "best_of": 3}, 400, "best_of: 3"),
    ({"prompt": "a", "use_beam_search": True}, 400, "use_beam_search:"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream: must be true or false"),
    ({"prompt": ["a", "b"]}, 400, "prompt: a batch of 2 prompts"),
    ({"prompt": [[1, 2], [3]]}, 400, "prompt: a batch of 2 prompts"),
]


@pytest.mark.parametrize("body,status,message", REFUSED)
def test_what_the_proxy_refuses_no_server_sees(pair, body, status, message):
    p, d, port = pair
    before = (len(p.seen), len(d.seen))
    got, out = _post(port, "/v1/completions", body)
    assert got == status and message in json.loads(out)["error"]["message"]
    assert (len(p.seen), len(d.seen)) == before


def test_a_body_stated_too_large_is_refused_before_it_is_read(pair):
    import socket

    _, _, port = pair
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000"
                  b"\r\n\r\n{")
        got = s.recv(4096)
    assert got.startswith(b"HTTP/1.1 413") and b"more than the limit of 4096" in got


def test_one_prompt_in_a_list_and_n_1_pass(pair):
    _, _, port = pair
    assert _post(port, "/v1/completions", {"prompt": [[1, 2, 3]], "n": 1})[0] == 200


def test_servers_refusals_go_back_alone(pair):
    _, d, port = pair
    before = len(d.seen)
    status, out = _post(port, "/v1/completions", {"model": "refuse-me", "prompt": "a"})
    assert status == 400 and b"no such model" in out
    status, out = _post(port, "/v1/completions", {"model": "no-params", "prompt": "a"})
    assert status == 502 and b"answered without kv_transfer_params" in out
    assert len(d.seen) == before
    assert _post(port, "/v1/completions", {"model": "tiny", "prompt": "a"})[0] == 200


def test_models_health_and_a_server_down():
    p, d = Upstream(producer_answer), Upstream(consumer_answer)
    proxy = Proxy(p.url, d.url, timeout=5, nixl_host=None)
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(proxy.serve("127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = server.sockets[0].getsockname()[1]

    def get(path):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()

    assert get("/v1/models") == (200, b'{"data": [{"id": "tiny"}]}')
    assert get("/health")[0] == 200
    assert get("/nothing")[0] == 404
    d.shutdown()
    d.server_close()
    status, out = get("/health")
    assert status == 503 and b"decode server" in out
    status, out = _post(port, "/v1/completions", {"prompt": "a"})
    assert status == 502 and b"decode server" in out
    loop.call_soon_threadsafe(server.close)
    p.shutdown()


def test_the_proxy_releases_the_grant_of_a_request_the_consumer_refused():
    """A real producer (kvabi.pd over a numpy cache) behind the producer stand-in: the
    consumer refuses the request (400), the proxy relays that, and releases the grant it
    took: the producer frees the blocks long before hold_timeout_s."""
    import numpy as np

    import kvabi
    from kvabi.pd import ASK, CacheGroup, Endpoint, EngineCaches, PDSettings
    from kvabi.transfer import nixl

    if not nixl.available()[0]:
        pytest.skip(nixl.available()[1])
    spec = kvabi.KVSpec("full", block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
    cache = kvabi.KVCache.allocate(kvabi.Layout.preset("vllm.LBHNC", spec, num_blocks=8,
                                                       num_layers=2))
    producer = Endpoint(PDSettings(role="producer", hold_timeout_s=600),
                        EngineCaches([CacheGroup.of(cache)], block_size=16, max_tokens=64))
    answers = []

    def prefill(path, body):
        if path == "/health":
            return 200, b"{}"
        hold, ans = producer.finished(f"r{len(answers)}", ASK, normal=True,
                                      tokens=list(range(20)), num_computed=20, blocks=[[3, 5]])
        answers.append(ans)
        return 200, json.dumps({"choices": [], "kv_transfer_params": ans}).encode()

    p = Upstream(prefill)
    d = Upstream(lambda path, body: (400, b'{"error": {"message": "max_tokens: -1"}}'))
    proxy = Proxy(p.url, d.url, timeout=20)
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(proxy.serve("127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        status, _ = _post(server.sockets[0].getsockname()[1], "/v1/completions",
                          {"prompt": "a", "max_tokens": -1})
        assert status == 400 and len(answers) == 1
        freed, t0 = set(), time.monotonic()
        while "r0" not in freed and time.monotonic() - t0 < 60:
            freed |= producer.step().sent
            time.sleep(0.02)
        assert "r0" in freed, "the producer still holds the grant the proxy took"
        assert proxy.releaser.sent == 1 and proxy.releaser.failed == 0
    finally:
        loop.call_soon_threadsafe(server.close)
        p.shutdown()
        d.shutdown()
        proxy.releaser.close()
        producer.close()
