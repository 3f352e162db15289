"""The README's tour runs as written."""
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_readme_tour_runs(monkeypatch):
    text = (ROOT / "README.md").read_text()
    tour = re.search(r"## A taste\n\n```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(ROOT)
    ns = {}
    exec(compile(tour, "README.md", "exec"), ns)
    assert ns["out"].shape == (8, 8, 64) and ns["lse"].shape == (8, 8)
    assert list(ns["rows"]) == [0, 7]


def test_readme_quantized_example_runs(monkeypatch):
    text = (ROOT / "README.md").read_text()
    tour = re.search(r"## A taste\n\n```python\n(.*?)```", text, re.S).group(1)
    quant = re.search(r"Quantized caches \(`specs/semantics.md`.*?```python\n(.*?)```", text,
                      re.S).group(1)
    monkeypatch.chdir(ROOT)
    ns = {}
    exec(compile(tour, "README.md", "exec"), ns)
    exec(compile(quant, "README.md (quantized)", "exec"), ns)
    assert ns["out8"].shape == (8, 8, 64)
    # the codes the write stored, read back times the scales, are close to the input
    import numpy as np
    view = ns["cache8"].kv_view(0, 1)
    assert view.dtype.name == "float8_e4m3fn"
    assert "key_scale" in ns["lay_q"].component_names
    slots = ns["plan8"].meta.slot_mapping
    real = slots >= 0
    k = np.asarray(view[slots[real] // 16, slots[real] % 16], np.float64)
    assert np.allclose(k * np.float32(0.04), np.asarray(ns["v"])[real], rtol=0.07,
                       atol=0.04 * 2 ** -6)


def test_readme_component_layout_runs():
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"state your own in a few lines:\n\n```python\n(.*?)```", text,
                        re.S).group(1)
    ns = {}
    exec(compile("from kvabi import KVSpec, Layout\n" + snippet, "README.md", "exec"), ns)
    assert ns["int8"].component("value_scale").offset == 260


def test_spec_component_layout_runs():
    text = (ROOT / "specs" / "layout.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    ns = {}
    exec(compile(snippet, "layout.md", "exec"), ns)
    assert ns["layout"].element_offset("value_scale", block=3, token=5, head=2) == \
        (0, ((3 * 8 + 2) * 16 + 5) * 264 + 2 * 128 + 4)
