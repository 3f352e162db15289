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
"""

import argparse
import copy
import itertools
import logging
import sys
import time

log = logging.getLogger("kvabi_vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


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


def build_app(prefill: str, decode: str, *, timeout: float = 300.0):
    """The FastAPI app proxying to ``prefill`` and ``decode`` (base URLs, e.g.
    ``http://127.0.0.1:8100``); ``timeout``: seconds allowed to each server call."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask

    prefill, decode = prefill.rstrip("/"), decode.rstrip("/")
    state: dict = {}
    counter = itertools.count()

    async def lifespan(app):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout),
                                            limits=httpx.Limits(max_connections=None))
        log.info("kvabi-vllm proxy: prefill %s, decode %s", prefill, decode)
        yield
        await state["client"].aclose()

    app = FastAPI(title="kvabi-vllm proxy", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "proxy_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status)

    def relayed(r):
        return Response(content=r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"))

    async def forward(path: str, request: Request):
        n = next(counter)
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object",
                         "invalid_request_error")
        client = state["client"]
        t0 = time.perf_counter()
        try:
            r = await client.post(prefill + path, json=prefill_request(body))
        except httpx.HTTPError as e:
            return error(502, f"prefill server {prefill}: {type(e).__name__}: {e}")
        if r.status_code != 200:
            return relayed(r)  # the prefill server's own refusal of this request
        params = (r.json() or {}).get("kv_transfer_params")
        if not isinstance(params, dict):
            return error(502, f"prefill server {prefill} answered without "
                              f"kv_transfer_params: start it with --kv-transfer-config "
                              f"naming KvabiConnector and kv_role kv_producer")
        t1 = time.perf_counter()
        req = client.build_request("POST", decode + path, json=decode_request(body, params))
        try:
            d = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            return error(502, f"decode server {decode}: {type(e).__name__}: {e}")
        log.info("request %d %s: prefill %.0f ms, decode answered %d after %.0f ms", n,
                 path, (t1 - t0) * 1e3, d.status_code, (time.perf_counter() - t1) * 1e3)
        if d.status_code != 200 or not body.get("stream"):
            await d.aread()
            await d.aclose()
            return relayed(d)
        return StreamingResponse(d.aiter_raw(), status_code=d.status_code,
                                 media_type=d.headers.get("content-type"),
                                 background=BackgroundTask(d.aclose))

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
    uvicorn.run(build_app(a.prefill, a.decode, timeout=a.timeout), host=a.host, port=a.port,
                log_level=a.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
