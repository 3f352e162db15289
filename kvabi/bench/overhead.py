"""``kvabi bench overhead``: what kvabi costs per layer and per step, per backend.

A 1-token decode over 16 cached tokens, 32 query heads over 8 KV heads of 128, block 16,
on a 32-layer cross-layer cache (``vllm.BLHNC`` where the backend takes it, else its first
preferred layout): the compute is negligible, so the figures are dispatch.  Per backend:

- ``layer_us``: ``write_kv`` + ``attention`` of one layer (a step over every layer, divided
  by the layers; jax results are waited for once per step), median and min over steps,
  and the process's CPU time per layer (``layer_cpu_us``: unaffected by other processes
  on a shared machine; threads of the framework included);
- ``plan_us``: one ``plan`` (once per step and KV group);
- ``view_lookup_us`` / ``layout_view_us``: a layer's cache view from the KVCache handle
  (``cache.kv_view``; ``layer_view`` for jax) vs recomputed by the layout;
- ``boundary_us``: the checks :class:`kvabi.Backend` runs around one layer's ``write_kv``
  and ``attention`` (the same calls, with the backend's ``write`` and ``attend`` replaced
  by ones that return at once); ``plan_checks_us``: those of one ``plan`` (``prepare``
  replaced likewise; ``check_step_us`` is the step check alone); ``checks_pct`` is their
  cost per layer (``boundary_us`` plus ``plan_checks_us`` spread over the layers) as a
  percentage of ``layer_us``.

Only public ABI calls are used.  Interpreted backends (Triton interpreter, Pallas interpret
mode) are slow: pick them with ``--backends`` and lower ``--repeat``.  Progress goes to
stderr.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from ..memory.cache import KVCache
from ..model.spec import KVSpec
from ..step.checks import check_step
from ..step.metadata import CommonAttentionMetadata
from ..util.errors import KVABIError
from ..util.tensors import framework
from .transforms import median_us

NUM_LAYERS = 32
NUM_BLOCKS = 64
CONTEXT = 16
Q_HEADS = 32
LAYOUT = "vllm.BLHNC"
#: the issue's goals, printed beside the figures (no figure here is asserted)
GOALS = {"reference_layer_us": 150.0, "view_lookup_us": 5.0, "checks_pct": 5.0}
DTYPE_PREFERENCE = ("float32", "bfloat16", "float16")


def _spec(backend) -> KVSpec | None:
    """The benchmark spec in the first dtype the backend supports (None: none of them)."""
    for dt in DTYPE_PREFERENCE:
        spec = KVSpec(kind="full", block_size=16, num_kv_heads=8, head_dim=128, dtype=dt)
        try:
            backend.check_supported(spec)
        except KVABIError:
            continue
        return spec
    return None


def _layout(backend, spec):
    """(layout, why): vllm.BLHNC when the backend plans and allocates it, else the first
    preferred layout it does."""
    from ..layout.descriptor import Layout

    names = [LAYOUT] + [n for n in backend.preferred_layouts(spec) if n != LAYOUT]
    meta = _meta()
    last = ""
    for name in names:
        try:
            layout = Layout.preset(name, spec, NUM_BLOCKS, NUM_LAYERS)
            backend.plan(meta, spec, layout, num_q_heads=Q_HEADS)
            backend.allocate(layout)
        except Exception as e:  # noqa: BLE001 - a foreign backend may refuse in its own way
            last = f"{name}: {type(e).__name__}: {e}"
            continue
        return layout, "" if name == LAYOUT else f"{LAYOUT} refused; {last}"
    raise KVABIError(f"layout: no layout usable ({last})")


def _meta() -> CommonAttentionMetadata:
    need = -(-(CONTEXT + 1) // 16)
    return CommonAttentionMetadata.from_lengths([1], [CONTEXT], [list(range(3, 3 + need))],
                                                16, num_blocks=NUM_BLOCKS)


def _sync(x) -> None:
    """Wait for asynchronous frameworks (jax dispatch, CUDA streams)."""
    if isinstance(x, tuple):
        x = x[0]
    if hasattr(x, "block_until_ready"):
        x.block_until_ready()
    elif framework(x) == "torch" and getattr(x, "is_cuda", False):
        import torch

        torch.cuda.synchronize()


def measure(backend, *, repeat: int, layers: int = NUM_LAYERS, log=None) -> dict:
    """The figures of one backend (see the module docstring)."""
    from ..util import tensors

    log = log or (lambda msg: None)
    row = {"backend": backend.name, "abi": ".".join(map(str, backend.abi_version)),
           "framework": getattr(backend, "framework", "numpy")}
    spec = _spec(backend)
    if spec is None:
        row["skipped"] = f"supports none of {', '.join(DTYPE_PREFERENCE)} for the spec"
        return row
    layout, why = _layout(backend, spec)
    row.update(dtype=spec.dtype, layout=layout.name, layout_note=why)
    meta = _meta()
    fw, dev = row["framework"], backend.device()
    rng = np.random.default_rng(0)
    from ..util.dtypes import numpy_dtype

    def arr(shape):
        a = rng.standard_normal(shape).astype(np.float32).astype(numpy_dtype(spec.dtype))
        return tensors.convert(a, fw, device=dev)

    key, value = arr((1, 8, 128)), arr((1, 8, 128))
    query = arr((1, Q_HEADS, 128))
    plan = backend.plan(meta, spec, layout, num_q_heads=Q_HEADS)
    cache = backend.allocate(layout)

    def step():
        nonlocal cache
        out = None
        for layer in range(layers):
            cache = backend.write_kv(plan, cache, key=key, value=value, layer=layer)
            out = backend.attention(plan, cache, query=query, layer=layer)
        _sync(out)

    log(f"{backend.name}: {layout.name} {spec.dtype}, warm-up step ({layers} layers)")
    step()
    times, cpu = [], []
    for i in range(repeat):
        log(f"{backend.name}: step {i + 1}/{repeat}")
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    row["layer_us"] = statistics.median(times) / layers * 1e6
    row["layer_us_min"] = min(times) / layers * 1e6  # the least disturbed step (shared CPUs)
    # CPU time of this process (all its threads): what dispatch costs, whatever else the
    # machine is running
    row["layer_cpu_us"] = statistics.median(cpu) / layers * 1e6
    fast = repeat >= 5
    runs, secs = (20, 0.2) if fast else (3, 0.0)
    log(f"{backend.name}: plan, views, boundary checks")
    row["plan_us"] = median_us(lambda: backend.plan(meta, spec, layout, num_q_heads=Q_HEADS),
                               min_runs=runs, min_seconds=secs)
    handle = cache
    planes = list(handle)
    if handle.framework == "jax":
        row["view"] = "layer_view"
        handle.layer_view(1)
        row["view_lookup_us"] = median_us(lambda: handle.layer_view(1), min_runs=runs * 10,
                                          min_seconds=secs)
        row["layout_view_us"] = median_us(lambda: KVCache.wrap(layout, planes).layer_view(1),
                                          min_runs=runs, min_seconds=secs)
    else:
        row["view"] = "kv_view"
        handle.kv_view(1, 0)
        row["view_lookup_us"] = median_us(lambda: handle.kv_view(1, 0), min_runs=runs * 10,
                                          min_seconds=secs)
        row["layout_view_us"] = median_us(lambda: KVCache.wrap(layout, planes).kv_view(1, 0),
                                          min_runs=runs, min_seconds=secs)
    row["check_step_us"] = median_us(lambda: check_step(meta, spec, layout),
                                     min_runs=runs * 10, min_seconds=secs)
    row["boundary_us"], row["plan_checks_us"] = _boundary(
        backend, plan, handle, key, value, query, meta, spec, layout, runs * 10, secs)
    per_layer = row["boundary_us"] + row["plan_checks_us"] / NUM_LAYERS
    row["checks_pct"] = 100.0 * per_layer / row["layer_us"]
    return row


def _boundary(backend, plan, cache, key, value, query, meta, spec, layout, runs, secs):
    """(checks around one layer's write_kv + attention, checks of one plan) in us: the
    public calls with the backend's own methods replaced, on this instance only, by ones
    that return at once."""
    glue = {"prepare": lambda **kw: None,
            "write": lambda **kw: kw["cache"],
            "attend": lambda **kw: (kw["query"], None)}
    saved = {n: backend.__dict__[n] for n in glue if n in backend.__dict__}
    backend.__dict__.update(glue)
    try:
        def layer():
            backend.write_kv(plan, cache, key=key, value=value, layer=1)
            backend.attention(plan, cache, query=query, layer=1)

        per_layer = median_us(layer, min_runs=runs, min_seconds=secs)
        per_plan = median_us(lambda: backend.plan(meta, spec, layout, num_q_heads=Q_HEADS),
                             min_runs=runs, min_seconds=secs)
    finally:
        for n in glue:
            backend.__dict__.pop(n, None)
        backend.__dict__.update(saved)
    return per_layer, per_plan


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def run(argv=None) -> int:
    """Entry point of ``kvabi bench overhead [--json] [--backends A,B] [--repeat N]``."""
    p = argparse.ArgumentParser(prog="kvabi bench overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--backends", type=_names, default=None,
                   help="comma-separated backend names (default: every available one)")
    p.add_argument("--repeat", type=int, default=10,
                   help="timed steps of every layer per backend (default 10)")
    p.add_argument("--layers", type=int, default=NUM_LAYERS,
                   help=f"layers per timed step (default {NUM_LAYERS}; the cache always "
                        f"has {NUM_LAYERS})")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error(f"--repeat: must be >= 1, got {a.repeat}")
    if not 1 <= a.layers <= NUM_LAYERS:
        p.error(f"--layers: must be in [1, {NUM_LAYERS}], got {a.layers}")
    from ..backend import registry

    found = {b.name: b for b in registry.all_backends()}
    names = a.backends if a.backends is not None else sorted(found)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise KVABIError(f"--backends: unknown backend(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(found))}")

    def log(msg):
        if not a.quiet:
            print(f"overhead: {msg}", file=sys.stderr, flush=True)

    rows = []
    for name in names:
        b = found[name]
        ok, why = b.available()
        if not ok:
            rows.append({"backend": name, "skipped": f"unavailable: {why}"})
            log(f"{name}: skipped (unavailable: {why})")
            continue
        try:
            rows.append(measure(b, repeat=a.repeat, layers=a.layers, log=log))
        except Exception as e:  # noqa: BLE001 - report a failing backend, go on
            rows.append({"backend": name, "skipped": f"failed: {type(e).__name__}: {e}"})
            log(f"{name}: failed: {type(e).__name__}: {e}")
    doc = {"suite": "overhead", "unit": "us", "statistic": "median",
           "case": {"layers": NUM_LAYERS, "decode_tokens": 1, "context": CONTEXT,
                    "q_heads": Q_HEADS, "kv_heads": 8, "head_dim": 128, "block_size": 16},
           "goals": GOALS, "results": rows}
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    _table(doc)
    return 0


def _table(doc) -> None:
    c = doc["case"]
    print(f"1-token decode over {c['context']} cached tokens, {c['q_heads']} query heads / "
          f"{c['kv_heads']} KV heads x {c['head_dim']}, {c['layers']}-layer cache "
          f"(median us)")
    cols = [("backend", "backend", "{}"), ("layout", "layout", "{}"), ("dtype", "dtype", "{}"),
            ("layer_us", "write+attn/layer", "{:.1f}"), ("layer_us_min", "(min)", "{:.1f}"),
            ("layer_cpu_us", "(cpu)", "{:.1f}"),
            ("plan_us", "plan", "{:.1f}"),
            ("view_lookup_us", "view lookup", "{:.2f}"),
            ("layout_view_us", "layout view", "{:.1f}"),
            ("boundary_us", "checks/layer", "{:.2f}"), ("plan_checks_us", "checks/plan", "{:.1f}"),
            ("check_step_us", "check_step", "{:.1f}"), ("checks_pct", "checks %", "{:.2f}")]
    cells = [[h for _, h, _ in cols]]
    cells += [[f.format(r[k]) for k, _, f in cols] for r in doc["results"]
              if "skipped" not in r]
    width = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(s.ljust(w) for s, w in zip(row, width)).rstrip())
    for r in doc["results"]:
        if "skipped" in r:
            print(f"skipped: {r['backend']}: {r['skipped']}")
    g = doc["goals"]
    ref = next((r for r in doc["results"] if r.get("backend") == "reference"
                and "layer_us" in r), None)
    # goal and measured side by side, no verdict words: on a loaded machine a figure past
    # its goal says "slow here", not "broken"
    if ref is not None:
        print(f"reference write_kv + attention per layer: goal <= "
              f"{g['reference_layer_us']:.0f} us; measured median {ref['layer_us']:.1f} us, "
              f"min {ref['layer_us_min']:.1f} us, process CPU {ref['layer_cpu_us']:.1f} us")
    for r in doc["results"]:
        if "checks_pct" in r:
            print(f"{r['backend']}: boundary checks: goal <= {g['checks_pct']:.0f}% of "
                  f"write_kv + attention; measured {r['checks_pct']:.2f}%. view lookup: goal "
                  f"<= {g['view_lookup_us']:.0f} us; measured {r['view_lookup_us']:.2f} us")
        if r.get("layout_note"):
            print(f"note: {r['backend']}: {r['layout_note']}")
