"""``kvabi bench cuda``: runs, checks its two writes agree, and reports the ratios."""
import json

import pytest

from kvabi_cuda import bench


def test_bench_suite_is_registered():
    from kvabi.commands.bench import suites

    assert suites()["cuda"] is bench.run


def test_bench_json(capsys):
    assert bench.run(["--json", "--suite", "write", "--tokens", "24", "--heads", "2",
                      "--head-dim", "16", "--repeats", "1", "--dtype", "float32"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert "dispatch" not in res
    assert res["bytes"] == 2 * 24 * 2 * 16 * 4
    for k in ("triton_vs_copy", "torch_vs_copy"):
        assert res[k] == res["copy_s"] / res[k.replace("_vs_copy", "_write_s")]
    if res["triton_mode"] == "interpret":
        assert "interpreter" in res["note"].lower()


def test_bench_text(capsys):
    assert bench.run(["--tokens", "8", "--heads", "1", "--head-dim", "8", "--repeats",
                      "1", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "vs copy" in out and "Triton write_kv" in out and "torch index_put" in out
    assert "host cost" in out and "write_kv + attention, per layer" in out


def test_dispatch_json_and_kernels_restored(capsys):
    from kvabi_cuda import triton_attention, triton_write

    launchers = triton_attention.paged_attention, triton_write.write_kv
    assert bench.run(["--json", "--suite", "dispatch", "--repeats", "1", "--layers",
                      "3"]) == 0
    d = json.loads(capsys.readouterr().out)["dispatch"]
    assert d["layers"] == 3 and d["repeats"] == 1
    for k in ("plan_s", "layer_s", "step_s"):
        assert d[k] > 0
    # The no-op launchers were only for the timing: the real ones are back.
    assert (triton_attention.paged_attention, triton_write.write_kv) == launchers


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--repeats", "-5"], ["--layers", "1.5"],
                                 ["--suite", "nope"]])
def test_bad_options_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench.run(bad)
    assert e.value.code == 2


def test_bench_does_not_depend_on_the_command_line():
    """A backend's bench parses its options with the public kvabi.util.argtypes, without
    importing kvabi.commands (a fresh interpreter, so other tests' imports do not count)."""
    import subprocess
    import sys

    code = ("import sys; from kvabi_cuda import bench; bench._parser().parse_args([]); "
            "print(sorted(m for m in sys.modules if m.startswith('kvabi.commands')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "[]"
