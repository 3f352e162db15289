"""``kv_checksums`` against the formula of ``specs/transfer.md`` (*Checksums*), written out
here in Python integers: per token chunk and global head, the sum mod 2^64 of every
32-bit word of every (layer, K/V, token) record times splitmix64 of its counter, lowest
bit set.  For numpy, torch and jax caches of the same bytes (a jax decode rank checks its
pulls too), for chunks from one token to far more tokens than are summed (a peer states
the chunk: what it costs is the tokens', never the chunk's)."""
from __future__ import annotations

import numpy as np
import pytest

from kvabi import KVCache, KVSpec, Layout
from kvabi.util.tensors import convert
from kvabi.transfer.checksum import kv_checksums
from transfer_oracle import element_bytes

M64 = 2**64 - 1


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def oracle(bufs, layout, slots, layers, chunk):
    """[chunks, heads] sums of the formula, from the bytes the layout addresses."""
    plane, off = element_bytes(layout, layers, slots)  # [L, T, KV, H, D]
    isz = layout.itemsize
    row = layout.size("D") * isz
    words = row // 4
    t = len(slots)
    out = np.zeros((-(-t // chunk), layout.size("H")), dtype=object)
    for li, l in enumerate(layers):
        for i in range(t):
            for kv in range(plane.shape[2]):
                for h in range(layout.size("H")):
                    b = b"".join(bytes(bufs[int(plane[li, i, kv, h, d])][
                        int(off[li, i, kv, h, d]):int(off[li, i, kv, h, d]) + isz])
                        for d in range(layout.size("D")))
                    for j in range(words):
                        word = int.from_bytes(b[4 * j:4 * j + 4], "little")
                        ctr = (((l * 2 + kv) * chunk + i % chunk) * words + j) & M64
                        w = splitmix64(ctr) | 1
                        out[i // chunk, h] = (out[i // chunk, h] + word * w) & M64
    return out.astype(np.uint64)


SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=4, dtype="float32")


@pytest.mark.parametrize("chunk", [1, 3, 16, 2**40, 2**62])
@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("preset", ["flashinfer.HND", "tpu.combined"])
def test_sums_are_the_formula_in_every_framework(preset, framework, chunk):
    if framework != "numpy":
        pytest.importorskip(framework)
    layout = Layout.preset(preset, SPEC, 5, 2)
    rng = np.random.default_rng(7)
    cache = KVCache.allocate(layout, "numpy")
    bufs = []
    for p in cache:
        flat = p.reshape(-1).view(np.uint8)
        flat[:] = rng.integers(0, 256, flat.size, dtype=np.uint8)
        bufs.append(flat)
    slots = np.array([17, 2, 3, 9, 0, 19, 12])
    want = oracle(bufs, layout, slots, [0, 1], chunk)
    planes = [convert(p, framework) for p in cache]
    got = kv_checksums(KVCache.wrap(layout, planes), slots, chunk=chunk)
    assert got.chunk == chunk and got.tokens == len(slots)
    np.testing.assert_array_equal(got.values, want)
