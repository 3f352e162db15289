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
