"""``kvabi-vllm guard``: a P/D pair under attack, each side a vLLM process of its own.

The prefill side is vLLM's CPU backend (LBHNC, 32-token blocks), ``kv_producer`` with a
short hold.  It prefills on demand: for each ``ask-K.json`` (a list of prompts) it writes
the requests' ``kv_transfer_params`` to ``params-K.json``; for each ``status-K`` it writes
its state to ``state-K.json``; it steps its engine in between (notifications, expiry)
until ``stop``.

The decode side is the kvabi backend ``example.torch`` (cross-layer BLHNC, 64-token
blocks) with the corrupting connector of the negative control
(:mod:`kvabi_vllm.tools.corrupting_connector`), ``kv_consumer`` with a short pull timeout
and a host tier.  It runs the phases of :func:`decode`, each a batch of concurrent
requests (honest and attacked mixed: every class of hostile ``kv_transfer_params``,
lying handshakes, changed bytes, replays, forged notifications, an unreachable and a
frozen producer, host tier reuse across tenants), and writes every request's tokens,
finish reason, seconds and the reason it was refused, the single-engine reference tokens,
and its tables, to ``decode.json``.

:func:`attack_pair` runs both (the tests of ``test_connector_guard`` read its result);
``kvabi-vllm guard`` prints what happened to each request.  Internal roles:
``python -m kvabi_vllm.tools.pd_guard prefill|decode WORKDIR MODEL [PREFILL_PID]``.
"""
import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PULL_TIMEOUT = 6.0
HOLD_TIMEOUT = 12.0
MAX_TOKENS = 8


def _write(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def _wait_file(path: Path, limit: float = 300.0):
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"{path.name}: no answer from the prefill process")
        time.sleep(0.02)
    return json.loads(path.read_text())


def _scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler


def prefill(work: Path, model: str) -> None:
    from .pd import _sampling, make_llm
    from vllm.inputs import TokensPrompt

    llm = make_llm(model, block_size=32, role="kv_producer",
                   extra={"hold_timeout_s": HOLD_TIMEOUT, "max_held": 24})
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    (work / "prefill.ready").touch()
    done = set()
    while not (work / "stop").exists():
        for ask in sorted(work.glob("ask-*.json")):
            if ask.name in done:
                continue
            done.add(ask.name)
            ps = [TokensPrompt(prompt_token_ids=p) for p in json.loads(ask.read_text())]
            outs = llm.generate(ps, [_sampling(1, {"do_remote_decode": True}) for _ in ps],
                                use_tqdm=False)
            _write(work / ask.name.replace("ask", "params"),
                   [o.kv_transfer_params for o in outs])
        for st in sorted(work.glob("status-*")):
            if st.name in done:
                continue
            done.add(st.name)
            _write(work / f"state-{st.name.split('-', 1)[1]}.json", {
                "held": worker.table_sizes()["grants"], "free_blocks": pool.get_num_free_blocks(),
                "total_blocks": total, "ignored": worker.ignored_notifications,
                "scheduler": _scheduler_connector(llm).table_sizes(),
                "worker": worker.table_sizes()})
        llm.llm_engine.step()  # frees blocks as decode engines read them, and expires
        time.sleep(0.01)


class Decoder:
    """The decode engine and its conversation with the prefill process."""

    def __init__(self, work: Path, model: str):
        from .pd import make_llm

        self.work = work
        self.llm = make_llm(model, block_size=64, role="kv_consumer",
                            module="kvabi_vllm.tools.corrupting_connector",
                            extra={"pull_timeout_s": PULL_TIMEOUT, "host_blocks": 64})
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.worker = get_kv_transfer_group().connector_worker
        self.scheduler = _scheduler_connector(self.llm)
        self.asks = 0
        self.results: dict = {}

    def ask(self, prompts) -> list:
        """The prefill engine's kv_transfer_params for ``prompts`` (prefilled now)."""
        self.asks += 1
        _write(self.work / f"ask-{self.asks}.json", prompts)
        return _wait_file(self.work / f"params-{self.asks}.json")

    def prefill_state(self, tag: str) -> dict:
        (self.work / f"status-{tag}").touch()
        return _wait_file(self.work / f"state-{tag}.json")

    def run(self, reqs) -> dict:
        """Run ``[(id, prompt, params, salt)]`` concurrently; per id (tokens, finish reason,
        seconds until it finished)."""
        from .pd import _sampling
        from vllm.inputs import TokensPrompt

        eng = self.llm.llm_engine
        t0 = time.monotonic()
        out = {}
        for rid, prompt, params, salt in reqs:
            tp = TokensPrompt(prompt_token_ids=prompt)
            if salt is not None:
                tp["cache_salt"] = salt
            try:
                eng.add_request(rid, tp, _sampling(MAX_TOKENS, params))
            except Exception as e:  # noqa: BLE001 - vLLM's front end refused it itself
                out[rid] = ([], f"front end: {type(e).__name__}: {e}", 0.0)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = (list(o.outputs[0].token_ids),
                                         str(o.outputs[0].finish_reason),
                                         time.monotonic() - t0)
        self.results.update(out)
        return out

    def reasons(self) -> dict:
        """Refusal reasons by request id (the scheduler side's and the worker side's)."""
        got = {}
        for rid, why in list(self.scheduler.refusals) + list(self.worker.refusals):
            got.setdefault(rid.rsplit("-", 1)[0], why)
        return got


def _attacks(params: dict, prompts: dict, victims: dict) -> list:
    """(id, prompt, params) of each attack on a decode engine, from the honest params of
    ``params`` (one prompt each) and the victims' (whose grants must survive them)."""
    def edit(name, fn):
        p = copy.deepcopy(params[name])
        fn(p)
        return p

    def handshake(p, part, fn):
        msg = json.loads(p["kvabi_handshakes"][0][part])
        fn(msg)
        p["kvabi_handshakes"][0][part] = json.dumps(msg)

    def shift_plane(m):
        m["planes"]["address"][0] += 64  # the compact planes object: per-plane lists

    def part_of(p):  # the part the decode engine reads: vLLM's CPU cache is one part kv of
        return "kv" if "kv" in p["kvabi_handshakes"][0] else "k"  # two components

    def comps(m):
        return {c["name"]: c for c in m["layout"]["components"]}

    def restate(m):
        # the message's own fingerprint restated for its edited descriptor (else the
        # handshake is refused before the grant is read): only the producer's grant can tell
        from kvabi import Layout

        m["fingerprint"] = Layout.from_json(json.dumps(m["layout"])).fingerprint()

    def tile_order(m):  # the keys stated token-major: the tile order of the values
        lay = m["layout"]
        if "components" in lay:
            k, v = comps(m)["key"], comps(m)["value"]
            k["strides"]["N"], k["strides"]["E"] = v["strides"]["N"], v["strides"]["E"]
        else:
            isz = lay["strides"]["N"]
            lay["strides"].update(N=lay["sizes"]["D"] * isz, D=isz)
            order = lay["order"]
            i, j = order.index("N"), order.index("D")
            order[i], order[j] = order[j], order[i]
        restate(m)

    def swap_kv(p):
        hs = p["kvabi_handshakes"][0]
        if "kv" not in hs or "components" not in json.loads(hs["kv"])["layout"]:
            hs["k"], hs["v"] = hs["v"], hs["k"]
            hs.pop("kv", None)
        else:  # the key and value components trade places
            m = json.loads(hs["kv"])
            c = comps(m)
            c["key"]["name"], c["value"]["name"] = "value", "key"
            restate(m)
            hs["kv"] = json.dumps(m)
        for k in [k for k in hs if k.startswith("image")]:
            del hs[k]

    out = [
        ("a-missing", "a1", edit("a1", lambda p: p.pop("kvabi_grant"))),
        ("a-type", "a2", edit("a2", lambda p: p.update(remote_block_ids="0,1,2"))),
        ("a-empty", "a3", edit("a3", lambda p: p.update(kvabi_handshakes=[]))),
        ("a-nested", "a4", edit("a4", lambda p: p.update(
            remote_block_ids=[p["remote_block_ids"]]))),
        # (a truthy non-object stops in vLLM's own front end, before any connector)
        ("a-notobject", "a5", []),
        ("a-null", "a6", edit("a6", lambda p: p["remote_block_ids"][0].__setitem__(0, -1))),
        ("a-repeated", "a7", edit("a7", lambda p: p["remote_block_ids"][0].__setitem__(
            1, p["remote_block_ids"][0][0]))),
        ("a-short", "a8", edit("a8", lambda p: p["remote_block_ids"][0].pop())),
        ("a-negative", "a9", edit("a9", lambda p: p["remote_block_ids"][0].__setitem__(0, -3))),
        # (vLLM's own SamplingParams refuses integers past 2**64 - 1)
        ("a-int64", "a10", edit("a10", lambda p: p["remote_block_ids"][0].__setitem__(
            0, 2**63 + p["remote_block_ids"][0][0]))),
        # another request's ids, and another request's whole grant, for this prompt
        ("a-otherids", "a11", edit("a11", lambda p: p.update(
            remote_block_ids=copy.deepcopy(victims["v1"]["remote_block_ids"])))),
        ("a-othergrant", "a12", copy.deepcopy(victims["v2"])),
        ("a-forgednonce", "a13", edit("a13", lambda p: p["kvabi_grant"].update(
            slot=victims["v1"]["kvabi_grant"]["slot"], nonce="0" * 32))),
        # lying handshakes: a plane shifted, keys and values swapped, a tile order misstated
        ("a-shifted", "a14", edit("a14", lambda p: handshake(p, part_of(p), shift_plane))),
        ("a-swapped", "a15", edit("a15", swap_kv)),
        ("a-tileorder", "a16", edit("a16", lambda p: handshake(p, part_of(p), tile_order))),
        # the decode prompt shorter than the prefilled one
        ("a-shorterprompt", "a17", params["a17"]),
    ]
    return [(rid, prompts[name][:-1] if rid == "a-shorterprompt" else prompts[name], p)
            for rid, name, p in out]


def decode(work: Path, model: str, prefill_pid: int) -> None:
    from kvabi.transfer.nixl import NixlAgent, free_port
    from .checkpoints import prompts as make_prompts

    d = Decoder(work, model)
    names = ["h1", "h2", "long", "corrupt", "v1", "v2"] + [f"a{i}" for i in range(1, 18)]
    lengths = {"h1": 37, "h2": 100, "long": 70, "corrupt": 60, "v1": 70, "v2": 70}
    ps = make_prompts(len(names), lengths=(70,), shared_prefix=0, seed=7)
    prompts = {n: (p[:lengths[n]] if n in lengths else p) for n, p in zip(names, ps)}
    prompts["h2"] = make_prompts(1, lengths=(100,), shared_prefix=0, seed=8)[0]
    params = dict(zip(names, d.ask([prompts[n] for n in names])))
    victims = {"v1": params["v1"], "v2": params["v2"]}
    t = {}

    # A: honest pulls (relayout), a longer decode prompt, the negative control and every
    # malformed or hostile parameter class, concurrently, with a plain request
    extra = [5, 9, 11, 13]
    reqs = [("h1", prompts["h1"], params["h1"], None), ("h2", prompts["h2"], params["h2"], None),
            ("long", prompts["long"] + extra, params["long"], None),
            ("corrupt-1", prompts["corrupt"], params["corrupt"], None),
            ("plain-a", prompts["a1"][:50], None, None)]
    reqs += [(rid, p, par, None) for rid, p, par in _attacks(params, prompts, victims)]
    t["A"] = time.monotonic()
    d.run(reqs)
    t["A"] = time.monotonic() - t["A"]

    # C: forged notifications for the victims' grants, from another NIXL agent
    attacker = NixlAgent("kvabi-attacker", host="127.0.0.1")
    import numpy as np

    import kvabi
    from kvabi.transfer import plan_block_transfer

    peer = attacker.connect(params["v1"]["kvabi_grants"])
    local = kvabi.KVCache.allocate(peer.layout, "numpy")
    for victim, nonce in (("v1", "f" * 32), ("v2", params["a3"]["kvabi_grant"]["nonce"]),
                          ("v1", None)):
        slot = params[victim]["kvabi_grant"]["slot"]
        note = f"kvabi.pull:{slot}:{nonce}" if nonce else "kvabi.pull:garbage"
        attacker.pull_plan(peer, plan_block_transfer(peer.layout, peer.layout, [slot], [slot]),
                           local, notify=note.encode(), staged=True)
    time.sleep(0.5)
    state_c = d.prefill_state("C")
    attacker.close()

    # B: the victims' honest pulls (their blocks survived), a replay, the next requests
    reqs = [("v1", prompts["v1"], params["v1"], None), ("v2", prompts["v2"], params["v2"], None),
            ("replay", prompts["h1"], params["h1"], None),
            ("plain-b", prompts["a2"][:40], None, None)]
    d.run(reqs)

    # D: an unreachable producer, and a frozen one, each beside a plain request
    fresh = d.ask([prompts["a3"], prompts["a4"]])
    ghost = copy.deepcopy(fresh[0])
    g = json.loads(ghost["kvabi_grants"])
    g["agent"].update(name="kvabi-ghost", port=free_port())
    g.pop("metadata", None)
    ghost["kvabi_grants"] = json.dumps(g)
    d.run([("ghost", prompts["a3"], ghost, None), ("plain-d", prompts["a5"][:45], None, None)])
    os.kill(prefill_pid, signal.SIGSTOP)
    try:
        d.run([("frozen", prompts["a4"], fresh[1], None),
               ("plain-e", prompts["a6"][:45], None, None)])
    finally:
        os.kill(prefill_pid, signal.SIGCONT)

    # F: the host tier: pulled KV never saved; cache_salt keeps tenants apart
    before = dict(d.worker.host_stats)
    h2_ext = prompts["h2"] + d.results["h2"][0] + [3, 5]  # h2 was pulled: 100 tokens
    salted = prompts["a7"][:66]
    d.run([("host-h2ext", h2_ext, None, None), ("host-salt-a", salted, None, "tenant-a")])
    mid = dict(d.worker.host_stats)
    s_ext = salted + d.results["host-salt-a"][0] + [7]
    d.run([("host-salt-b-ext", s_ext, None, "tenant-b")])
    after_b = dict(d.worker.host_stats)
    d.run([("host-salt-a-ext", s_ext, None, "tenant-a")])
    after_a = dict(d.worker.host_stats)

    # the single-engine reference of every prompt decoded (the host tier off)
    off = {"kvabi_host": False}
    ref = {rid: p for rid, p in [("h1", prompts["h1"]), ("h2", prompts["h2"]),
                                  ("long", prompts["long"] + extra),
                                  ("v1", prompts["v1"]), ("v2", prompts["v2"]),
                                  ("frozen", prompts["a4"]), ("plain-a", prompts["a1"][:50]),
                                  ("plain-b", prompts["a2"][:40]),
                                  ("plain-d", prompts["a5"][:45]),
                                  ("plain-e", prompts["a6"][:45]), ("host-h2ext", h2_ext),
                                  ("host-salt-a-ext", s_ext), ("host-salt-b-ext", s_ext)]}
    single = d.run([(f"ref-{rid}", p, off, None) for rid, p in ref.items()])
    # the engine serves the next P/D request after all of it
    last = d.ask([prompts["a8"]])
    d.run([("after", prompts["a8"], last[0], None)])
    after_ref = d.run([("ref-after", prompts["a8"], off, None)])
    _write(work / "decode.json", {
        "results": d.results, "reasons": d.reasons(),
        "single": {rid[4:]: v[0] for rid, v in {**single, **after_ref}.items()},
        "layouts": d.worker.part_layouts(), "pulls": list(d.worker.pull_stats),
        "scheduler_tables": d.scheduler.table_sizes(), "worker_tables": d.worker.table_sizes(),
        "host": {"before": before, "mid": mid, "after_b": after_b, "after_a": after_a},
        "prefill_after_forged": state_c, "ignored_before": 0, "phase_s": t,
        "victim_slots": [params["v1"]["kvabi_grant"]["slot"],
                         params["v2"]["kvabi_grant"]["slot"]],
        "corrupted": getattr(type(d.worker), "corrupted", 0)})


#: the requests served honestly beside the attacks (their tokens must be the single engine's)
HONEST = ("h1", "h2", "long", "v1", "v2", "plain-a", "plain-b", "plain-d", "plain-e",
          "after")

#: what each attacked request tries (issue 23's classes), for the summary
ATTACKS = {
    "a-missing": "kvabi_grant left out",
    "a-type": "remote_block_ids a string",
    "a-empty": "kvabi_handshakes empty",
    "a-nested": "remote_block_ids nested one level too deep",
    "a-notobject": "kv_transfer_params a list",
    "a-null": "the null block as a remote block",
    "a-repeated": "a remote block id twice",
    "a-short": "one remote block short",
    "a-negative": "a negative remote block id",
    "a-int64": "a remote block id past int64 (wraps to a real block)",
    "a-otherids": "another request's remote block ids",
    "a-othergrant": "another request's whole parameters",
    "a-forgednonce": "a live grant's slot with a forged nonce",
    "a-shorterprompt": "a decode prompt shorter than the prefilled one",
    "a-shifted": "the key plane's address shifted inside its memory",
    "a-swapped": "keys and values swapped in the handshake",
    "a-tileorder": "the key tiles' order misstated",
    "corrupt-1": "bytes changed on the way (one pulled block overwritten)",
    "replay": "h1's parameters again, after h1 read them",
    "ghost": "a producer that is not there",
    "frozen": "a producer frozen (SIGSTOP) during the pull",
}


def attack_pair(work: Path, model: str | None = None, progress=None) -> dict:
    """Run both sides in ``work`` (a tiny llama checkpoint is written there unless
    ``model``): the decode side's ``decode.json`` with ``prefill_end`` (the prefill
    engine's state once every grant was read or expired) and ``log`` (the decode side's
    output).  Raises RuntimeError with the log's tail when a side fails."""
    from .checkpoints import write_checkpoint
    from .pd import ENV, KVABI_DECODE, stop_process

    say = progress or (lambda msg: None)
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model = str(model or write_checkpoint("llama", work / "llama"))
    env = {**os.environ, **ENV}
    cmd = [sys.executable, "-m", "kvabi_vllm.tools.pd_guard"]
    t0 = time.monotonic()
    say("prefill engine starting (vLLM's CPU attention, LBHNC, 32-token blocks)")
    with open(work / "prefill.log", "w") as plog:
        p = subprocess.Popen(cmd + ["prefill", str(work), model], env=env, stdout=plog,
                             stderr=subprocess.STDOUT)
        try:
            while not (work / "prefill.ready").exists():
                if p.poll() is not None or time.monotonic() - t0 > 600:
                    raise RuntimeError("prefill: " +
                                       (work / "prefill.log").read_text()[-4000:])
                time.sleep(0.2)
            say(f"prefill engine ready ({time.monotonic() - t0:.0f} s); decode engine "
                f"(example.torch, BLHNC, 64-token blocks) running the attacks")
            d = subprocess.run(cmd + ["decode", str(work), model, str(p.pid)],
                               env={**env, **KVABI_DECODE["env"]}, capture_output=True,
                               text=True, timeout=900)
            (work / "decode.log").write_text(d.stdout + d.stderr)
            if d.returncode:
                raise RuntimeError("decode: " + (d.stdout + d.stderr)[-6000:])
            out = json.loads((work / "decode.json").read_text())
            say(f"decode side done ({time.monotonic() - t0:.0f} s); waiting for the prefill "
                f"engine's grants to be read or expire (hold_timeout_s {HOLD_TIMEOUT:g})")
            deadline, i = time.monotonic() + HOLD_TIMEOUT + 60, 0
            while True:
                i += 1
                (work / f"status-end{i}").touch()
                state = _wait_file(work / f"state-end{i}.json")
                if (state["held"] == 0 and state["free_blocks"] == state["total_blocks"]) \
                        or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
        finally:
            stop_process(p, work / "stop")
    out["prefill_end"] = state
    out["log"] = d.stdout + d.stderr
    return out


def summary(run: dict) -> tuple[list[str], bool]:
    """Lines saying what happened to each request, and whether every honest one got its
    single-engine tokens, every attacked one failed alone with a reason (``frozen``: right
    tokens or a failure) and both engines' tables emptied."""
    res, reasons, single = run["results"], run["reasons"], run["single"]
    lines, ok = [], True
    lines.append(f"{'request':<16} {'finish':<7} {'seconds':>7}  outcome")
    for rid in HONEST:
        tok, fin, sec = res[rid]
        good = fin == "length" and tok == single[rid]
        ok &= good
        lines.append(f"{rid:<16} {fin:<7} {sec:7.1f}  honest: "
                     f"{'the single engine' if good else 'NOT the single engine'}'s tokens")
    for rid, what in ATTACKS.items():
        tok, fin, sec = res[rid]
        why = reasons.get(rid, "")
        if rid == "frozen" and tok == single.get(rid):
            good, said = True, "served: the READs completed without the peer's CPU"
        else:
            good = fin == "error" and not tok and bool(why)
            said = f"refused: {why}" if good else f"NOT refused ({len(tok)} tokens)"
        ok &= good
        lines.append(f"{rid:<16} {fin:<7} {sec:7.1f}  {what}; {said}")
    host = run["host"]
    pulled_kept = host["mid"]["loaded"] != host["before"]["loaded"]
    salt_crossed = host["after_b"]["loaded"] != host["mid"]["loaded"]
    forged = run["prefill_after_forged"]
    end, s, w = run["prefill_end"], run["scheduler_tables"], run["worker_tables"]
    clean = end["held"] == 0 and end["free_blocks"] == end["total_blocks"] and \
        s["entries"] == 0 and w["pulls"] == 0
    ok &= not pulled_kept and not salt_crossed and clean and forged["ignored"] >= 3
    lines += [
        f"forged notifications: {forged['ignored']} ignored by the producer, "
        f"{forged['held']} grants still held (the victims v1, v2 read them after)",
        f"host tier: pulled KV served later: {'YES' if pulled_kept else 'no'}; "
        f"a hit across cache_salt tenants: {'YES' if salt_crossed else 'no'}",
        f"after: producer grants held {end['held']}, free blocks {end['free_blocks']} of "
        f"{end['total_blocks']}; decode tables {s['entries']} scheduler entries, "
        f"{w['pulls']} pulls, {w['peers']} peers"]
    return lines, ok


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvabi-vllm guard",
        description="A P/D pair of vLLM processes over NIXL (prefill on vLLM's CPU "
                    "attention, decode on the kvabi backend example.torch) attacked the "
                    "ways specs/security.md section 5 names: hostile kv_transfer_params, "
                    "lying handshakes, changed bytes, replays, forged notifications, "
                    "unreachable and frozen producers, the host tier across tenants; "
                    "honest requests run beside the attacks. Prints what happened to each "
                    "request; exit status 1 when a rule was broken. About 2 minutes on 2 "
                    "cores.")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the checkpoint, the engines' logs and decode.json go "
                        "(default: a new temporary directory)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the whole result (tokens, reasons, tables) as JSON")
    return p


def main(argv=None) -> int:
    """``kvabi-vllm guard``: run :func:`attack_pair` and print :func:`summary`."""
    args = _parser().parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvabi-guard-"))
    run = attack_pair(work, progress=lambda m: print(m, flush=True))
    lines, ok = summary(run)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    print(f"{'every rule held' if ok else 'A RULE WAS BROKEN'} (logs in {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    role, work, model = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if role == "prefill":
        prefill(work, model)
    else:
        decode(work, model, int(sys.argv[4]))
