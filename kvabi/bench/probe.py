"""``kvabi bench probe``: time ``infer_layout`` and ``verify_layout`` on a Llama-3-8B-like
KV group (32 layers, 8 KV heads x 128, bfloat16, block 16) of 256 blocks (the issue's
shape, 512 MiB) and 512 blocks (1 GiB), one plane (vllm.LBHNC) and 64 planes (flash_attn).

The writer is the layout's offset formula (``kvabi.testing.writers``), standing in for an
engine's kernel.  Each row also times one fill of the same planes (a memset) side by side,
so the figures can be read as a ratio on a loaded machine: inference must poison every
byte once and scan it once, so it costs a few memsets at best.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from ..layout.descriptor import Layout
from ..memory.views import allocate_numpy
from ..model.spec import KVSpec

SPEC = KVSpec(kind="full", block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NUM_LAYERS = 32
#: the issue's goals (printed beside the figures; nothing here is asserted)
GOALS = {"infer_s": 2.0, "verify_ms": 50.0}


def _median(fn, runs: int) -> tuple[float, float]:
    """Median wall and process CPU seconds of ``fn()`` (on a shared machine the wall time
    includes waiting for a core; the CPU time is the work done)."""
    wall, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def measure(quick: bool = False, blocks_list=(256, 512), num_layers: int = NUM_LAYERS
            ) -> list[dict]:
    from ..probe import infer_layout, verify_layout
    from ..probe.memory import plane_bytes
    from ..testing.writers import layout_writer

    rows = []
    runs = 1 if quick else 3
    for blocks in blocks_list:
        for name in ("vllm.LBHNC", "flash_attn"):
            layout = Layout.preset(name, SPEC, blocks, num_layers)
            planes = allocate_numpy(layout)
            write = layout_writer(layout, planes)
            mem = plane_bytes(planes)

            def fill():
                for m in mem:
                    m.fill(value=0)

            def infer():
                got = infer_layout(SPEC, planes, write, num_blocks=blocks,
                                   num_layers=num_layers)
                assert got.name == name, got  # a wrong answer must not look fast

            infer()
            memset_s, _ = _median(fill, runs)
            infer_s, infer_cpu = _median(infer, runs)
            verify_s, verify_cpu = _median(lambda: verify_layout(layout, planes, write),
                                           3 if quick else 11)
            rows.append({"layout": name, "blocks": blocks, "planes": layout.num_planes,
                         "mib": layout.total_nbytes >> 20, "infer_s": round(infer_s, 3),
                         "infer_cpu_s": round(infer_cpu, 3), "memset_s": round(memset_s, 3),
                         "infer_per_memset": round(infer_s / memset_s, 1),
                         "verify_ms": round(1e3 * verify_s, 1),
                         "verify_cpu_ms": round(1e3 * verify_cpu, 1)})
            del planes, mem, write
    return rows


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvabi bench probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--quick", action="store_true", help="one timing run each")
    args = p.parse_args(argv)
    rows = measure(args.quick)
    if args.json:
        print(json.dumps({"goals": GOALS, "rows": rows}, indent=1))
        return 0
    print(f"{NUM_LAYERS} layers, {SPEC.num_kv_heads} KV heads x {SPEC.head_dim} "
          f"{SPEC.dtype}, block {SPEC.block_size}; writer: the layout's offset formula")
    cols = list(rows[0])
    w = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(n) for c, n in zip(cols, w)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(n) for c, n in zip(cols, w)))
    for r in rows:
        print(f"goal: infer_layout < {GOALS['infer_s']} s ({r['layout']}, {r['mib']} MiB): "
              f"measured {r['infer_s']} s ({r['infer_cpu_s']} s CPU, "
              f"{r['infer_per_memset']}x one memset); verify_layout < "
              f"{GOALS['verify_ms']:.0f} ms: measured {r['verify_ms']} ms "
              f"({r['verify_cpu_ms']} ms CPU)")
    return 0
