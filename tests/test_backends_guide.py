"""The backend author's guide (docs/backends.md) runs as written: every ```python block, in
order, in one namespace; then what it shows is checked against direct computations."""
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parents[1]
GUIDE = ROOT / "docs" / "backends.md"


def test_guide_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    ns = {}
    code = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.S | re.M)
    assert len(code) >= 5
    for i, block in enumerate(code):
        exec(compile(block, f"{GUIDE.name} block {i + 1}", "exec"), ns)
    # the example's int8 write, decoded by hand: code * scale is the input to within half a
    # step, and the scale is the row's absmax / 127 (the floor does not bite here)
    x, cache = ns["x"], ns["cache"]
    codes = cache.kv_view(0, 0)[2, :3].numpy().astype(np.float64)
    scale = cache.component_view(0, "key_scale")[2, :3].numpy().astype(np.float64)
    assert np.allclose(scale[..., 0], np.abs(x).max(-1) / 127, rtol=1e-6)
    assert np.abs(codes * scale - x).max() <= scale.max() / 2 * (1 + 1e-6)
    assert ns["res"].examples == 1 and not ns["res"].coverage.not_drawn
    assert ns["TestMine"].backend_name == "example.torch_quant"
    # the guide's printed outputs are what the code gives
    text = GUIDE.read_text()
    caps = ns["caps"]
    assert f"# {caps.dtypes} {caps.quant} {caps.roundings}" in text
    assert f"# {ns['quant'].refusals(ns['kvabi'].KVSpec('full', 16, 2, 64, dtype='bfloat16'))}" \
        in text
