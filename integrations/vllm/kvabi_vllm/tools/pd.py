"""A prefill/decode pair of vLLM engines in two processes, KV moved by KvabiConnector (or
vLLM's own NixlConnector), for the tests, ``kvabi bench vllm`` and the demo.

``python -m kvabi_vllm.tools.pd prefill|decode --help``: one engine per process.  The prefill
process prefills each prompt (one token), writes the requests' ``kv_transfer_params`` to a
JSON file and keeps its engine (and its cache, which the decode side reads) alive until told
to stop.  The decode process generates from those params, then runs the same prompts again
without them (the single-engine reference, prefix caching off) and writes both token lists,
the connector's per-request pull figures and the batch timings (P/D; single engine with all
tokens and with one).  :func:`run_pair` drives both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def allow_cpu_attn_layout(name: str) -> None:
    """Let vLLM's CPU backend run on KV cache layout ``name`` (e.g. cross-layer ``BLHNC``).

    Its kernels address blocks through the cache's block stride, so any of vLLM's layouts
    whose block-head interior is dense works; the backend lists only ``LBHNC``.  The
    connector checks the resulting byte layout against the kernels' own write at start."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    want = KVCacheLayout[name]
    have = CPUAttentionBackend.supported_kv_cache_layouts()
    if want not in have:
        CPUAttentionBackend.supported_kv_cache_layouts = classmethod(
            lambda cls, _l=tuple(have) + (want,): _l)
    os.environ["VLLM_KV_CACHE_LAYOUT"] = name


def make_llm(model: str, *, block_size: int, role: str | None, connector: str = "KvabiConnector",
             module: str | None = "kvabi_vllm.connector", extra: dict | None = None,
             layout: str | None = None, prefix_caching: bool = False, blocks: int = 256,
             dtype: str = "float32", kv_cache_dtype: str = "auto", kv_scales=None,
             tp: int = 1):
    """An in-process vLLM engine (``dtype``, no tokenizer) with a KV connector in ``role``;
    ``kv_cache_dtype`` (e.g. ``fp8``) and per-layer ``kv_scales`` ((k, v) pairs, cycled,
    set as the weights load); ``tp`` > 1: that many tensor-parallel workers, each in a
    process of its own bound to one core (``VLLM_CPU_OMP_THREADS_BIND``, default
    ``0|1|...``)."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if layout:
        allow_cpu_attn_layout(layout)
    if kv_scales:
        from .engine import scales_at_load

        scales_at_load(kv_scales)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if role is not None:
        kw = {"kv_connector": connector, "kv_role": role,
              "kv_connector_extra_config": dict(extra or {})}
        if module:
            kw["kv_connector_module_path"] = module
        if connector == "NixlConnector":
            kw["kv_buffer_device"] = "cpu"
        kv = KVTransferConfig(**kw)
    par = {}
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tp))))
        par = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    return LLM(model=model, skip_tokenizer_init=True, dtype=dtype, block_size=block_size,
               max_model_len=1024, enforce_eager=True, num_gpu_blocks_override=blocks,
               enable_prefix_caching=prefix_caching, kv_transfer_config=kv,
               kv_cache_dtype=kv_cache_dtype, **par)


#: a decode side on another backend, layout and block size than vLLM's CPU backend: the
#: kvabi backend example.torch through the plugin, cross-layer BLHNC, 64-token blocks
KVABI_DECODE = {"block_size": 64, "env": {"KVABI_VLLM_BACKEND": "example.torch",
                                          "KVABI_VLLM_LAYOUT": "BLHNC",
                                          "VLLM_KV_CACHE_LAYOUT": "BLHNC"}}


def _sampling(max_tokens: int, params: dict | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args=extra)


def _prompts(path: str):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in json.loads(Path(path).read_text())]


def _worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    return getattr(conn, "connector_worker", conn)


def _nixl_side_channel(a) -> None:
    """vLLM's NixlConnector listens on VLLM_NIXL_SIDE_CHANNEL_PORT: one free port per
    process (the prefill side's travels in kv_transfer_params)."""
    if a.connector == "NixlConnector":
        from kvabi.transfer.nixl import free_port

        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())


def _record_nixl_transfers() -> list:
    """NixlConnector's per-READ telemetry (post and transfer seconds, bytes, descriptors),
    kept here as well: the engine drains the connector's own figures every step."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    seen: list = []
    orig = NixlKVConnectorStats.record_transfer

    def record(self, res):
        if res is not None:
            seen.append((res.postDuration / 1e6, res.xferDuration / 1e6, int(res.totalBytes),
                         int(res.descCount)))
        return orig(self, res)

    NixlKVConnectorStats.record_transfer = record
    return seen


def prefill_main(a) -> int:
    _nixl_side_channel(a)
    llm = make_llm(a.model, block_size=a.block_size, role="kv_producer",
                   connector=a.connector, module=a.module, layout=a.layout, dtype=a.dtype,
                   kv_cache_dtype=a.kv_cache_dtype, kv_scales=a.kv_scales, extra=a.extra)
    prompts = _prompts(a.prompts)
    outs = llm.generate(prompts, [_sampling(1, {"do_remote_decode": True}) for _ in prompts],
                        use_tqdm=False)
    tmp = Path(a.out + ".tmp")
    tmp.write_text(json.dumps([o.kv_transfer_params for o in outs]))
    tmp.rename(a.out)
    deadline = time.monotonic() + a.timeout
    while not Path(a.stop).exists() and time.monotonic() < deadline:
        llm.llm_engine.step()  # frees blocks as the decode side's reads complete
        time.sleep(0.01)
    return 0


def decode_main(a) -> int:
    _nixl_side_channel(a)
    nixl = _record_nixl_transfers() if a.connector == "NixlConnector" else []
    llm = make_llm(a.model, block_size=a.block_size, role="kv_consumer",
                   connector=a.connector, module=a.module, layout=a.layout, dtype=a.dtype,
                   kv_cache_dtype=a.kv_cache_dtype, kv_scales=a.kv_scales, extra=a.extra)
    prompts = _prompts(a.prompts)
    params = json.loads(Path(a.params).read_text())

    def timed(sampling):
        t0 = time.perf_counter()
        out = llm.generate(prompts, sampling, use_tqdm=False)
        return out, time.perf_counter() - t0

    timed([_sampling(1) for _ in prompts])  # warm-up: the first forward passes are slower
    pd, pd_s = timed([_sampling(a.max_tokens, p) for p in params])
    conn = _worker_connector()
    stats = list(getattr(conn, "pull_stats", []))
    layouts = conn.part_layouts() if hasattr(conn, "part_layouts") else []
    # the single-engine reference; its prefill alone (one token) gives its decode time
    # (taking turns, medians: a shared machine's load drifts)
    fulls, ones = [], []
    for _ in range(a.reference_runs):
        single, t = timed([_sampling(a.max_tokens) for _ in prompts])
        fulls.append(t)
        ones.append(timed([_sampling(1) for _ in prompts])[1])
    single_s, prefill_s = statistics.median(fulls), statistics.median(ones)
    Path(a.out).write_text(json.dumps({
        "pd": [list(o.outputs[0].token_ids) for o in pd],
        "pd_ids": [o.request_id for o in pd],  # numbered after the warm-up's requests
        "finish": [str(o.outputs[0].finish_reason) for o in pd],
        "single": [list(o.outputs[0].token_ids) for o in single],
        "pulls": stats, "nixl": nixl, "generate_s": pd_s, "layouts": layouts,
        "single_s": single_s, "single_prefill_s": prefill_s,
        # why each failed load failed (a test that saw no pull says so)
        "refusals": [list(r) for r in getattr(conn, "refusals", [])],
    }))
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvabi_vllm.tools.pd",
        description="One engine of a vLLM prefill/decode pair in this process, for tests and "
                    "benchmarks (run_pair drives both). prefill: prefill each prompt (one "
                    "token), write the requests' kv_transfer_params, keep the engine (and "
                    "the blocks the decode side reads) until --stop exists. decode: generate "
                    "from those params, then again without them (the single-engine "
                    "reference), and write both token lists and the pull figures.")
    sub = ap.add_subparsers(dest="role", required=True, metavar="{prefill,decode}")
    for role, what in (("prefill", "the producer side (kv_role kv_producer)"),
                       ("decode", "the consumer side (kv_role kv_consumer)")):
        p = sub.add_parser(role, help=what, description=what)
        p.add_argument("--model", required=True, help="checkpoint directory")
        p.add_argument("--prompts", required=True,
                       help="JSON file: a list of prompts, each a list of token ids")
        p.add_argument("--block-size", type=int, default=32,
                       help="vLLM block size (default 32)")
        p.add_argument("--dtype", default="float32",
                       help="model and KV cache dtype (default float32)")
        p.add_argument("--layout", default=None,
                       help="vLLM KV cache layout name, e.g. BLHNC (default: the "
                            "attention backend's)")
        p.add_argument("--connector", default="KvabiConnector",
                       help="KV connector class name (default KvabiConnector; "
                            "NixlConnector: vLLM's own)")
        p.add_argument("--module", default="kvabi_vllm.connector",
                       help="module of the connector ('' for one of vLLM's own)")
        p.add_argument("--out", required=True, help="where to write the results (JSON)")
        p.add_argument("--timeout", type=float, default=600.0,
                       help="seconds before giving up (default 600)")
        p.add_argument("--kv-cache-dtype", default="auto",
                       help="vLLM's kv_cache_dtype (auto, fp8, fp8_e5m2)")
        p.add_argument("--kv-scales", type=json.loads, default=None,
                       help="per-layer static KV scales as JSON [[k, v], ...] (cycled), set "
                            "as the weights load")
        p.add_argument("--extra", type=json.loads, default=None,
                       help="the connector's kv_connector_extra_config as JSON, e.g. "
                            '\'{"nixl_host": "10.0.0.1"}\' (the address its NIXL agent '
                            "listens on)")
        if role == "prefill":
            p.add_argument("--stop", required=True,
                           help="keep serving the decode side's reads until this file exists")
        else:
            p.add_argument("--params", required=True,
                           help="the prefill side's output (its kv_transfer_params)")
            p.add_argument("--max-tokens", type=int, default=16,
                           help="tokens to generate per prompt (default 16)")
            p.add_argument("--reference-runs", type=int, default=3,
                           help="runs of the single-engine reference (timings take the "
                                "median; default 3)")
    return ap


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    a.module = a.module or None
    return prefill_main(a) if a.role == "prefill" else decode_main(a)


def run_pair(model: str, prompts, workdir, *, prefill: dict, decode: dict,
             max_tokens: int = 16, timeout: float = 600.0, env: dict | None = None,
             edit_params=None, reference_runs: int = 3) -> dict:
    """Run a prefill and a decode process; ``prefill``/``decode`` give each side's
    ``block_size``, ``layout``, ``connector``, ``module``, ``dtype``, ``model`` (default:
    ``model``), ``kv_cache_dtype``, ``kv_scales``, ``env`` (e.g. the kvabi attention
    backend, ``KVABI_VLLM_BACKEND``), ``extra`` (the connector's extra config, e.g. its
    ``nixl_host``) and ``prefix`` (a command the process runs under, e.g. ``ip netns exec
    NAME``: another host); ``edit_params`` (tests) may
    rewrite the prefill side's kv_transfer_params on their way; ``reference_runs``: runs of
    the single-engine reference (benchmarks take the median of 3).  Returns the decode
    side's results (``pd`` and ``single`` tokens, ``finish`` reasons, ``pulls``, the
    connector's ``refusals``).  Every wait fails saying what it waited for."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.json").write_text(json.dumps([list(map(int, p)) for p in prompts]))
    params, stop, out = work / "params.json", work / "stop", work / "decode.json"
    for f in (params, stop, out):
        f.unlink(missing_ok=True)

    def args(side: dict) -> list[str]:
        a = ["--model", str(side.get("model", model)), "--prompts", str(work / "prompts.json"),
             "--block-size", str(side.get("block_size", 32)),
             "--dtype", side.get("dtype", "float32"),
             "--connector", side.get("connector", "KvabiConnector"),
             "--module", side.get("module", "kvabi_vllm.connector") or ""]
        a += ["--kv-cache-dtype", side.get("kv_cache_dtype", "auto")]
        if side.get("kv_scales"):
            a += ["--kv-scales", json.dumps(side["kv_scales"])]
        if side.get("extra"):
            a += ["--extra", json.dumps(side["extra"])]
        return a + (["--layout", side["layout"]] if side.get("layout") else [])

    penv = {**os.environ, **ENV, **(env or {})}
    cmd = [sys.executable, "-m", "kvabi_vllm.tools.pd"]
    plog = open(work / "prefill.log", "w")  # a file: a pipe nobody reads would block it
    p = subprocess.Popen(list(prefill.get("prefix", [])) + cmd + ["prefill"] + args(prefill) +
                         ["--out", str(params), "--stop", str(stop)],
                         env={**penv, **prefill.get("env", {})},
                         stdout=plog, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not params.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                why = f"exited {p.returncode}" if p.poll() is not None else \
                    f"wrote no kv_transfer_params within {timeout:g} s"
                raise RuntimeError(f"prefill process {why}:\n" +
                                   (work / "prefill.log").read_text()[-4000:])
            time.sleep(0.2)
        if edit_params is not None:
            params.write_text(json.dumps(edit_params(json.loads(params.read_text()))))
        with open(work / "decode.log", "w") as dlog:
            try:
                d = subprocess.run(list(decode.get("prefix", [])) + cmd + ["decode"] + args(decode) +
                                   ["--params", str(params), "--out", str(out),
                                    "--max-tokens", str(max_tokens),
                                    "--reference-runs", str(reference_runs)],
                                   env={**penv, **decode.get("env", {})}, stdout=dlog,
                                   stderr=subprocess.STDOUT, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"decode process: not done within {timeout:g} s:\n" +
                                   (work / "decode.log").read_text()[-4000:]) from None
        if d.returncode:
            raise RuntimeError("decode process failed:\n" +
                               (work / "decode.log").read_text()[-4000:])
        return json.loads(out.read_text())
    finally:
        stop_process(p, stop)
        plog.close()


def stop_process(p: subprocess.Popen, stop: Path, timeout: float = 60.0) -> None:
    """Ask a prefill process to exit (its ``stop`` file), killing it after ``timeout``."""
    stop.touch()
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


if __name__ == "__main__":
    sys.exit(main())


def demo_pair(workdir=None, *, progress=print) -> bool:
    """The demo's P/D pair: prefill on vLLM's CPU backend with LBHNC and 32-token blocks,
    decode on the kvabi backend ``example.torch`` (through the kvabi attention-backend
    plugin) on cross-layer BLHNC with 64-token blocks, KV moved by KvabiConnector over NIXL
    with relayout.  Prints what moved; True when the decode side's tokens equal the decode
    engine computing alone."""
    import tempfile

    from .checkpoints import distinct_tokens, prompts, write_checkpoint

    work = Path(workdir or tempfile.mkdtemp(prefix="kvabi-pd-demo-"))
    model = write_checkpoint("llama", work / "llama")
    ps = prompts(3, lengths=(37, 70, 100), shared_prefix=0)
    progress("P/D pair: prefill on vLLM's CPU_ATTN (LBHNC, 32-token blocks) -> decode on "
             "kvabi example.torch (cross-layer BLHNC, 64-token blocks); KvabiConnector, NIXL "
             "UCX over DRAM, relayout ...")
    r = run_pair(model, ps, work / "pd", prefill={"block_size": 32},
                 decode=KVABI_DECODE, max_tokens=12)
    for (req, secs, regions, nbytes, read_s, *_), toks in zip(r["pulls"], r["pd"]):
        progress(f"  request {req.split('-')[0]}: {nbytes / 1024:.0f} KiB in {regions} "
                 f"regions, READs {read_s * 1e3:.1f} ms; tokens {toks[:6]}...")
    ok = r["pd"] == r["single"] and distinct_tokens(r["single"]) > 1
    progress(f"  decode tokens {'equal' if ok else 'DIFFER from'} the single engine's")
    return ok
