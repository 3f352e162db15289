"""A P/D pair of vLLM servers behind ``kvabi-vllm proxy``, each started with the real command
on free loopback ports, in sessions of their own on request (tests and ``kvabi bench
vllm``).

The default pair is the one the README shows: the prefill server on vLLM's own CPU attention
(LBHNC, 32-token blocks), the decode server on the kvabi backend ``example.torch`` (cross-layer
BLHNC, 64-token blocks), KvabiConnector between them.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: served model name of every server here
MODEL = "tiny"
PREFILL = {"block_size": 32, "env": {}}
DECODE = {"block_size": 64, "env": {"KVABI_VLLM_BACKEND": "example.torch",
                                    "KVABI_VLLM_LAYOUT": "BLHNC"}}


def connector_config(role: str) -> str:
    """``--kv-transfer-config`` of KvabiConnector in ``role``."""
    return json.dumps({"kv_connector": "KvabiConnector", "kv_role": role,
                       "kv_connector_module_path": "kvabi_vllm.connector"})


def start(cmd: list[str], log: Path, *, session: bool = False, **env) -> subprocess.Popen:
    """``kvabi-vllm CMD...`` (the command's own code) with this environment, less the kvabi
    variables, plus ``env``; its output in ``log``; ``session``: in a session of its own
    (``setsid``, as a terminal or a service unit starts it)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVABI_VLLM")}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "kvabi_vllm.cli", *cmd], stdout=out,
                                stderr=subprocess.STDOUT, env={**base, **env},
                                start_new_session=session)


def wait_healthy(urls: dict, procs: dict, logs: dict, timeout: float,
                 stall: float = 300.0) -> None:
    """Until every server of ``urls`` (name -> base URL) answers 200 on /health.  Fails
    (RuntimeError) saying which server it waited for, how long, and the tail of its log:
    when a process exits, when ``timeout`` seconds pass without every server healthy while
    their logs still grow, or ``stall`` seconds pass with no log growing (on a loaded
    machine a start takes long, but keeps writing its log)."""
    import httpx

    t0 = time.monotonic()
    last_growth, sizes = t0, {}
    waiting = dict(urls)
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"waiting for {name} to serve: it exited {p.returncode} "
                                   f"after {time.monotonic() - t0:.0f} s:\n"
                                   f"{logs[name].read_text()[-4000:]}")
        for name, url in list(waiting.items()):
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    del waiting[name]
            except httpx.HTTPError:
                pass
        if not waiting:
            return
        now = time.monotonic()
        grown = {k: v.stat().st_size for k, v in logs.items() if v.exists()}
        if grown != sizes:
            sizes, last_growth = grown, now
        if now - t0 > timeout or now - last_growth > stall:
            why = (f"no log grew for {now - last_growth:.0f} s" if now - last_growth > stall
                   else f"{timeout:g} s passed")
            raise RuntimeError(
                f"waiting for {', '.join(f'{k} ({v}/health)' for k, v in waiting.items())} "
                f"to answer 200: {why} ({now - t0:.0f} s since start):\n" + "\n".join(
                    f"== {k}\n{logs[k].read_text()[-2000:]}" for k in logs
                    if k in waiting or k == "proxy"))
        time.sleep(2)


def reap(procs: dict, timeout: float = 60.0) -> None:
    """Wait for the processes started here to exit; kill those that take over ``timeout``
    seconds."""
    for p in procs.values():
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stop(procs: dict) -> None:
    """Terminate the processes started here and :func:`reap` them."""
    for p in procs.values():
        p.terminate()
    reap(procs)


@contextlib.contextmanager
def pd_servers(model, workdir, *, prefill: dict = PREFILL, decode: dict = DECODE,
               server_args=(), proxy_timeout: float = 120.0, start_timeout: float = 1200.0,
               session: bool = False):
    """Start a prefill server, a decode server (``kvabi-vllm serve MODEL``, KvabiConnector
    kv_producer / kv_consumer; ``prefill``/``decode``: ``block_size`` and ``env``;
    ``session``: each in a session of its own, as separate terminals or service units) and
    ``kvabi-vllm proxy`` in front; yield ``{"proxy", "prefill", "decode": base URL, "logs":
    {name: log path}, "pids": {name: process id}}`` once the proxy is healthy; stop all
    three on exit."""
    from kvabi.transfer.nixl import free_port

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    ports = {k: free_port() for k in ("prefill", "decode", "proxy")}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    logs = {k: work / f"{k}.log" for k in ports}
    common = [str(model), "--served-model-name", MODEL, "--dtype", "float32",
              "--enforce-eager", *server_args]
    procs = {}
    try:
        for name, side, role in (("prefill", prefill, "kv_producer"),
                                 ("decode", decode, "kv_consumer")):
            procs[name] = start(
                ["serve", *common, "--port", str(ports[name]), "--block-size",
                 str(side["block_size"]), "--kv-transfer-config", connector_config(role)],
                logs[name], session=session, VLLM_CPU_KVCACHE_SPACE="1",
                **side.get("env", {}))
        procs["proxy"] = start(["proxy", "--prefill", urls["prefill"], "--decode",
                                urls["decode"], "--port", str(ports["proxy"]),
                                "--timeout", str(proxy_timeout)], logs["proxy"],
                               session=session)
        wait_healthy(urls, procs, logs, start_timeout)
        yield {**urls, "logs": logs, "pids": {k: p.pid for k, p in procs.items()}}
    finally:
        stop(procs)
