"""``kvabi proxy``: one OpenAI-compatible address in front of a producer server and a
consumer server of any engines that speak kvabi's P/D (``specs/pd.md`` section 4.7).

Per request (``POST /v1/completions``, ``POST /v1/chat/completions``):

1. a body that is not a JSON object, nested too deep or too large, or that asks several
   choices (``n``, ``best_of``) or several prompts, is refused (400, 413) naming the field:
   one grant serves one sequence, and no server sees the request;
2. the producer gets the request with one token to generate, no streaming, and the ask
   (``kv_transfer_params={"do_remote_decode": true}``): it computes the prompt's KV, keeps
   its blocks and answers with the ``kv_transfer_params`` that say where they are;
3. the consumer gets the client's own request plus those ``kv_transfer_params``: it pulls
   the prompt's KV and generates; its answer goes back to the client as it comes, streamed
   when the client asked for a stream.

A request either server refuses gets that server's status and message, alone; other
requests carry on.  ``GET /v1/models`` is the consumer's; ``GET /health`` is healthy when
both servers are.  The standard library only (asyncio).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import sys
import time

from . import http
from .params import ASK

log = logging.getLogger("kvabi.pd.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
#: a client's body at most (bytes), and its nesting at most
MAX_BODY, MAX_DEPTH = 16 * 2**20, 64


def prefill_request(body: dict) -> dict:
    """The request the producer gets: the client's, one token, no stream, and the ask."""
    req = copy.deepcopy(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req["kv_transfer_params"] = dict(ASK)
    return req


def decode_request(body: dict, kv_transfer_params: dict) -> dict:
    """The request the consumer gets: the client's, with the producer's answer."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = kv_transfer_params
    return req


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value (iterative: any depth)."""
    best, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            best = max(best, d)
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return best


def check_body(raw: bytes, path: str) -> dict:
    """The client's body as an object the proxy forwards; HTTPError naming the field."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise http.HTTPError(400, f"body: nested deeper than {MAX_DEPTH}") from None
    except (ValueError, UnicodeDecodeError):
        raise http.HTTPError(400, "body: not JSON") from None
    if not isinstance(body, dict):
        raise http.HTTPError(400, "body: must be a JSON object")
    if _depth(body) > MAX_DEPTH:
        raise http.HTTPError(400, f"body: nested deeper than {MAX_DEPTH}")
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and v != 1:
            raise http.HTTPError(400, f"{key}: {v!r:.20}: a P/D request generates one "
                                      "sequence (one grant holds one prompt's KV)")
    prompt = body.get("prompt") if path == "/v1/completions" else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise http.HTTPError(400, f"prompt: a list of {len(prompt)} prompts: send one "
                                      "request per prompt")
    return body


class Proxy:
    """The proxy's state: the two servers, limits, and a request counter."""

    def __init__(self, prefill: str, decode: str, *, timeout: float = 300.0,
                 max_body: int = MAX_BODY):
        self.prefill = http.Server.parse(prefill, "prefill")
        self.decode = http.Server.parse(decode, "decode")
        self.timeout = timeout
        self.max_body = max_body
        self._n = itertools.count()

    async def serve(self, host: str, port: int):
        """An asyncio server listening on ``host:port`` (call ``serve_forever`` on it)."""
        return await asyncio.start_server(self._connection, host, port, limit=http.HEAD_LIMIT)

    async def _connection(self, reader, writer) -> None:
        try:
            while True:
                try:
                    req = await http.read_request(reader, self.max_body)
                except http.HTTPError as e:
                    await self._send_error(writer, e.status, str(e), keep_alive=False)
                    return
                if req is None:
                    return
                keep = await self._handle(req, writer)
                if not (keep and req.keep_alive):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _send(self, writer, status: int, body: bytes, ctype: str, keep_alive=True):
        writer.write(http.head(status, {"Content-Type": ctype}, length=len(body),
                               keep_alive=keep_alive) + body)
        await writer.drain()

    async def _send_error(self, writer, status, message, kind="proxy_error", keep_alive=True):
        body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
        await self._send(writer, status, body.encode(), "application/json", keep_alive)

    async def _handle(self, req: http.Request, writer) -> bool:
        """Answer one request; whether the connection may carry another."""
        path = req.path.split("?", 1)[0]
        try:
            if path in ROUTES:
                if req.method != "POST":
                    raise http.HTTPError(405, f"{path}: POST only")
                return await self._forward(path, req, writer)
            if path == "/v1/models" and req.method == "GET":
                a = await asyncio.wait_for(http.call(self.decode, "GET", "/v1/models"),
                                           self.timeout)
                body = await a.read(self.max_body)
                await self._send(writer, a.status, body,
                                 a.headers.get("content-type", "application/json"))
                return True
            if path == "/health" and req.method == "GET":
                return await self._health(writer)
            raise http.HTTPError(404, f"{path}: not a route of this proxy")
        except http.HTTPError as e:
            await self._send_error(writer, e.status, str(e),
                                   "invalid_request_error" if e.status < 500 else "proxy_error")
            return True
        except (OSError, asyncio.TimeoutError) as e:
            await self._send_error(writer, 502, f"{type(e).__name__}: {e}")
            return True

    async def _health(self, writer) -> bool:
        bad = []
        for name, server in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                a = await asyncio.wait_for(http.call(server, "GET", "/health"), self.timeout)
                await a.read(self.max_body)
                ok = a.status == 200
            except (OSError, asyncio.TimeoutError, http.HTTPError):
                ok = False
            if not ok:
                bad.append(f"{name} server {server}")
        if bad:
            await self._send_error(writer, 503, "not healthy: " + ", ".join(bad))
        else:
            await self._send(writer, 200, b'{"status": "ok"}', "application/json")
        return True

    async def _forward(self, path: str, req: http.Request, writer) -> bool:
        n = next(self._n)
        body = check_body(req.body, path)
        t0 = time.perf_counter()
        try:
            a = await asyncio.wait_for(http.call(self.prefill, "POST", path, json.dumps(
                prefill_request(body)).encode(), {"Content-Type": "application/json"}),
                self.timeout)
            raw = await asyncio.wait_for(a.read(self.max_body), self.timeout)
        except (OSError, asyncio.TimeoutError, http.HTTPError) as e:
            raise http.HTTPError(502, f"prefill server {self.prefill}: {type(e).__name__}: "
                                      f"{e}") from None
        if a.status != 200:  # the producer's own refusal of this request
            await self._send(writer, a.status, raw, a.headers.get("content-type",
                                                                  "application/json"))
            return True
        try:
            params = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError, RecursionError):
            params = None
        if not isinstance(params, dict):
            raise http.HTTPError(502, f"prefill server {self.prefill} answered without "
                                      "kv_transfer_params: start it as a kvabi P/D producer")
        t1 = time.perf_counter()
        try:
            d = await asyncio.wait_for(http.call(self.decode, "POST", path, json.dumps(
                decode_request(body, params)).encode(), {"Content-Type": "application/json"}),
                self.timeout)
        except (OSError, asyncio.TimeoutError, http.HTTPError) as e:
            raise http.HTTPError(502, f"decode server {self.decode}: {type(e).__name__}: "
                                      f"{e}") from None
        log.info("request %d %s: prefill %.0f ms, decode answered %d after %.0f ms", n, path,
                 (t1 - t0) * 1e3, d.status, (time.perf_counter() - t1) * 1e3)
        ctype = d.headers.get("content-type", "application/json")
        if d.status != 200 or not body.get("stream"):
            out = await asyncio.wait_for(d.read(2**31), self.timeout)
            await self._send(writer, d.status, out, ctype)
            return True
        writer.write(http.head(d.status, {"Content-Type": ctype}, length=None, keep_alive=True))
        async for c in d.stream():  # as it comes
            if c:
                writer.write(http.chunk(c))
                await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def parser(prog: str = "kvabi proxy", p=None) -> argparse.ArgumentParser:
    from ..util.argtypes import float_arg, int_arg

    p = p or argparse.ArgumentParser(prog=prog)
    p.description = ("An OpenAI-compatible front (/v1/completions, /v1/chat/completions, "
                     "streaming or not) for a producer server and a consumer server that "
                     "speak kvabi's P/D (specs/pd.md): each request is prefilled on one, its "
                     "KV moved to the other, and decoded there.")
    p.add_argument("--prefill", required=True,
                   help="base URL of the producer (prefill) server, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True,
                   help="base URL of the consumer (decode) server, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_arg(1, 65535), default=8000,
                   help="port to listen on (default 8000)")
    p.add_argument("--timeout", type=float_arg(lo=0, lo_open=True, name="--timeout"),
                   default=300.0,
                   help="seconds allowed to each call to a server (default 300)")
    p.add_argument("--max-body", type=int_arg(1, 2**31, name="--max-body"), default=MAX_BODY,
                   help=f"largest client body in bytes (default {MAX_BODY})")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="log level (default info)")
    return p


def run(args, prog: str = "kvabi proxy") -> int:
    """Run the proxy of parsed ``args`` until interrupted."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, timeout=args.timeout, max_body=args.max_body)

    async def main():
        server = await proxy.serve(args.host, args.port)
        log.info("%s: prefill %s, decode %s, listening on %s:%d", prog, proxy.prefill,
                 proxy.decode, args.host, args.port)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def main(argv=None, prog: str = "kvabi proxy") -> int:
    return run(parser(prog).parse_args(argv), prog)


if __name__ == "__main__":
    sys.exit(main())
