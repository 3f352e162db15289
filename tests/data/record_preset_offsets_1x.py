"""How tests/data/preset_offsets_1x.{npz,json} were made: byte offsets, plane sizes, block regions
and 1.x descriptors of every preset, recorded with the layout code of ABI 1.2 (before
components) from the repository root.  Kept to show what the recording is; not run by the tests."""
import numpy as np, json
from kvabi import KVSpec, Layout
from kvabi.layout.presets import PRESETS, preset_names
out = {}
cases = [("full", "float32", 2, 8, 1), ("full", "float16", 1, 4, 1), ("full", "bfloat16", 2, 6, 1),
         ("full", "int8", 2, 16, 1), ("full", "float16", 2, 8, 96), ("mla", "bfloat16", 1, 12, 1),
         ("full", "float8_e4m3fn", 2, 8, 1)]
L, B, N = 2, 3, 4
meta = {}
for kind, dt, H, D, pa in cases:
    spec = KVSpec(kind=kind, block_size=N, num_kv_heads=H, head_dim=D, dtype=dt, page_align=pa)
    for name in preset_names(spec):
        try:
            lay = Layout.preset(name, spec, B, L)
        except Exception as e:
            meta[f"{name}|{kind}|{dt}|{H}|{D}|{pa}"] = {"error": str(e)}
            continue
        kvn = 2 if lay.has_kv else 1
        g = np.meshgrid(np.arange(L), np.arange(B), np.arange(kvn), np.arange(N), np.arange(H), np.arange(D), indexing="ij")
        l, b, kv, n, h, d = [x.ravel() for x in g]
        p, o = lay.byte_offset(layer=l, block=b, kv=kv, token=n, head=h, dim=d)
        key = f"{name}|{kind}|{dt}|{H}|{D}|{pa}"
        out[key + "|plane"] = np.asarray(p, np.int64)
        out[key + "|offset"] = np.asarray(o, np.int64)
        regs = {str(bl): lay.block_regions(bl) for bl in ([0], [1, 2], [0, 2])}
        regs["layer1"] = lay.block_regions([1, 2], layers=[1])
        meta[key] = {"num_planes": lay.num_planes, "plane_nbytes": lay.plane_nbytes,
                     "regions": regs, "json": lay.to_dict()}
np.savez_compressed("tests/data/preset_offsets_1x.npz", **out)
json.dump(meta, open("tests/data/preset_offsets_1x.json", "w"), indent=0, sort_keys=True)
print(len(out), len(meta))
