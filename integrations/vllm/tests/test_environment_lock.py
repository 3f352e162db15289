"""This environment is exactly ``locks/vllm.txt`` (``locks/envlock.py``): drift fails here with
the names and versions, not inside vLLM."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_vllm_environment_is_the_lock():
    spec = importlib.util.spec_from_file_location("envlock", ROOT / "locks" / "envlock.py")
    envlock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envlock)
    diffs = envlock.check(ROOT / "locks" / "vllm.txt")
    assert not diffs, "this environment differs from locks/vllm.txt:\n" + "\n".join(diffs)
