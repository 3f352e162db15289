"""The demo, `kvabi bench transformers` and `kvabi bench transformers-pd` run end to end (tiny
sizes) and report."""
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


def test_pd_bench_step_cost_json(capsys):
    """`kvabi bench transformers-pd` (without --vllm-python: the per-step part only) is a
    registered suite, reports both sides' times, their ratio against the 1.05x goal, and the
    connector's own time per loop iteration it measured."""
    from kvabi.backend.registry import plugin_manager
    import kvabi_transformers.tools.bench_pd as bench_pd

    suites = {}
    for d in plugin_manager().hook.kvabi_bench_suites():
        suites.update(d)
    assert suites["transformers-pd"] is bench_pd.main
    rc = bench_pd.main(["--json", "--prompts", "2", "--prompt-len", "16", "--new-tokens", "4",
                        "--repeat", "1", "--backend", "reference"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r) == {"step"}  # no per-request part without --vllm-python
    s = r["step"]
    assert s["off_s"] > 0 and s["on_s"] > 0 and s["goal"] == 1.05
    assert s["ratio"] == pytest.approx(s["on_s"] / s["off_s"])
    assert s["connector_steps"] > 0 and s["connector_us_per_step"] > 0

