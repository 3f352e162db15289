"""The servers' starter of the P/D demo, bench and cross-engine tests reports why a server
failed to start, with the tails of the logs, also when a later server's log was never
written (its proxy was not started yet)."""
import sys

import pytest

from kvabi_transformers.tools.pd_servers import serve_all


def test_a_server_that_exits_is_named_with_its_log_and_unstarted_ones_said(tmp_path):
    logs = {"engine": tmp_path / "engine.log", "proxy": tmp_path / "proxy.log"}
    failing = [sys.executable, "-c",
               "print('serve: error: fastapi is missing'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError) as info:
        serve_all({"engine": lambda port: (failing, {})}, logs, timeout=60)
    text = str(info.value)
    assert text.startswith("engine exited with 3 while waiting for engine to be healthy")
    assert "serve: error: fastapi is missing" in text
    assert f"== proxy ({logs['proxy']})\n(not started: no log)" in text
