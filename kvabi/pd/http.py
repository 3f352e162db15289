"""Just enough HTTP/1.1 for the P/D proxy, on asyncio streams (the standard library only):
read a client's request with bounded sizes, call a server and stream its answer back.

Bodies are read with ``Content-Length`` or chunked; a server's answer is read by its
``Content-Length``, chunked, or until it closes.  Every size a peer states is bounded
before it is read.
"""
from __future__ import annotations

import asyncio
import urllib.parse

import attrs

from ..util.errors import KVABIError

#: bytes of a request line plus headers, at most
HEAD_LIMIT = 64 * 1024
#: headers a hop must not forward (RFC 9110 7.6.1, and the ones the proxy sets itself)
HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
       "upgrade", "content-length", "host"}


class HTTPError(Exception):
    """A request the proxy refuses before any server sees it: ``status`` and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@attrs.frozen
class Request:
    method: str
    path: str
    headers: dict        # lower-case names
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


@attrs.frozen
class Server:
    """A server's base URL, ``http://host:port`` (a path prefix allowed)."""

    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str, field: str) -> "Server":
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise KVABIError(f"{field}: must be an http:// URL, got {url!r:.80}")
        try:
            port = u.port or 80
        except ValueError:
            raise KVABIError(f"{field}: bad port in {url!r:.80}") from None
        return cls(u.hostname, port, u.path.rstrip("/"))

    def __str__(self) -> str:
        return f"http://{self.host}:{self.port}{self.prefix}"


async def _head(reader: asyncio.StreamReader) -> list[str]:
    """The start line and header lines of a message (empty at a clean end of stream)."""
    lines, size = [], 0
    while True:
        line = await reader.readline()
        size += len(line)
        if size > HEAD_LIMIT:
            raise HTTPError(431, f"headers: more than {HEAD_LIMIT} bytes")
        if not line:
            if lines:
                raise HTTPError(400, "the connection closed inside the headers")
            return []
        if line in (b"\r\n", b"\n"):
            if not lines:
                continue  # tolerated before a request line (RFC 9112 2.2)
            return lines
        lines.append(line.decode("latin-1").rstrip("\r\n"))


def _headers(lines) -> dict:
    out = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HTTPError(400, f"headers: malformed line {line[:60]!r}")
        out[name.lower()] = value.strip()
    return out


async def _body(reader, headers: dict, limit: int, *, until_close: bool = False) -> bytes:
    if headers.get("transfer-encoding", "").lower() not in ("", "identity"):
        if headers["transfer-encoding"].lower() != "chunked":
            raise HTTPError(501, f"transfer-encoding: {headers['transfer-encoding']!r:.40}")
        chunks, total = [], 0
        async for c in _chunks(reader):
            total += len(c)
            if total > limit:
                raise HTTPError(413, f"body: more than {limit} bytes")
            chunks.append(c)
        return b"".join(chunks)
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit() or len(text) > 18:
            raise HTTPError(400, f"content-length: {text!r:.40}")
        n = int(text)
        if n > limit:
            raise HTTPError(413, f"body: {n} bytes, at most {limit}")
        return await reader.readexactly(n)
    if until_close:
        data = await reader.read(limit + 1)
        if len(data) > limit:
            raise HTTPError(413, f"body: more than {limit} bytes")
        return data
    return b""


async def _chunks(reader):
    """The chunks of a chunked body."""
    while True:
        line = (await reader.readline()).split(b";", 1)[0].strip()
        try:
            n = int(line, 16)
        except ValueError:
            raise HTTPError(400, f"chunk size: {line[:20]!r}") from None
        if n == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return
        yield await reader.readexactly(n)
        await reader.readexactly(2)


async def read_request(reader, limit: int) -> Request | None:
    """The client's next request, or None at the end of its connection."""
    lines = await _head(reader)
    if not lines:
        return None
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HTTPError(400, f"request line: {lines[0][:60]!r}")
    headers = _headers(lines[1:])
    body = await _body(reader, headers, limit)
    return Request(parts[0], parts[1], headers, body)


class Answer:
    """A server's answer: ``status``, ``headers``, and its body as it arrives
    (:meth:`stream`) or whole (:meth:`read`)."""

    def __init__(self, status: int, headers: dict, reader, writer):
        self.status, self.headers = status, headers
        self._reader, self._writer = reader, writer

    async def stream(self):
        h = self.headers
        try:
            if h.get("transfer-encoding", "").lower() == "chunked":
                async for c in _chunks(self._reader):
                    yield c
            elif "content-length" in h:
                left = int(h["content-length"])
                while left > 0:
                    c = await self._reader.read(min(left, 65536))
                    if not c:
                        raise HTTPError(502, "the server closed inside its answer")
                    left -= len(c)
                    yield c
            else:
                while c := await self._reader.read(65536):
                    yield c
        finally:
            self.close()

    async def read(self, limit: int) -> bytes:
        try:
            return await _body(self._reader, self.headers, limit, until_close=True)
        finally:
            self.close()

    def close(self) -> None:
        self._writer.close()


async def call(server: Server, method: str, path: str, body: bytes = b"",
               headers: dict | None = None) -> Answer:
    """Send one request to ``server`` (a connection of its own, closed after the answer)."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        head = [f"{method} {server.prefix}{path} HTTP/1.1", f"Host: {server.host}:{server.port}",
                "Connection: close", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items() if k.lower() not in HOP]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        lines = await _head(reader)
        if not lines:
            raise HTTPError(502, "the server closed without an answer")
        status = lines[0].split(" ", 2)
        if len(status) < 2 or not status[1].isdigit():
            raise HTTPError(502, f"status line: {lines[0][:60]!r}")
        return Answer(int(status[1]), _headers(lines[1:]), reader, writer)
    except BaseException:
        writer.close()
        raise


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 413: "Content Too Large", 431: "Request Header Fields Too "
           "Large", 500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout"}


def head(status: int, headers: dict, *, length: int | None, keep_alive: bool) -> bytes:
    """A response's status line and headers (chunked where ``length`` is None)."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in HOP]
    lines.append(f"Content-Length: {length}" if length is not None
                 else "Transfer-Encoding: chunked")
    lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


__all__ = ["Answer", "HTTPError", "Request", "Server", "call", "chunk", "head",
           "read_request"]
