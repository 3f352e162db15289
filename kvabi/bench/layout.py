"""``kvabi bench layout``: byte regions per transfer, and the time to compute them, for
every preset on a Llama-3-8B-like KV group (32 layers, 8 KV heads x 128, bfloat16,
block 16).

A transfer (offload, disaggregated prefill) moves a request's blocks; each contiguous byte
region is one descriptor for the transfer engine.  Cross-layer layouts (B outermost) hold a
block of every layer in one range, so a run of blocks becomes one region per plane.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from ..layout.descriptor import Layout
from ..layout.presets import preset_names
from ..model.spec import KVSpec
from .transforms import median_us

SPEC = KVSpec(kind="full", block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NUM_LAYERS = 32
NUM_BLOCKS = 8192


def transfers(num_blocks: int, seed: int) -> dict[str, np.ndarray]:
    """Block id sets of one 2048-token request (128 blocks): one contiguous run, and the
    same count scattered as a busy allocator hands them out."""
    rng = np.random.default_rng(seed)
    return {"run of 128": np.arange(1000, 1128),
            "128 scattered": np.sort(rng.choice(num_blocks, 128, replace=False))}


def measure(seed: int = 0, quick: bool = False) -> list[dict]:
    rows = []
    sets = transfers(NUM_BLOCKS, seed)
    for name in preset_names(SPEC):
        layout = Layout.preset(name, SPEC, NUM_BLOCKS, NUM_LAYERS)
        row = {"layout": name, "planes": layout.num_planes,
               "block_contiguous": layout.is_block_contiguous}
        for label, blocks in sets.items():
            row[f"regions ({label})"] = len(layout.block_regions(blocks))
            row[f"us ({label})"] = round(median_us(
                lambda: layout.block_regions(blocks), min_runs=3 if quick else 20,
                min_seconds=0.0 if quick else 0.2), 1)
        rows.append(row)
    return rows


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvabi bench layout", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p.add_argument("--quick", action="store_true", help="few timing runs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = measure(args.seed, args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cols = list(rows[0])
    width = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print(f"{NUM_LAYERS} layers x {NUM_BLOCKS} blocks, {SPEC.num_kv_heads} KV heads x "
          f"{SPEC.head_dim} {SPEC.dtype}, block {SPEC.block_size}; a 2048-token request = "
          "128 blocks")
    print("  ".join(c.ljust(w) for c, w in zip(cols, width)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, width)))
    return 0
