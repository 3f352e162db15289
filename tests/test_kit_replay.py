"""Reproducers: a failure writes a standalone Python file holding the minimal example as
literal arguments (plain lists, no numpy reprs) and the check call; ``python FILE`` fails
while the bug is there and passes once it is fixed."""
from __future__ import annotations

import re
import runpy
import subprocess
import sys

import pytest
from kit_fixtures import planted, subprocess_env  # noqa: F401 - fixture

from kvabi.testing import KitOptions, get_check, run_check
from kvabi.testing.replay import render_reproducer


def reproducer_of(planted, cls, check, tmp_path, **kw):
    res = run_check(get_check(check), cls(), replay=str(tmp_path / "replay"), **kw)
    assert res.failed, res
    assert res.reproducer.startswith(str(tmp_path / "replay"))
    return res


def no_numpy_reprs(text: str) -> None:
    assert not re.search(r"(?<!np\.)array\(", text), "a numpy array repr"
    assert not re.search(r"np\.(int|float|uint)\d+\(", text), "a numpy scalar repr"
    assert "dtype=float32)" not in text and "dtype=int" not in text


def test_reproducer_fails_while_the_bug_exists_and_passes_when_fixed(planted, tmp_path):
    res = reproducer_of(planted, planted.NoWindow, "attention", tmp_path, seed=11)
    text = open(res.reproducer).read()
    no_numpy_reprs(text)
    # The shrunk case as literal constructor calls, with the arrays spelled out.
    assert "kind='sliding_window'" in text and "window=" in text
    assert re.search(r"block_table=\[\[[0-9, ]+\]\]", text)
    assert "'QUERY': np.array([[[" in text and "get_check(CHECK).function(" in text
    assert "FACTORY = 'kvabi_planted:NoWindow'" in text and "seed 11" in text
    # Run as its author would: a fresh interpreter, outside the tree.
    done = subprocess.run([sys.executable, res.reproducer], cwd=tmp_path, capture_output=True,
                          text=True, env=subprocess_env(tmp_path), timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED planted.no_window attention: ConformanceFailure" in done.stdout
    assert "exceeds tolerance" in done.stdout
    # Once the backend is right (here: the reference itself), the same file passes.
    fixed = tmp_path / "fixed.py"
    fixed.write_text(text.replace("BACKEND = 'planted.no_window'", "BACKEND = 'reference'"))
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(fixed), run_name="__main__")
    assert info.value.code == 0


@pytest.mark.parametrize("check", ["write_kv", "kv_sharing", "split_ubatches"])
def test_reproducers_of_other_checks_reproduce(planted, tmp_path, check):
    """Every check's params (extras included: models, cut points) render and replay."""
    res = reproducer_of(planted, planted.WrongSlot, check, tmp_path, seed=3, shrink=False)
    text = open(res.reproducer).read()
    no_numpy_reprs(text)
    compile(text, res.reproducer, "exec")
    with pytest.raises(SystemExit) as info:
        runpy.run_path(res.reproducer, run_name="__main__")
    assert info.value.code == 1


def test_reproducer_keeps_tolerances_and_drops_hypothesis_hints(planted, tmp_path):
    opts = KitOptions(tolerances={"float32": 2e-5})
    res = run_check(get_check("attention"), planted.LseLog2(), options=opts, seed=1,
                    replay=None)
    assert res.failed and res.reproducer == ""  # replay=None: nothing written
    text = render_reproducer(res, planted.LseLog2(), opts)
    assert "OPTIONS = KitOptions(tolerances={'float32': 2e-05})" in text
    for hint in ("reproduce_failure", "Explanation", "@seed"):
        assert hint not in res.example and hint not in text and hint not in res.message
