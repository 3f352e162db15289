"""KvabiConnector's host tier inside a real vLLM engine (vLLM's scheduler, block manager,
hybrid allocator and CPU kernels): a turn-2 prompt that extends a finished turn-1 request
loads the saved blocks from kvabi.transfer.HostPool and decodes the tokens the engine
computes without the tier; with one loaded block corrupted, the tokens change."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvabi_vllm.tools.checkpoints import write_checkpoint
from kvabi_vllm.tools.pd import ENV

HERE = Path(__file__).parent


def run(model, out, **env):
    e = {**os.environ, **ENV, "PYTHONPATH": str(HERE), **env}
    try:
        r = subprocess.run([sys.executable, str(HERE / "host_tier_run.py"), str(model), "32",
                            str(out), "kvabi_vllm.tools.corrupting_connector"], env=e,
                           capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as t:
        raise AssertionError(f"waited 900 s for the host tier engine to finish:\n"
                             f"{(t.stdout or b'')[-3000:]!r}") from None
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(Path(out).read_text())


@pytest.mark.parametrize("family", ["gemma3"])  # sliding and full groups (hybrid allocator)
def test_host_tier_hit_gives_the_computed_tokens_and_corruption_changes_them(family,
                                                                            tmp_path):
    model = write_checkpoint(family, tmp_path / family, window=48)
    r = run(model, tmp_path / "out.json", KVABI_TEST_CORRUPT_FROM="9")
    assert min(len(set(t)) for t in r["ref"]) > 1, "degenerate continuations compare nothing"
    assert r["stats_before"]["saved"] > 0 and r["stats_before"]["loaded"] == 0
    assert r["stats_mid"]["loaded"] > 0, "turn 2 loaded nothing from the host tier"
    assert r["hit"] == r["ref"]
    # negative control: the same hits with one loaded block overwritten
    assert r["stats"]["loaded"] > r["stats_mid"]["loaded"] and r["corrupted"] > 0
    assert r["again"] != r["ref"]
