"""The demo and `kvabi bench transformers` run end to end (tiny sizes) and report."""
import json
import subprocess
import sys

import pytest

import kvabi_transformers.tools.bench as bench
import kvabi_transformers.tools.demo as demo


def test_bench_suite_is_registered_through_the_kvabi_hook():
    from kvabi.backend.registry import plugin_manager

    suites = {}
    for d in plugin_manager().hook.kvabi_bench_suites():
        suites.update(d)
    assert suites["transformers"] is bench.main


def test_bench_json(capsys):
    rc = bench.main(["--json", "--prompts", "2", "--prompt-len", "48", "--layers", "4",
                     "--hidden", "64", "--window", "16", "--backend", "reference"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens_match"] == {"kvabi": True, "kvabi_prefill_skip": True,
                                 "kvabi_decode_backend": True}
    assert r["batch"] == {"prompts": 2, "prompt_len": 48, "new_tokens": 3}
    assert r["prefill_skip_speedup"] > 0 and r["kvabi_overhead_per_step_s"] > 0
    for path in ("transformers_paged", "kvabi", "kvabi_prefill_skip", "kvabi_decode_backend"):
        assert r[path]["prefill_s"] > 0 and r[path]["generated"] == 6
    # the decode step on a torch backend, against transformers' own, from the same run
    assert r["decode_backend"] == "example.torch"
    hf, dec, ratio = r["transformers_paged"], r["kvabi_decode_backend"], r["decode_step_ratio"]
    assert ratio["goal"] == 1.2
    assert ratio["wall"] == pytest.approx(dec["decode_s"] / hf["decode_s"])
    assert ratio["cpu"] == pytest.approx(dec["decode_cpu_s"] / hf["decode_cpu_s"])
    assert 0 < r["kvabi"]["handover_per_layer_s"] and 0 < r["kvabi"]["backend_per_layer_s"]
    text = bench.report(r)
    assert "goal kvabi <= 1.2x" in text and "measured (example.torch)" in text
    assert "FAIL" not in text and "NOT met" not in text


def test_bench_bad_argument(capsys):
    assert bench.main(["--layers", "5"]) == 2
    assert "--layers: must be an even number >= 4, got 5" in capsys.readouterr().err


def test_demo_json(capsys):
    rc = demo.main(["--json", "--backends", "reference,cuda.flashinfer", "--prompts", "3",
                    "--new-tokens", "3", "--skip-prompt-len", "32"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert r["backends"]["reference"]["tokens_match"] is True
    assert r["prefill_skip"]["tokens_match"] is True
    assert "available" in r["backends"]["cuda.flashinfer"]


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "kvabi_transformers.cli", "demo", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--backends" in out.stdout
