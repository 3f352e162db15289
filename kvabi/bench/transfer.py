"""``kvabi bench transfer``: moving one request's KV, per preset layout, on a
Llama-3-8B-like KV group (32 layers, 8 KV heads x 128, bfloat16, block 16; a 2048-token
request = 128 blocks, as one run of blocks and scattered).

For each preset: regions per transfer and GB/s of a local ``execute`` (cache to cache), of a
NIXL READ between two processes (UCX on loopback; skipped without nixl), and of host
offload/onload through a ``HostPool``; and relayout rows (``flashinfer.HND`` block 16 ->
``tpu.combined`` block 64; vLLM's CPU cache ``vllm.cpu`` block 16 -> its cross-layer
``vllm.cpu.BLHNC`` block 64, keys ``[D, N]`` and values ``[N, D]`` per block-head).  Each
figure is timed alternately with its reference, the same bytes moved by one ``memcpy`` (for
NIXL rows: by one single-region READ), so that the ratios hold while the machine's load
changes.  Then: staged NIXL relayout pulls (both relayouts) against a same-layout pull of
the same tokens, the bounds check of a post, torch planes against numpy planes on the same
plans, and ``from_lengths`` of Python lists.  Each goal is printed as a "goal" line and a
"measured" line.
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

SPEC = KVSpec(kind="full", block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NUM_LAYERS = 32
TOKENS = 2048
CROSS = "kvbm.fully_contiguous"  # the cross-layer preset the goals compare
PER_LAYER = "flashinfer.HND"  # the per-layer preset the goals compare


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


def side_by_side(op, ref, repeat: int) -> tuple[float, float]:
    """Best seconds of ``op`` and of ``ref``, timed alternately (after one warm-up call of
    each) so that both see the same machine load."""
    op()
    ref()
    best_op = best_ref = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        op()
        best_op = min(best_op, time.perf_counter() - t)
        t = time.perf_counter()
        ref()
        best_ref = min(best_ref, time.perf_counter() - t)
    return best_op, best_ref


def _best(op, repeat: int) -> float:
    op()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - t)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


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

    def measure(self, src_layout, dst_layout, plans, repeat) -> dict:
        """{label: (regions, GB/s, GB/s of one READ of the same bytes)} pulling each plan
        from a cache of ``src_layout`` served by the other process."""
        message = self._ask("alloc", src_layout.to_json(), "src")
        dst = self.agent.register(KVCache.allocate(dst_layout, "numpy"))
        try:
            peer = self.agent.connect(message, timeout=30)
            flat = self.agent.connect(self.flat_message, timeout=30)
            out = {}
            for label, plan in plans.items():
                one = TransferPlan(np.array([[0, 0, 0, 0, plan.nbytes]], np.int64),
                                   flat.layout, self.flat)
                t, t_one = side_by_side(
                    lambda: self.agent.pull_plan(peer, plan, dst, timeout=120),
                    lambda: self.agent.pull_plan(flat, one, self.flat_dst, timeout=120),
                    repeat)
                out[label] = (len(plan), gbps(plan.nbytes, t), gbps(plan.nbytes, t_one))
            return out
        finally:
            self.agent.deregister(dst)
            self._ask("free", "src")

    def measure_pair(self, src_layout, dst_layout, plan, same_plan, repeat) -> dict:
        """A relayout pull of ``plan`` (staged, the default) and a same-layout pull of the
        same tokens (``same_plan``, ``src_layout`` to ``src_layout``), timed alternately;
        also the bounds check each post makes, timed alone."""
        message = self._ask("alloc", src_layout.to_json(), "src")
        dst = self.agent.register(KVCache.allocate(dst_layout, "numpy"))
        same = self.agent.register(KVCache.allocate(src_layout, "numpy"))
        try:
            peer = self.agent.connect(message, timeout=30)
            t, t_same = side_by_side(
                lambda: self.agent.pull_plan(peer, plan, dst, timeout=120),
                lambda: self.agent.pull_plan(peer, same_plan, same, timeout=120), repeat)
            sizes = peer.handshake.plane_nbytes
            check = _best(lambda: plan.check(src_nbytes=sizes), repeat)
            return {"relayout_s": t, "same_layout_s": t_same, "check_s": check,
                    "regions": len(plan), "nbytes": plan.nbytes}
        finally:
            self.agent.deregister(dst)
            self.agent.deregister(same)
            self._ask("free", "src")

# -- the run -------------------------------------------------------------------------------
#: vLLM's CPU cache relayouted to its cross-layer form with a larger block
CPU_FROM, CPU_TO, CPU_TO_BLOCK = "vllm.cpu", "vllm.cpu.BLHNC", 64


def measure(setup: Setup, *, presets=None, nixl: bool = True, progress=None,
            tp_only: bool = False) -> dict:
    """Rows ``{src, dst, blocks, executor, regions, gbps, ref_gbps}``: ``ref_gbps`` is the
    reference timed alternately with the row (a memcpy of the same bytes; for NIXL rows one
    single-region READ of the same bytes).  Top level: the best memcpy and one-region READ
    seen.  ``figures`` holds the other figures, the tensor-parallel ones
    (:mod:`kvabi.bench.transfer_tp`) included; ``tp_only``: those alone."""
    say = progress or (lambda msg: None)
    presets = preset_names(SPEC) if presets is None else presets
    sets = block_sets(setup)
    if nixl:
        from ..transfer.nixl import available

        ok, why = available()
        if not ok:
            say(f"NIXL rows skipped: {why}")
            nixl = False
    tp_presets = [x for x in presets if x in transfer_tp.PRESETS] or transfer_tp.PRESETS[:1]
    tp = transfer_tp.measure(setup, SPEC, sets, side_by_side, nixl=nixl, say=say,
                             presets=tp_presets)
    if tp_only:
        return {"memcpy_gbps": None, "nixl_single_gbps": None, "rows": [], "figures": tp}
    nbytes = setup.layers * setup.tokens * 2 * SPEC.num_kv_heads * SPEC.head_dim * 2
    ma, mb = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

    def memcpy():
        np.copyto(mb, ma)

    rows = []
    extra = {}
    # first, before the large buffers and the NIXL agent's threads (with an agent alive
    # the list path measured ~3x slower, the array path unchanged): a Python-heavy figure
    say("from_lengths of Python lists against np.asarray + the numpy path")
    extra["from_lengths"] = from_lengths_lists(setup.repeat)
    rig = NixlRig(setup) if nixl else None

    def add(src, dst, blocks, executor, regions, t, t_ref):
        rows.append(dict(src=src, dst=dst, blocks=blocks, executor=executor, regions=regions,
                         gbps=gbps(nbytes, t), ref_gbps=gbps(nbytes, t_ref)))

    def add_nixl(src, dst, got):
        for label, (regions, g, g_one) in got.items():
            rows.append(dict(src=src, dst=dst, blocks=label, executor="nixl",
                             regions=regions, gbps=g, ref_gbps=g_one))

    try:
        done = 0
        for i, name in enumerate(presets):
            say(f"[{i + 1}/{len(presets)}] {name}")
            lay = _layout(name, setup)
            src, dst = _filled(lay), KVCache.allocate(lay, "numpy")
            plans = {k: plan_block_transfer(lay, lay, v, v) for k, v in sets.items()}
            for label, plan in plans.items():
                add(name, name, label, "local", len(plan),
                    *side_by_side(lambda: execute(plan, src, dst), memcpy, setup.repeat))
            pool = HostPool(lay, setup.blocks)
            for label, blocks in sets.items():
                ids = pool.offload(src, blocks)
                regions = len(plan_block_transfer(lay, pool.layout, blocks, ids))
                pool.free(ids)
                add(name, pool.layout.name, label, "offload", regions, *side_by_side(
                    lambda: pool.free(pool.offload(src, blocks)), memcpy, setup.repeat))
                ids = pool.offload(src, blocks)
                add(pool.layout.name, name, label, "onload", regions, *side_by_side(
                    lambda: pool.onload(dst, ids, blocks), memcpy, setup.repeat))
                pool.free(ids)
            del src, dst, pool
            if rig is not None:
                add_nixl(name, name, rig.measure(lay, lay, plans, setup.repeat))
            say("  " + ", ".join(f"{r['executor']}/{r['blocks'][:4]} {r['regions']} regions "
                                 f"{r['gbps']} GB/s ({r['gbps'] / r['ref_gbps']:.0%})"
                                 for r in rows[done:]))
            done = len(rows)
        say("relayout flashinfer.HND block 16 -> tpu.combined block 64")
        a_l = _layout("flashinfer.HND", setup)
        b_l = _layout("tpu.combined", setup, block_size=64, num_blocks=setup.tokens // 64)
        t = time.perf_counter()
        plan = plan_block_transfer(a_l, b_l, sets["contiguous"], np.arange(setup.tokens // 64))
        say(f"  planned {len(plan)} regions in {(time.perf_counter() - t) * 1e3:.1f} ms")
        src, dst = _filled(a_l), KVCache.allocate(b_l, "numpy")
        add("flashinfer.HND/16", "tpu.combined/64", "contiguous", "local", len(plan),
            *side_by_side(lambda: execute(plan, src, dst), memcpy, setup.repeat))
        del src, dst
        if rig is not None:
            add_nixl("flashinfer.HND/16", "tpu.combined/64",
                     {"contiguous": rig.measure(a_l, b_l, {"x": plan}, setup.repeat)["x"]})
            say("relayout pull (staged) against a same-layout pull of the same tokens")
            same = plan_block_transfer(a_l, a_l, sets["contiguous"], sets["contiguous"])
            extra["nixl_relayout"] = rig.measure_pair(a_l, b_l, plan, same, setup.repeat)
        say(f"relayout {CPU_FROM} block 16 -> {CPU_TO} block {CPU_TO_BLOCK} (vLLM's CPU cache to "
            "cross-layer), local and pulled, against a same-layout pull")
        c_l = _layout(CPU_FROM, setup)
        d_l = _layout(CPU_TO, setup, block_size=CPU_TO_BLOCK,
                      num_blocks=setup.tokens // CPU_TO_BLOCK)
        cplan = plan_block_transfer(c_l, d_l, sets["contiguous"],
                                    np.arange(setup.tokens // CPU_TO_BLOCK))
        src, dst = _filled(c_l), KVCache.allocate(d_l, "numpy")
        add(f"{CPU_FROM}/16", f"{CPU_TO}/{CPU_TO_BLOCK}", "contiguous", "local", len(cplan),
            *side_by_side(lambda: execute(cplan, src, dst), memcpy, setup.repeat))
        del src, dst
        if rig is not None:
            same = plan_block_transfer(c_l, c_l, sets["contiguous"], sets["contiguous"])
            extra["nixl_cpu_relayout"] = rig.measure_pair(c_l, d_l, cplan, same,
                                                          setup.repeat)
            # the bounds check of a post with many regions (a token-level relayout)
            toks = np.random.default_rng(1).permutation(setup.blocks * SPEC.block_size)
            tplan = plan_transfer(a_l, b_l, toks + (setup.num_blocks - setup.blocks)
                                  * SPEC.block_size, np.arange(toks.size))
            sizes = np.full(a_l.num_planes, a_l.plane_nbytes, np.int64)
            extra["post_check"] = {"regions": len(tplan), "check_s": _best(
                lambda: tplan.check(src_nbytes=sizes), setup.repeat)}
        say("torch planes against numpy planes, same plans")
        extra["torch_vs_numpy"] = torch_vs_numpy(setup, sets)
    finally:
        if rig is not None:
            rig.close()
    local = [r["ref_gbps"] for r in rows if r["executor"] != "nixl"]
    one = [r["ref_gbps"] for r in rows if r["executor"] == "nixl"]
    return {"memcpy_gbps": max(local), "nixl_single_gbps": max(one) if one else None,
            "rows": rows, "figures": {**extra, **tp}}


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
def _row(rows, src, executor, blocks, dst=None):
    for r in rows:
        if r["src"] == src and r["executor"] == executor and r["blocks"] == blocks and (
                dst is None or r["dst"] == dst):
            return r
    return None


def _share(r) -> float:
    """A row's GB/s as a fraction of its side-by-side reference."""
    return r["gbps"] / r["ref_gbps"]


def goals(result: dict) -> list[tuple[str, bool | None, str]]:
    """(goal, met (None: not measured, or a figure without a threshold), figures) for the
    issue's targets, each judged on figures timed side by side (a row against its own
    interleaved reference)."""
    rows = result["rows"]
    out = []
    for blocks in ("contiguous", "scattered"):
        c, p = _row(rows, CROSS, "local", blocks), _row(rows, PER_LAYER, "local", blocks)
        if c and p:
            ratio = p["regions"] / c["regions"]
            out.append((f"cross-layer >= 32x fewer regions than per-layer ({blocks})",
                        ratio >= 32, f"{p['regions']} / {c['regions']} = {ratio:.1f}x"))
    for name in (CROSS, PER_LAYER):
        for blocks in ("contiguous", "scattered"):
            r = _row(rows, name, "local", blocks)
            if r:
                out.append((f"local execute >= 90% of memcpy ({name}, {blocks})",
                            _share(r) >= 0.9,
                            f"{r['gbps']} / {r['ref_gbps']} GB/s = {_share(r):.0%}"))
    for blocks in ("contiguous", "scattered"):
        c, p = _row(rows, CROSS, "nixl", blocks), _row(rows, PER_LAYER, "nixl", blocks)
        if not (c and p):
            out.append((f"NIXL goals ({blocks})", None, "not measured (no nixl)"))
            continue
        # Each against its own one-region READ: the load may change between the two rows.
        f = _share(c) / _share(p)
        out.append((f"NIXL cross-layer >= 1.5x per-layer GB/s ({blocks})", f >= 1.5,
                    f"{c['gbps']} vs {p['gbps']} GB/s, {_share(c):.0%} vs {_share(p):.0%} of "
                    f"one READ = {f:.2f}x"))
        out.append((f"NIXL cross-layer >= 70% of one single-region READ ({blocks})",
                    _share(c) >= 0.7, f"{c['gbps']} / {c['ref_gbps']} GB/s = {_share(c):.0%}"))
    r = _row(rows, "flashinfer.HND/16", "local", "contiguous")
    if r:
        out.append(("relayout >= 30% of memcpy", _share(r) >= 0.3,
                    f"{r['gbps']} / {r['ref_gbps']} GB/s = {_share(r):.0%}"))
    fig = result.get("figures", {})
    x = fig.get("nixl_relayout")
    if x:
        share = x["same_layout_s"] / x["relayout_s"]
        out.append(("NIXL relayout pull (staged) >= 50% of a same-layout pull of the same "
                    "tokens", share >= 0.5,
                    f"{gbps(x['nbytes'], x['relayout_s'])} vs "
                    f"{gbps(x['nbytes'], x['same_layout_s'])} GB/s = {share:.0%}"))
    else:
        out.append(("NIXL relayout pull (staged) >= 50% of a same-layout pull", None,
                    "not measured (no nixl)"))
    x = fig.get("nixl_cpu_relayout")
    if x:
        share = x["same_layout_s"] / x["relayout_s"]
        out.append((f"NIXL relayout pull from vLLM's CPU cache ({CPU_FROM} -> cross-layer "
                    f"{CPU_TO}/{CPU_TO_BLOCK}) >= 50% of a same-layout pull", share >= 0.5,
                    f"{gbps(x['nbytes'], x['relayout_s'])} vs "
                    f"{gbps(x['nbytes'], x['same_layout_s'])} GB/s = {share:.0%} "
                    f"({x['regions']} regions)"))
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
          f"({setup.layers * setup.tokens * 4096 / 2**20:.0f} MiB)")
    if result["rows"]:
        print(f"best memcpy of the same bytes: {result['memcpy_gbps']} GB/s; best one-region "
              f"NIXL READ: {result['nixl_single_gbps']} GB/s.  ref = the same bytes timed "
              "alternately with the row (memcpy; for nixl one READ)")
        cols = ["src", "dst", "blocks", "executor", "regions", "gbps", "ref_gbps"]
        width = [max(len(c), *(len(str(r[c])) for r in result["rows"])) for c in cols]
        print("  ".join(c.ljust(w) for c, w in zip(cols, width)) + "  of ref")
        for r in result["rows"]:
            print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, width))
                  + f"  {_share(r):.0%}")
    print("goals (figures from a shared or loaded machine vary; ratios are timed side by "
          "side):")
    marks = transfer_tp.goals(result["figures"]) if args.tp_only else goals(result)
    for goal, _, figures in marks:
        print(f"  goal      {goal}\n  measured  {figures}")
    return 0
