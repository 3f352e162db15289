"""``kvabi bench cuda``: runs, checks its two writes agree, and reports the ratios."""
import json

from kvabi_cuda import bench


def test_bench_suite_is_registered():
    from kvabi.commands.bench import suites

    assert suites()["cuda"] is bench.run


def test_bench_json(capsys):
    assert bench.run(["--json", "--tokens", "24", "--heads", "2", "--head-dim", "16",
                      "--repeats", "1", "--dtype", "float32"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["bytes"] == 2 * 24 * 2 * 16 * 4
    for k in ("triton_vs_copy", "torch_vs_copy"):
        assert res[k] == res["copy_s"] / res[k.replace("_vs_copy", "_write_s")]
    if res["triton_mode"] == "interpret":
        assert "interpreter" in res["note"].lower()


def test_bench_text(capsys):
    assert bench.run(["--tokens", "8", "--heads", "1", "--head-dim", "8", "--repeats",
                      "1"]) == 0
    out = capsys.readouterr().out
    assert "vs copy" in out and "Triton write_kv" in out and "torch index_put" in out
