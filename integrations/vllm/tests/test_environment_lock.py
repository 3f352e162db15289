"""This environment is exactly ``locks/vllm.txt`` (``locks/envlock.py``): drift fails here with
the names and versions, not inside vLLM.

Checked in a fresh interpreter: importing vLLM imports setuptools, which puts its vendored
packages (typing_extensions 4.12.2, jaraco.*, ...) on ``sys.path``, where an in-process
check would count them as installed."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_vllm_environment_is_the_lock():
    r = subprocess.run([sys.executable, str(ROOT / "locks" / "envlock.py"), "check",
                        str(ROOT / "locks" / "vllm.txt")], capture_output=True, text=True)
    assert r.returncode == 0, "this environment differs from locks/vllm.txt:\n" + \
        r.stdout + r.stderr
