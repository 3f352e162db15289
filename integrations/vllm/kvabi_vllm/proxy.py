"""``kvabi-vllm proxy``: one OpenAI-compatible address in front of a prefill server and a
decode server that move KV with ``KvabiConnector`` (the shape of vLLM's own
disaggregated-serving proxy).

Per request (``/v1/completions``, ``/v1/chat/completions``):

1. the prefill server gets the request with one token to generate, no streaming, and
   ``kv_transfer_params={"do_remote_decode": true}``: it computes the prompt's KV, keeps
   its blocks and answers with the ``kv_transfer_params`` that say where they are;
2. the decode server gets the client's own request plus those ``kv_transfer_params``: it
   pulls the prompt's KV over NIXL (relayouting it where the two caches differ in layout,
   block size or backend) and generates; its answer goes back to the client as it comes,
   streamed when the client asked for a stream.

A request either server refuses gets that server's status and message, alone; other
requests carry on.  ``GET /v1/models`` is the decode server's; ``GET /health`` is healthy
when both servers are.

The body is untrusted (``specs/security.md`` section 5.5): it is read up to a size limit and
parsed by kvabi's one JSON reader (nesting, duplicate keys, NaN, size: a 400 naming what is
wrong, never a 500), and what the proxy cannot hand over whole is refused with a 400
naming the field before the prefill server sees it: a batch of prompts, ``n`` other than
1, beam search (vLLM returns the ``kv_transfer_params`` of the first prompt or sequence
only, so the prefill server would hold the others' blocks for nobody).  A grant the
prefill server issued is released as soon as the decode server's answer ends, whatever it
was (served, refused, failed, the client gone): the proxy sends the prefill server's ranks
the notification a decode engine sends once it has read the KV (a NIXL notification
naming the grant's slot and secret; one the decode engine already sent makes it a no-op),
so that nothing the proxy took stays held until ``hold_timeout_s``.
"""

import argparse
import asyncio
import collections
import concurrent.futures
import copy
import hashlib
import itertools
import logging
import sys
import time
import uuid

log = logging.getLogger("kvabi_vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
#: largest request body the proxy reads (bytes) and deepest nesting of its JSON
MAX_BODY = 16 * 2**20
MAX_DEPTH = 64
#: prefill engines' grant tables the proxy keeps connected (least recently used dropped)
MAX_TABLES = 16
#: seconds a notification is given to leave before the proxy's NIXL agent closes
FLUSH_S = 1.0


class BadRequest(ValueError):
    """A request the proxy refuses (400), the message naming the field."""


def read_body(raw: bytes) -> dict:
    """The client's JSON object, through kvabi's JSON reader (size, depth, duplicate keys,
    NaN, UTF-8); BadRequest naming what is wrong."""
    from kvabi import KVABIError
    from kvabi.util.safe_json import loads

    try:
        body = loads(raw, what="request body", max_bytes=MAX_BODY, max_depth=MAX_DEPTH)
    except KVABIError as e:
        raise BadRequest(str(e)) from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body: must be a JSON object, got {type(body).__name__}")
    return body


def check_whole(body: dict) -> None:
    """BadRequest naming the field unless one prefill hands the request's KV over whole:
    one prompt, one sequence (``n`` 1), no beam search, ``stream`` a boolean."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream: must be true or false, got {stream!r:.40}")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BadRequest(f"n: {n!r:.40}: the P/D proxy hands one sequence's KV to the decode "
                         "server per request (send n requests of n 1)")
    if body.get("use_beam_search") not in (None, False):
        raise BadRequest("use_beam_search: beam search keeps several sequences, the P/D "
                         "proxy hands one sequence's KV over per request")
    for field in ("prompt", "prompt_embeds"):
        p = body.get(field)  # a list of token ids is one prompt; a list of others a batch
        if isinstance(p, list) and len(p) > 1 and not all(isinstance(t, int) for t in p):
            raise BadRequest(f"{field}: a batch of {len(p)} prompts: the P/D proxy hands one "
                             "prompt's KV to the decode server per request (send each prompt "
                             "in a request of its own)")


class GrantReleaser:
    """Tells a prefill engine's ranks that a grant will not be read any more (the
    notification a decode engine sends when it is done: slot, nonce, decode rank 0 of 1),
    from a NIXL agent of the proxy's own, on one thread of its own (NIXL calls block).
    Nothing here trusts the parameters: anything malformed is logged and skipped (the
    grant then expires on the prefill engine)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._agent = None
        self._tables: collections.OrderedDict = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="release")
        #: grants released (notifications sent), and those that could not be
        self.sent = self.failed = 0
        self._last_sent = 0.0

    def start(self) -> None:
        """Make the agent now, off the event loop (imports and NIXL set-up take seconds on a
        loaded machine; the first release should not)."""
        self._pool.submit(self._agent_)

    async def release(self, params) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.release_now, params)

    def release_now(self, params) -> None:
        """Release the grant of ``params`` (a prefill answer's kv_transfer_params) now, on
        this thread."""
        from kvabi import KVABIError

        try:
            slot, nonce, tables = self._grant(params)
            note = notify_message(slot, nonce)
            for msg in tables:
                self._agent_().notify(self._table(msg), note)
            self.sent += 1
            self._last_sent = time.monotonic()
        except KVABIError as e:
            self.failed += 1
            log.warning("kvabi-vllm proxy: could not release a grant (it expires on the "
                        "prefill server after hold_timeout_s): %s", e)

    @staticmethod
    def _grant(params):
        from kvabi import KVABIError
        from kvabi.util.coerce import as_int

        grant, tables = params.get("kvabi_grant"), params.get("kvabi_grants")
        if not isinstance(grant, dict) or not isinstance(grant.get("nonce"), str):
            raise KVABIError("kvabi_grant: missing from the prefill server's answer")
        slot = as_int(grant.get("slot"), "kvabi_grant.slot", lo=0)
        try:
            nonce = bytes.fromhex(grant["nonce"])
        except ValueError:
            raise KVABIError("kvabi_grant.nonce: not hex") from None
        tables = [tables] if isinstance(tables, str) else tables
        if not isinstance(tables, list) or not tables or \
                not all(isinstance(t, str) for t in tables):
            raise KVABIError("kvabi_grants: missing from the prefill server's answer")
        return slot, nonce, tables

    def _agent_(self):
        if self._agent is None:
            from kvabi import KVABIError
            from kvabi.transfer.nixl import NixlAgent

            try:
                self._agent = NixlAgent(f"kvabi-proxy-{uuid.uuid4().hex[:8]}", host=self.host)
            except KVABIError as e:
                log.error("kvabi-vllm proxy: no NIXL agent (%s): grants of requests the "
                          "decode server does not read stay held until hold_timeout_s", e)
                raise
        return self._agent

    def _table(self, message: str):
        key = hashlib.blake2b(message.encode(), digest_size=16).digest()
        peer = self._tables.get(key)
        if peer is None:
            peer = self._tables[key] = self._agent_().connect(message, timeout=5.0)
            while len(self._tables) > MAX_TABLES:
                self._agent.disconnect(self._tables.popitem(last=False)[1])
        self._tables.move_to_end(key)
        return peer

    def close(self) -> None:
        """Stop, once the last notification had time to leave (NIXL sends them in the
        background and cancels what is still queued when its agent goes)."""
        self._pool.shutdown(wait=True)
        time.sleep(max(0.0, self._last_sent + FLUSH_S - time.monotonic()))
        if self._agent is not None:
            self._agent.close()
            self._agent = None


def notify_message(slot: int, nonce: bytes) -> bytes:
    """The notification that releases grant ``slot`` (``connector_grants``' own form)."""
    from .connector_grants import notify_message as message

    return message(slot, nonce)


def prefill_request(body: dict) -> dict:
    """The request the prefill server gets: the client's, one token, no stream, and the
    producer's ask to keep the prompt's KV for a remote decode."""
    req = copy.deepcopy(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return req


def decode_request(body: dict, kv_transfer_params: dict) -> dict:
    """The request the decode server gets: the client's, with the prefill server's
    ``kv_transfer_params``."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = kv_transfer_params
    return req


def build_app(prefill: str, decode: str, *, timeout: float = 300.0,
              nixl_host: str = "127.0.0.1"):
    """The FastAPI app proxying to ``prefill`` and ``decode`` (base URLs, e.g.
    ``http://127.0.0.1:8100``); ``timeout``: seconds allowed to each server call;
    ``nixl_host``: the address of the proxy's NIXL agent (it releases grants)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefill, decode = prefill.rstrip("/"), decode.rstrip("/")
    state: dict = {}
    counter = itertools.count()

    async def lifespan(app):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout),
                                            limits=httpx.Limits(max_connections=None))
        state["releaser"] = app.state.releaser = GrantReleaser(nixl_host)
        state["releaser"].start()
        log.info("kvabi-vllm proxy: prefill %s, decode %s", prefill, decode)
        yield
        await state["client"].aclose()
        state["releaser"].close()

    app = FastAPI(title="kvabi-vllm proxy", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "proxy_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status)

    def relayed(r):
        return Response(content=r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"))

    async def read(request: Request) -> bytes:
        """The body, read up to MAX_BODY bytes (BadRequest beyond: never held whole)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise BadRequest(f"request body: more than the limit of {MAX_BODY} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    tasks: set = set()

    def spawn(coro) -> None:
        """Run ``coro`` to its end even when the request's own task is cancelled (a client
        that goes away must not leave blocks held)."""
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def params_of(r):
        try:
            params = r.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            return None
        return params if isinstance(params, dict) else None

    async def release_after(call):
        """Release the grant of a prefill call the client no longer waits for."""
        try:
            r = await call
        except Exception:  # noqa: BLE001 - no answer: nothing was granted to us
            return
        if r.status_code == 200 and (params := params_of(r)) is not None:
            await state["releaser"].release(params)

    async def forward(path: str, request: Request):
        n = next(counter)
        try:
            body = read_body(await read(request))
            check_whole(body)
        except BadRequest as e:
            return error(400, str(e), "invalid_request_error")
        client = state["client"]
        t0 = time.perf_counter()
        call = asyncio.ensure_future(client.post(prefill + path, json=prefill_request(body)))
        try:
            r = await asyncio.shield(call)
        except asyncio.CancelledError:
            spawn(release_after(call))
            raise
        except httpx.HTTPError as e:
            return error(502, f"prefill server {prefill}: {type(e).__name__}: {e}")
        if r.status_code != 200:
            return relayed(r)  # the prefill server's own refusal of this request
        params = params_of(r)
        if params is None:
            return error(502, f"prefill server {prefill} answered without "
                              f"kv_transfer_params: start it with --kv-transfer-config "
                              f"naming KvabiConnector and kv_role kv_producer")

        # from here the prefill server holds blocks for this request: released when the
        # decode server's answer ends, however it ends
        async def finish(d=None):
            if d is not None:
                await d.aclose()
            await state["releaser"].release(params)

        t1 = time.perf_counter()
        req = client.build_request("POST", decode + path, json=decode_request(body, params))
        try:
            d = await client.send(req, stream=True)
        except BaseException as e:
            spawn(finish())
            if isinstance(e, httpx.HTTPError):
                return error(502, f"decode server {decode}: {type(e).__name__}: {e}")
            raise
        log.info("request %d %s: prefill %.0f ms, decode answered %d after %.0f ms", n,
                 path, (t1 - t0) * 1e3, d.status_code, (time.perf_counter() - t1) * 1e3)
        if d.status_code != 200 or not body.get("stream"):
            try:
                await d.aread()
            finally:
                spawn(finish(d))
            return relayed(d)

        async def relay():
            try:
                async for chunk in d.aiter_raw():
                    yield chunk
            finally:
                spawn(finish(d))

        return StreamingResponse(relay(), status_code=d.status_code,
                                 media_type=d.headers.get("content-type"))

    def route(path: str):
        async def endpoint(request: Request):
            return await forward(path, request)
        return endpoint

    for path in ROUTES:
        app.add_api_route(path, route(path), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        try:
            return relayed(await state["client"].get(decode + "/v1/models"))
        except httpx.HTTPError as e:
            return error(502, f"decode server {decode}: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        bad = []
        for name, url in (("prefill", prefill), ("decode", decode)):
            try:
                ok = (await state["client"].get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                bad.append(f"{name} server {url}")
        if bad:
            return error(503, "not healthy: " + ", ".join(bad))
        return {"status": "ok"}

    return app


def parser() -> argparse.ArgumentParser:
    from kvabi.util.argtypes import int_arg

    p = argparse.ArgumentParser(
        prog="kvabi-vllm proxy",
        description="An OpenAI-compatible front (/v1/completions, /v1/chat/completions, "
                    "streaming or not) for a prefill server and a decode server started "
                    "with `kvabi-vllm serve ... --kv-transfer-config` naming KvabiConnector "
                    "(kv_role kv_producer and kv_consumer): each request is prefilled on "
                    "one, its KV moved to the other, and decoded there.")
    p.add_argument("--prefill", required=True,
                   help="base URL of the prefill server, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True,
                   help="base URL of the decode server, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_arg(1, 65535), default=8000,
                   help="port to listen on (default 8000)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds allowed to each call to a server (default 300)")
    p.add_argument("--nixl-host", default="127.0.0.1",
                   help="address of the proxy's NIXL agent, which releases the grants of "
                        "requests the decode server answered (default 127.0.0.1)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="log level of the proxy and its HTTP server (default info)")
    return p


def main(argv=None) -> int:
    """Run the proxy until interrupted."""
    import uvicorn

    a = parser().parse_args(argv)
    if not a.timeout > 0:
        parser().error(f"--timeout: must be > 0, got {a.timeout}")
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call to a server
    uvicorn.run(build_app(a.prefill, a.decode, timeout=a.timeout, nixl_host=a.nixl_host),
                host=a.host, port=a.port, log_level=a.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
