"""``kvabi bench transfer``: moving one request's KV, per preset layout, on a
Llama-3-8B-like KV group (32 layers, 8 KV heads x 128, bfloat16, block 16; a 2048-token
request = 128 blocks, as one run of blocks and scattered).

One table (:mod:`kvabi.bench.transfer_table`), every row timed alternately with its
references in the same run: per preset, a local ``execute`` (cache to cache), host
offload/onload through a ``HostPool`` and a NIXL pull between two processes (UCX on
loopback; skipped without nixl) against one ``memcpy`` of the same bytes (NIXL rows also
against one single-region READ of them); relayouts (``flashinfer.HND`` block 16 ->
``tpu.combined`` block 64; vLLM's CPU cache ``vllm.cpu`` block 16, keys ``[D, N]`` and
values ``[N, D]`` per block-head, -> its cross-layer ``vllm.cpu.BLHNC`` block 64 and ->
``flashinfer.HND``), locally and pulled, against the same-layout move of the same tokens;
and pulls between tensor-parallel sizes against same-TP pulls of the same bytes
(:mod:`kvabi.bench.transfer_tp`).  Then figures without a table row (the bounds check of a
post, torch planes against numpy planes, ``from_lengths`` of Python lists, negotiation,
checksums) and each goal as a "goal" line and a "measured" line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..layout.presets import PRESETS, preset_names
from ..memory.cache import KVCache
from ..model.spec import KVSpec
from ..transfer import HostPool, TransferPlan, execute, plan_block_transfer, plan_transfer
from . import transfer_tp
from .rig import ServingRig
from .transfer_table import Memcpy, alternate, find, format_table, row, side_by_side

SPEC = KVSpec(kind="full", block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NUM_LAYERS = 32
TOKENS = 2048
CROSS = "kvbm.fully_contiguous"  # the cross-layer preset the goals compare
PER_LAYER = "flashinfer.HND"  # the per-layer preset the goals compare
#: relayouts: (source preset, destination preset, destination block size)
RELAYOUTS = (("flashinfer.HND", "tpu.combined", 64), ("vllm.cpu", "vllm.cpu.BLHNC", 64),
             ("vllm.cpu", "flashinfer.HND", 16))


@attrs.frozen
class Setup:
    """Sizes of one run (``--quick`` shrinks them; the JSON shape stays the same)."""

    layers: int = NUM_LAYERS
    tokens: int = TOKENS
    repeat: int = 3

    @property
    def blocks(self) -> int:
        return self.tokens // SPEC.block_size

    @property
    def num_blocks(self) -> int:  # room to scatter the request
        return self.blocks * 3 // 2


def block_sets(setup: Setup, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n, nb = setup.blocks, setup.num_blocks
    return {"contiguous": np.arange(nb - n, nb),
            "scattered": np.sort(rng.choice(nb, n, replace=False))}


def _best(op, repeat: int) -> float:
    op()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - t)
    return best


def _layout(name, setup, block_size=None, num_blocks=None):
    spec = SPEC if block_size is None else attrs.evolve(SPEC, block_size=block_size)
    return Layout.preset(name, spec, num_blocks or setup.num_blocks, setup.layers)


def _filled(layout):
    return KVCache.allocate(layout, "numpy", fill=1)  # values do not matter, bytes do


# -- the serving process for NIXL rows -------------------------------------------------------
def _serve(conn):
    """Child process: allocate and register source caches on request, hand out handshakes.
    Each cache gets an agent of its own (closed when the cache is freed): memory freed and
    allocated again may overlap a registration the puller's metadata of a longer-lived agent
    still holds, which NIXL then cannot resolve."""
    from ..transfer.nixl import NixlAgent

    caches, made = {}, 0
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            for agent, _ in caches.values():
                agent.close()
            conn.send("bye")
            return
        if cmd == "alloc":
            layout = Layout.from_json(args[0])
            made += 1
            agent = NixlAgent(f"bench-source-{made}")
            cache = agent.register(_filled(layout))
            caches[args[1]] = (agent, cache)
            conn.send(agent.handshake(cache))
        elif cmd == "free":
            agent, cache = caches.pop(args[0])
            agent.deregister(cache)
            agent.close()
            conn.send("ok")


class NixlRig(ServingRig):
    """This process's agent plus a spawned serving process holding the source caches, and
    one flat cache of the request's size on both sides for the one-region READ reference."""

    def __init__(self, setup: Setup):
        super().__init__("bench-puller", _serve)
        self.flat = _layout(CROSS, setup, num_blocks=setup.blocks)  # one plane = the request
        self.flat_message = self._ask("alloc", self.flat.to_json(), "flat")
        self.flat_dst = self.agent.register(KVCache.allocate(self.flat, "numpy"))

    def measure(self, src_layout, plans, repeat, memcpy) -> dict:
        """{label: (regions, descriptors, seconds, seconds of one READ of the same bytes,
        seconds of a memcpy of them)} pulling each same-layout plan from a cache of
        ``src_layout`` served by the other process."""
        message = self._ask("alloc", src_layout.to_json(), "src")
        dst = self.agent.register(KVCache.allocate(src_layout, "numpy"))
        try:
            peer = self.agent.connect(message, timeout=30)
            flat = self.agent.connect(self.flat_message, timeout=30)
            out = {}
            for label, plan in plans.items():
                one = TransferPlan(np.array([[0, 0, 0, 0, plan.nbytes]], np.int64),
                                   flat.layout, self.flat)
                t, t_one, t_mem = alternate([
                    lambda: self.agent.pull_plan(peer, plan, dst, timeout=120),
                    lambda: self.agent.pull_plan(flat, one, self.flat_dst, timeout=120),
                    memcpy(plan.nbytes)], repeat)
                out[label] = (len(plan), self.agent.descriptors(peer, plan, dst), t, t_one,
                              t_mem)
            return out
        finally:
            self.agent.deregister(dst)
            self._ask("free", "src")

    def measure_pair(self, src_layout, dst_layout, plan, same_plan, repeat, memcpy) -> dict:
        """A relayout pull of ``plan`` (staged or direct, the agent's choice) and a
        same-layout pull of the same tokens (``same_plan``, ``src_layout`` to
        ``src_layout``) and a memcpy of the same bytes, timed alternately; the bounds check
        each post makes, timed alone; descriptors posted by each pull."""
        message = self._ask("alloc", src_layout.to_json(), "src")
        dst = self.agent.register(KVCache.allocate(dst_layout, "numpy"))
        same = self.agent.register(KVCache.allocate(src_layout, "numpy"))
        try:
            peer = self.agent.connect(message, timeout=30)
            t, t_same, t_mem = alternate([
                lambda: self.agent.pull_plan(peer, plan, dst, timeout=120),
                lambda: self.agent.pull_plan(peer, same_plan, same, timeout=120),
                memcpy(plan.nbytes)], repeat)
            sizes = peer.handshake.plane_nbytes
            check = _best(lambda: plan.check(src_nbytes=sizes), repeat)
            return {"relayout_s": t, "same_layout_s": t_same, "memcpy_s": t_mem,
                    "check_s": check, "regions": _regions(plan), "nbytes": plan.nbytes,
                    "descriptors": self.agent.descriptors(peer, plan, dst),
                    "same_descriptors": self.agent.descriptors(peer, same_plan, same)}
        finally:
            self.agent.deregister(dst)
            self.agent.deregister(same)
            self._ask("free", "src")


# -- the run -------------------------------------------------------------------------------
#: a whole-block plan of more regions than this is counted before merging (an upper bound)
#: instead of building its regions (vllm.cpu -> flashinfer.HND: 67 million, 2.5 GiB)
COUNT_BELOW = 8_000_000


def _regions(plan) -> int:
    return plan.max_regions if plan.max_regions > COUNT_BELOW else len(plan)


def _name(layout) -> str:
    return f"{layout.name}/{layout.size('N')}"


def measure(setup: Setup, *, presets=None, nixl: bool = True, progress=None,
            tp_only: bool = False) -> dict:
    """``{"setup", "table", "figures"}``: ``table`` holds the rows of
    :mod:`~kvabi.bench.transfer_table`, each timed alternately with its references;
    ``figures`` the figures without a row (the tensor-parallel ones of
    :mod:`kvabi.bench.transfer_tp` included); ``tp_only``: those alone."""
    say = progress or (lambda msg: None)
    presets = preset_names(SPEC) if presets is None else presets
    sets = block_sets(setup)
    if nixl:
        from ..transfer.nixl import available

        ok, why = available()
        if not ok:
            say(f"NIXL rows skipped: {why}")
            nixl = False
    memcpy = Memcpy()
    tp_presets = [x for x in presets if x in transfer_tp.PRESETS] or transfer_tp.PRESETS[:1]
    fig = transfer_tp.measure(setup, SPEC, sets, memcpy, nixl=nixl, say=say,
                              presets=tp_presets)
    table = fig.pop("tp_pulls", [])
    info = dict(layers=setup.layers, tokens=setup.tokens, repeat=setup.repeat,
                kv_heads=SPEC.num_kv_heads, head_dim=SPEC.head_dim, dtype=SPEC.dtype,
                block_size=SPEC.block_size)
    if tp_only:
        return {"setup": info, "table": table, "figures": fig}
    nbytes = setup.layers * setup.tokens * 2 * SPEC.num_kv_heads * SPEC.head_dim * 2
    rows = []
    # first, before the large buffers and the NIXL agent's threads (with an agent alive
    # the list path measured ~3x slower, the array path unchanged): a Python-heavy figure
    say("from_lengths of Python lists against np.asarray + the numpy path")
    fig["from_lengths"] = from_lengths_lists(setup.repeat)
    rig = NixlRig(setup) if nixl else None
    one = "1-region READ"
    try:
        done = 0
        for i, name in enumerate(presets):
            say(f"[{i + 1}/{len(presets)}] {name}")
            lay = _layout(name, setup)
            src, dst = _filled(lay), KVCache.allocate(lay, "numpy")
            plans = {k: plan_block_transfer(lay, lay, v, v) for k, v in sets.items()}
            for label, plan in plans.items():
                t, t_mem = side_by_side(lambda: execute(plan, src, dst), memcpy(nbytes),
                                        setup.repeat)
                rows.append(row("local copy", name, name, "1 -> 1", label, nbytes,
                                len(plan), None, t, None, None, t_mem))
            pool = HostPool(lay, setup.blocks)
            for label, blocks in sets.items():
                ids = pool.offload(src, blocks)
                regions = len(plan_block_transfer(lay, pool.layout, blocks, ids))
                pool.free(ids)
                t, t_mem = side_by_side(lambda: pool.free(pool.offload(src, blocks)),
                                        memcpy(nbytes), setup.repeat)
                rows.append(row("offload", name, pool.layout.name, "1 -> 1", label, nbytes,
                                regions, None, t, None, None, t_mem))
                ids = pool.offload(src, blocks)
                t, t_mem = side_by_side(lambda: pool.onload(dst, ids, blocks),
                                        memcpy(nbytes), setup.repeat)
                rows.append(row("onload", pool.layout.name, name, "1 -> 1", label, nbytes,
                                regions, None, t, None, None, t_mem))
                pool.free(ids)
            del src, dst, pool
            if rig is not None:
                for label, (regions, descr, t, t_one, t_mem) in rig.measure(
                        lay, plans, setup.repeat, memcpy).items():
                    rows.append(row("NIXL pull", name, name, "1 -> 1", label, nbytes,
                                    regions, descr, t, one, t_one, t_mem))
            say("  " + ", ".join(f"{r['pair']}/{r['blocks'][:4]} {r['regions']} regions "
                                 f"{r['memcpy_s'] / r['s']:.2f}x memcpy" for r in rows[done:]))
            done = len(rows)
        for a, b, bs in RELAYOUTS:
            say(f"relayout {a}/16 -> {b}/{bs}, local and pulled, against the same-layout move")
            a_l = _layout(a, setup)
            b_l = _layout(b, setup, block_size=bs, num_blocks=setup.tokens // bs)
            t = time.perf_counter()
            plan = plan_block_transfer(a_l, b_l, sets["contiguous"], np.arange(setup.tokens // bs))
            say(f"  planned in {(time.perf_counter() - t) * 1e3:.1f} ms (regions built only "
                "where asked)")
            same = plan_block_transfer(a_l, a_l, sets["contiguous"], sets["contiguous"])
            src, dst = _filled(a_l), KVCache.allocate(b_l, "numpy")
            sdst = KVCache.allocate(a_l, "numpy")
            t, t_same, t_mem = alternate([lambda: execute(plan, src, dst),
                                          lambda: execute(same, src, sdst),
                                          memcpy(nbytes)], setup.repeat)
            regions = _regions(plan)
            rows.append(row("local copy", _name(a_l), _name(b_l), "1 -> 1", "contiguous",
                            nbytes, regions, None, t, "same layout", t_same, t_mem))
            del src, dst, sdst
            if rig is not None:
                x = rig.measure_pair(a_l, b_l, plan, same, setup.repeat, memcpy)
                rows.append(row("NIXL pull", _name(a_l), _name(b_l), "1 -> 1", "contiguous",
                                nbytes, regions, x["descriptors"], x["relayout_s"],
                                "same layout", x["same_layout_s"], x["memcpy_s"]))
                fig.setdefault("relayout_pulls", {})[f"{_name(a_l)} -> {_name(b_l)}"] = x
        if rig is not None:
            # the bounds check of a post with many regions (a token-level relayout)
            a_l = _layout("flashinfer.HND", setup)
            b_l = _layout("tpu.combined", setup, block_size=64, num_blocks=setup.tokens // 64)
            toks = np.random.default_rng(1).permutation(setup.blocks * SPEC.block_size)
            tplan = plan_transfer(a_l, b_l, toks + (setup.num_blocks - setup.blocks)
                                  * SPEC.block_size, np.arange(toks.size))
            sizes = np.full(a_l.num_planes, a_l.plane_nbytes, np.int64)
            fig["post_check"] = {"regions": len(tplan), "check_s": _best(
                lambda: tplan.check(src_nbytes=sizes), setup.repeat)}
        say("torch planes against numpy planes, same plans")
        fig["torch_vs_numpy"] = torch_vs_numpy(setup, sets)
    finally:
        if rig is not None:
            rig.close()
    return {"setup": info, "table": rows + table, "figures": fig}


def torch_vs_numpy(setup: Setup, sets) -> dict:
    """{plan: (torch seconds, numpy seconds)} executing the same plan between torch planes
    and between numpy planes (each from ``KVCache.allocate``), timed alternately."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {}
    out = {}
    a_l = _layout(PER_LAYER, setup)
    b_l = _layout("tpu.combined", setup, block_size=64, num_blocks=setup.tokens // 64)
    c_l = _layout(CROSS, setup)
    sc = sets["scattered"]
    cases = {f"{PER_LAYER} scattered": (a_l, a_l, plan_block_transfer(a_l, a_l, sc, sc[::-1])),
             f"{CROSS} scattered": (c_l, c_l, plan_block_transfer(c_l, c_l, sc, sc[::-1])),
             "relayout": (a_l, b_l, plan_block_transfer(a_l, b_l, sets["contiguous"],
                                                        np.arange(setup.tokens // 64)))}
    for name, (x, y, plan) in cases.items():
        ts, td = KVCache.allocate(x, "torch", fill=1), KVCache.allocate(y, "torch")
        ns, nd = KVCache.allocate(x, "numpy", fill=1), KVCache.allocate(y, "numpy")
        out[name] = side_by_side(lambda: execute(plan, ts, td),
                                 lambda: execute(plan, ns, nd), setup.repeat)
    # The same cross-layer plan with torch planes over numpy-allocated memory: what is left
    # of the gap above is the memory (numpy asks for transparent huge pages, torch's CPU
    # allocator does not), not the copy path.
    x, _, plan = cases[f"{CROSS} scattered"]
    ns, nd = KVCache.allocate(x, "numpy", fill=1), KVCache.allocate(x, "numpy")
    ts, td = (KVCache.wrap(x, [_torch_over(p) for p in c]) for c in (
        KVCache.allocate(x, "numpy", fill=1), KVCache.allocate(x, "numpy")))
    out[f"{CROSS} scattered, torch planes over numpy memory"] = side_by_side(
        lambda: execute(plan, ts, td), lambda: execute(plan, ns, nd), setup.repeat)
    return out


def _torch_over(plane):
    """A torch tensor over the memory of numpy ``plane`` (same shape, strides, bytes)."""
    import torch

    from ..util.tensors import torch_dtype

    isz = plane.dtype.itemsize
    return torch.from_numpy(plane.view(np.dtype(f"i{isz}"))).view(torch_dtype(SPEC.dtype))


def from_lengths_lists(repeat: int, requests: int = 1024) -> tuple[float, float]:
    """(seconds of ``from_lengths`` given Python lists, seconds of ``np.asarray`` of the
    same lists plus ``from_lengths`` of the arrays) at ``requests`` requests, decode-like
    (1-3 new tokens, contexts up to 2,000, 128 block ids per row), timed alternately."""
    from ..step.metadata import CommonAttentionMetadata

    rng = np.random.default_rng(2)
    q = rng.integers(1, 4, requests).tolist()
    c = rng.integers(0, 2000, requests).tolist()
    bt = rng.integers(0, 1 << 20, (requests, 128)).tolist()
    build = CommonAttentionMetadata.from_lengths
    return side_by_side(
        lambda: build(q, c, bt, 16),
        lambda: build(np.asarray(q), np.asarray(c), np.asarray(bt), 16), max(repeat, 10))


# -- goals -----------------------------------------------------------------------------------
def _x_memcpy(r) -> float:
    """A row's speed as a multiple of its side-by-side memcpy."""
    return r["memcpy_s"] / r["s"]


def _x_ref(r) -> float:
    return r["ref_s"] / r["s"]


def _pull_goals(rows) -> list[tuple[str, bool | None, str]]:
    """Every relayout pull (another layout, block size or TP size) >= 0.9x the pull of the
    same bytes between equal ones, timed alternately."""
    pulls = [r for r in rows if r["pair"] == "NIXL pull" and r["ref"] is not None
             and r["ref"] != "1-region READ"]
    out = [(f"relayout pull >= 0.9x the {r['ref']} pull of the same bytes ({r['src']} -> "
            f"{r['dst']}, TP {r['tp']})", _x_ref(r) >= 0.9,
            f"{_x_ref(r):.2f}x ({r['descriptors']} descriptors, "
            f"{r['regions']} regions)") for r in pulls]
    return out or [("relayout pulls >= 0.9x a same-layout pull of the same bytes", None,
                    "not measured (no nixl)")]


def goals(result: dict, tp_only: bool = False) -> list[tuple[str, bool | None, str]]:
    """(goal, met (None: not measured, or a figure without a threshold), figures) for the
    issues' targets, each judged on figures timed side by side (a row against its own
    interleaved references); ``tp_only``: those of a ``--tp-only`` run."""
    rows = result["table"]
    out = []
    if tp_only:
        return _pull_goals(rows) + transfer_tp.goals(result.get("figures", {}))
    for blocks in ("contiguous", "scattered"):
        c = find(rows, "local copy", CROSS, blocks)
        p = find(rows, "local copy", PER_LAYER, blocks)
        if c and p:
            ratio = p["regions"] / c["regions"]
            out.append((f"cross-layer >= 32x fewer regions than per-layer ({blocks})",
                        ratio >= 32, f"{p['regions']} / {c['regions']} = {ratio:.1f}x"))
    # cross-layer presets: a run of blocks is one region for all layers
    cross = {r["src"] for r in rows if r["pair"] == "local copy" and r["ref"] is None
             and r["blocks"] == "contiguous" and r["regions"] == 1}
    for r in rows:
        if r["pair"] == "local copy" and r["ref"] is None and r["src"] in cross | {PER_LAYER}:
            out.append((f"local execute >= 0.9x memcpy ({r['src']}, {r['blocks']})",
                        _x_memcpy(r) >= 0.9, f"{_x_memcpy(r):.2f}x"))
    for blocks in ("contiguous", "scattered"):
        c = find(rows, "NIXL pull", CROSS, blocks, dst=CROSS)
        p = find(rows, "NIXL pull", PER_LAYER, blocks, dst=PER_LAYER)
        if not (c and p):
            out.append((f"NIXL goals ({blocks})", None, "not measured (no nixl)"))
            continue
        # Each against its own one-region READ: the load may change between the two rows.
        f = _x_ref(c) / _x_ref(p)
        out.append((f"NIXL cross-layer >= 1.5x per-layer GB/s ({blocks})", f >= 1.5,
                    f"{_x_ref(c):.2f}x vs {_x_ref(p):.2f}x of one READ = {f:.2f}x"))
        out.append((f"NIXL cross-layer >= 0.7x one single-region READ ({blocks})",
                    _x_ref(c) >= 0.7, f"{_x_ref(c):.2f}x"))
    r = find(rows, "local copy", "flashinfer.HND/16", dst="tpu.combined/64")
    if r:
        out.append(("relayout >= 0.3x memcpy", _x_memcpy(r) >= 0.3, f"{_x_memcpy(r):.2f}x"))
    out += _pull_goals(rows)
    fig = result.get("figures", {})
    x = fig.get("post_check")
    if x:
        per = x["check_s"] / x["regions"] * 1e9
        out.append(("NIXL post bounds check: cost proportional to the regions", None,
                    f"{x['check_s'] * 1e3:.2f} ms for {x['regions']} regions = "
                    f"{per:.1f} ns per region"))
    for name, (t_torch, t_np) in fig.get("torch_vs_numpy", {}).items():
        out.append((f"torch execute >= 0.9x numpy ({name})", t_np / t_torch >= 0.9,
                    f"{t_torch * 1e3:.1f} vs {t_np * 1e3:.1f} ms = {t_np / t_torch:.2f}x"))
    x = fig.get("from_lengths")
    if x:
        out.append(("from_lengths of lists <= 1.5x (np.asarray + numpy path)",
                    x[0] / x[1] <= 1.5,
                    f"{x[0] * 1e6:.0f} vs {x[1] * 1e6:.0f} us = {x[0] / x[1]:.2f}x"))
    return out + transfer_tp.goals(fig)


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvabi bench transfer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (4 layers, 256 tokens, one timed run): checks the suite")
    p.add_argument("--no-nixl", action="store_true", help="skip the NIXL rows")
    p.add_argument("--presets", default=None,
                   help="comma-separated presets (default: every preset that holds the "
                        "bench's bfloat16 spec); the tensor-parallel pulls use those of "
                        + ", ".join(transfer_tp.PRESETS) + " among them (the first, if none)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per figure (best kept)")
    p.add_argument("--tp-only", action="store_true",
                   help="only the tensor-parallel figures: heterogeneous-TP pulls against "
                        "same-TP pulls of the same bytes, negotiation + handshake cost")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: must be >= 1, got {args.repeat}")
    setup = Setup(layers=4, tokens=256, repeat=1) if args.quick else Setup(repeat=args.repeat)
    presets = preset_names(SPEC) if args.presets is None else tuple(args.presets.split(","))
    unknown = [x for x in presets if x not in PRESETS]
    if unknown:
        p.error(f"--presets: unknown preset {unknown[0]!r}; presets are {', '.join(PRESETS)}")

    def progress(msg):
        print(msg, file=sys.stderr, flush=True)

    result = measure(setup, presets=presets, nixl=not args.no_nixl, progress=progress,
                     tp_only=args.tp_only)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{setup.layers} layers, {SPEC.num_kv_heads} KV heads x {SPEC.head_dim} {SPEC.dtype}, "
          f"block {SPEC.block_size}; one {setup.tokens}-token request = {setup.blocks} blocks "
          f"({setup.layers * setup.tokens * 4096 / 2**20:.0f} MiB).  Every row timed "
          "alternately with its reference and a memcpy of the same bytes (best of "
          f"{setup.repeat}); x ref, x memcpy: their time over the row's.")
    print(format_table(result["table"]))
    print("goals (figures from a shared or loaded machine vary; ratios are timed side by "
          "side):")
    for goal, _, figures in goals(result, tp_only=args.tp_only):
        print(f"  goal      {goal}\n  measured  {figures}")
    return 0
