"""P/D servers of any engines on loopback, each started with its real command, for the
tests, ``kvabi bench pd`` and ``make run``: ``kvabi-transformers serve`` (this
environment), ``kvabi-vllm serve`` (vLLM's own environment: its Python is given) and
``kvabi proxy`` in front of a producer and a consumer.

Each process gets its own process group (not its own session: NIXL between servers started
in sessions of their own failed every READ here) and a log file; every wait names what it
waited for and shows the logs' tails.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import attrs

#: the model name requests give (every server here answers to it)
MODEL = "tiny"
#: seconds a server may take to start (two engines starting side by side on two cores)
START_TIMEOUT = 600.0


@attrs.frozen
class Engine:
    """One server: ``kind`` ``transformers`` or ``vllm``; ``role`` ``kv_producer``,
    ``kv_consumer`` or ``kv_both``; ``block_size``; ``dtype``; for transformers its kvabi
    ``backend`` and ``layout``; for vLLM ``env`` (e.g. ``KVABI_VLLM_BACKEND``,
    ``VLLM_KV_CACHE_LAYOUT``); ``extra``: kv_connector_extra_config."""

    kind: str
    role: str = "kv_both"
    block_size: int = 16
    dtype: str = "float32"
    backend: str = "reference"
    layout: str | None = None
    env: dict = attrs.field(factory=dict)
    extra: dict = attrs.field(factory=dict)

    def describe(self) -> str:
        if self.kind == "transformers":
            return (f"transformers on kvabi {self.backend} ({self.layout or 'preferred'}), "
                    f"{self.block_size}-token blocks, {self.dtype}")
        backend = self.env.get("KVABI_VLLM_BACKEND", "vLLM's CPU_ATTN")
        layout = self.env.get("VLLM_KV_CACHE_LAYOUT", "LBHNC")
        return f"vLLM on {backend} ({layout}), {self.block_size}-token blocks, {self.dtype}"


def kv_transfer_config(engine: Engine) -> str:
    """The ``--kv-transfer-config`` JSON of ``engine`` (vLLM's KvabiConnector, or the same
    keys for transformers)."""
    cfg = {"kv_role": engine.role, "kv_connector_extra_config": dict(engine.extra)}
    if engine.kind == "vllm":
        cfg.update(kv_connector="KvabiConnector", kv_connector_module_path="kvabi_vllm.connector")
    return json.dumps(cfg)


def command(engine: Engine, model, port: int, vllm_python: str | None) -> tuple[list, dict]:
    """(argv, environment additions) starting ``engine`` serving ``model`` on ``port``."""
    if engine.kind == "transformers":
        argv = [sys.executable, "-m", "kvabi_transformers.cli", "serve", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
                "--dtype", engine.dtype, "--kvabi-backend", engine.backend,
                "--kvabi-block-size", str(engine.block_size),
                "--kv-transfer-config", kv_transfer_config(engine), "--log-level", "info"]
        if engine.layout:
            argv += ["--kvabi-layout", engine.layout]
        return argv, {}
    if engine.kind != "vllm":
        raise ValueError(f"kind: transformers or vllm, got {engine.kind!r}")
    if not vllm_python:
        raise ValueError("vllm_python: the Python of vLLM's environment is needed")
    argv = [vllm_python, "-m", "kvabi_vllm.cli", "serve", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", MODEL, "--dtype", engine.dtype,
            "--enforce-eager", "--block-size", str(engine.block_size),
            "--max-model-len", "1024", "--max-num-seqs", "8", "--no-enable-prefix-caching",
            "--kv-transfer-config", kv_transfer_config(engine)]
    return argv, {"VLLM_CPU_KVCACHE_SPACE": "1", **engine.env}


def start(argv: list, log: Path, env: dict) -> subprocess.Popen:
    """``argv`` in a process group of its own, its output in ``log``; the kvabi variables of
    this environment are not passed on (each server gets its own)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVABI_VLLM")}
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**base, **env}, process_group=0)


def call(url: str, body=None, *, timeout: float = 120.0) -> tuple[int, object]:
    """(status, parsed JSON or text) of a GET (``body`` None) or a JSON POST to ``url``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def tails(logs: dict, chars: int = 3000) -> str:
    """The last ``chars`` of each log; a log not written yet (a proxy that was not started
    because a server before it failed) is said to be so, so the failure's report is not
    lost to a FileNotFoundError."""
    def tail(path):
        path = Path(path)
        return path.read_text()[-chars:] if path.exists() else "(not started: no log)"
    return "\n".join(f"== {name} ({path})\n{tail(path)}" for name, path in logs.items())


#: what a server's log says when the port it was given was taken before it bound it (free
#: ports are picked before a server takes minutes to start, on a machine others share)
PORT_TAKEN = ("address already in use", "Errno 98")
#: starts of one server on a taken port before giving up
PORT_TRIES = 3


def serve_all(starts: dict, logs: dict, timeout: float) -> tuple[dict, dict]:
    """Start every ``starts[name](port) -> (argv, env)`` on a free port and wait until each
    one's ``/health`` answers 200; one whose port was taken meanwhile is started again on
    another.  ({name: base URL}, {name: Popen}); RuntimeError naming the server and showing
    the logs' tails when one exits otherwise or ``timeout`` seconds pass (the started
    processes are then stopped)."""
    from kvabi.transfer.nixl import free_port

    procs, urls, tries = {}, {}, dict.fromkeys(starts, 0)

    def launch(name):
        port = free_port()
        argv, env = starts[name](port)
        urls[name] = f"http://127.0.0.1:{port}"
        procs[name] = start(argv, logs[name], env)
        tries[name] += 1
    try:
        for name in starts:
            launch(name)
        deadline = time.monotonic() + timeout
        todo = set(starts)
        while todo:
            for name in sorted(todo):
                p = procs[name]
                if p.poll() is not None:
                    text = Path(logs[name]).read_text()[-2000:]
                    if any(t in text for t in PORT_TAKEN) and tries[name] < PORT_TRIES:
                        launch(name)
                        continue
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for "
                                       f"{', '.join(sorted(todo))} to be healthy:\n"
                                       f"{tails(logs)}")
                try:
                    if call(urls[name] + "/health", timeout=5)[0] == 200:
                        todo.discard(name)
                except OSError:  # not listening yet
                    pass
            if todo and time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(sorted(todo))} not healthy (GET /health) "
                                   f"within {timeout:g} s:\n{tails(logs)}")
            if todo:
                time.sleep(1)
    except BaseException:
        stop(procs)
        raise
    return urls, procs


def stop(procs: dict, timeout: float = 60.0) -> None:
    """Terminate the processes started here; kill those still running after ``timeout``."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def pd_servers(model, workdir, engines: dict, proxies: dict, *, vllm_python=None,
               start_timeout: float = START_TIMEOUT, proxy_timeout: float = 120.0):
    """Start ``engines`` ({name: Engine}) serving ``model``, then ``proxies`` ({name:
    (producer name, consumer name)}) in front of them; yield {"urls": {name: base URL},
    "logs": {name: path}, "procs": {name: Popen}} once all are healthy; stop them all on
    exit."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    logs = {n: work / f"{n}.log" for n in list(engines) + list(proxies)}
    urls, procs = serve_all(
        {name: (lambda port, e=engine: command(e, model, port, vllm_python))
         for name, engine in engines.items()}, logs, start_timeout)
    try:
        def proxy(prefill, decode):
            return lambda port: ([sys.executable, "-m", "kvabi.pd.proxy", "--prefill",
                                  urls[prefill], "--decode", urls[decode], "--port", str(port),
                                  "--timeout", str(proxy_timeout)], {})
        more, started = serve_all({name: proxy(*pair) for name, pair in proxies.items()},
                                  logs, start_timeout)
        urls.update(more)
        procs.update(started)
        yield {"urls": urls, "logs": logs, "procs": procs}
    finally:
        stop(procs)


__all__ = ["Engine", "MODEL", "call", "command", "kv_transfer_config", "pd_servers",
           "serve_all", "stop"]
