"""The ``kvabi`` command under bad input: one line ``kvabi: error: ...`` on stderr, exit
status 2, no traceback unless ``--debug``; bad option values are usage errors."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvabi.util.argtypes import float_arg, from_kvabi, int_arg, positive_int
from kvabi.commands.cli import main
from kvabi.memory.planning import parse_bytes

LLAMA = str(Path(__file__).parents[1] / "examples" / "configs" / "llama-3-8b.json")


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    assert err.startswith("kvabi: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv,match", [
    (["plan", "/no/such/config.json"], "config: cannot read"),
    (["plan", LLAMA, "--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["plan", LLAMA, "--block-size", "1.5"], "argument --block-size: must be an integer"),
    (["plan", LLAMA, "--block-size", "1e3"], "argument --block-size: must be an integer"),
    (["plan", LLAMA, "--max-model-len", "-1"], "argument --max-model-len: must be >= 1"),
    (["plan", LLAMA, "--max-query-len", "0"], "argument --max-query-len"),
    (["plan", LLAMA, "--memory", "lots"], "argument --memory: memory: 'lots' is not a size"),
    (["plan", LLAMA, "--memory", "0"], "memory_bytes"),
    (["plan", LLAMA, "--kv-dtype", "float64"], "argument --kv-dtype: kv_dtype"),
    (["plan", LLAMA, "--layout", "nope"], "argument --layout: invalid choice"),
    (["plan", LLAMA, "--scheme", "demand", "--max-model-len", "99999999999"],
     "memory_bytes"),
    (["plan"], "the following arguments are required: CONFIG"),
    (["plan", LLAMA, "--bogus"], "unrecognized arguments: --bogus"),
    (["backends", "--head-dim", "-8"], "argument --head-dim: must be >= 1"),
    (["backends", "--kv-heads", "two"], "argument --kv-heads: must be an integer"),
    (["nope"], "invalid choice: 'nope'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_errors_are_one_line_and_exit_2(argv, match, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == ""
    assert match in one_line(err)


def test_usage_errors_name_the_command_and_its_help(capsys):
    _, _, err = run(["plan", LLAMA, "--block-size", "0"], capsys)
    assert err.startswith("kvabi: error: plan: argument --block-size")
    assert "(see 'kvabi plan --help')" in err


def test_not_json_config(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\x00\x01 not json")
    rc, _, err = run(["plan", str(bad)], capsys)
    assert rc == 2 and "not valid JSON" in one_line(err)
    bad.write_bytes(b"\xff\xfe{}")
    rc, _, err = run(["plan", str(tmp_path)], capsys)
    assert rc == 2 and "not UTF-8" in one_line(err)


@pytest.mark.parametrize("argv", [["--debug", "plan", "/no/such.json"],
                                  ["plan", "/no/such.json", "--debug"],
                                  ["plan", LLAMA, "--block-size", "0", "--debug"]])
def test_debug_shows_the_traceback(argv, capsys):
    rc, _, err = run(argv, capsys)
    assert rc == 2
    assert err.startswith("Traceback") and err.rstrip().splitlines()[-1].startswith(
        "kvabi: error: ")


def test_debug_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("KVABI_DEBUG", "1")
    rc, _, err = run(["plan", "/no/such.json"], capsys)
    assert rc == 2 and "Traceback" in err


def test_good_runs_are_unchanged(capsys):
    rc, out, err = run(["plan", LLAMA, "--memory", "1GiB", "--block-size", "32"], capsys)
    assert rc == 0 and "llama" in out and err == ""


def test_real_process_exit_status():
    """The console entry point, as a shell sees it."""
    p = subprocess.run([sys.executable, "-m", "kvabi.commands.cli", "plan", "/no/such.json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "kvabi: error: config: cannot read '/no/such.json': No such file or " \
                       "directory\n"


def test_option_types_for_other_commands():
    """The generic mechanism: ints, finite reals with bounds, any KVABIError parser."""
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--n", type=int_arg(lo=1, hi=10))
    p.add_argument("--t", type=float_arg(lo=0, lo_open=True))
    p.add_argument("--m", type=from_kvabi(parse_bytes))
    p.add_argument("--k", type=positive_int)
    ok = p.parse_args(["--n", "10", "--t", "0.5", "--m", "2KiB", "--k", "3"])
    assert (ok.n, ok.t, ok.m, ok.k) == (10, 0.5, 2048, 3)
    for argv in (["--n", "0"], ["--n", "11"], ["--n", "2.0"], ["--n", " "], ["--t", "0"],
                 ["--t", "-5"], ["--t", "nan"], ["--t", "inf"], ["--t", "x"], ["--m", "1XB"],
                 ["--k", "9" * 30]):
        with pytest.raises(argparse.ArgumentError):
            p.parse_args(argv)


def _path_cases(tmp: Path):
    """(argv, message) for every option naming a path, given a path of the wrong kind."""
    a_file = tmp / "a-file"
    a_file.write_text("x")
    a_dir = tmp / "a-dir"
    a_dir.mkdir()
    conf = ["conformance", "reference", "--quick"]
    return [
        (conf + ["--junit-xml", str(a_dir)], "argument --junit-xml: "
         f"{str(a_dir)!r} is a directory"),
        (conf + ["--junit-xml", str(a_file / "report.xml")], "argument --junit-xml: "
         f"{str(a_file / 'report.xml')!r}: {str(a_file)!r} is not a directory"),
        (conf + ["--junit-xml", str(a_file / "deeper" / "report.xml")],
         f"{str(a_file)!r} is not a directory"),
        (conf + ["--junit-xml", ""], "argument --junit-xml: must be a path"),
        (conf + ["--replay", str(a_file)], f"argument --replay: {str(a_file)!r} is not a "
         "directory"),
        (conf + ["--replay", str(a_file / "sub")], f"{str(a_file)!r} is not a directory"),
    ]


def test_path_options_are_checked_by_kind(tmp_path, capsys):
    """A path of the wrong kind is a usage error before anything runs (not an
    IsADirectoryError or FileExistsError traceback after the checks ran)."""
    for argv, match in _path_cases(tmp_path):
        rc, out, err = run(argv, capsys)
        assert rc == 2 and out == "", argv
        assert match in one_line(err), (argv, err)
    # nothing was written or made by the refused runs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file"]
    assert list((tmp_path / "a-dir").iterdir()) == []


def test_path_options_accept_paths_of_their_kind(tmp_path):
    from kvabi.util.argtypes import directory_arg, output_file_arg

    (tmp_path / "old.xml").write_text("old")
    for good in (tmp_path / "new.xml", tmp_path / "old.xml", tmp_path / "x" / "y" / "r.xml"):
        assert output_file_arg(str(good)) == str(good)
    for good in (tmp_path, tmp_path / "new", tmp_path / "x" / "y"):
        assert directory_arg(str(good)) == str(good)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # a dangling link is not a dir
    with pytest.raises(argparse.ArgumentTypeError, match="not a directory"):
        directory_arg(str(tmp_path / "link"))


def test_bench_usage_errors_are_one_line(capsys):
    """Built-in suites and a plugin's suite with its own argparse parser: one line, status 2,
    no usage block; argparse's own error handling is restored afterwards."""
    registry = pytest.importorskip("kvabi.backend.registry")
    from kvabi import hookimpl

    def suite(argv):
        p = argparse.ArgumentParser(prog="kvabi bench strict")
        p.add_argument("--n", type=positive_int, default=1)
        p.parse_args(argv)
        return 0

    class Plugin:
        @hookimpl
        def kvabi_bench_suites(self):
            return {"strict": suite}

    registry.reset()
    try:
        registry.register(Plugin(), name="bench-strict")
        for argv, match in [
            (["bench", "transforms", "--bogus"],
             "kvabi: error: bench transforms: unrecognized arguments: --bogus (see "
             "'kvabi bench transforms --help')"),
            (["bench", "layout", "--bogus"], "kvabi: error: bench layout: unrecognized arguments"),
            (["bench", "strict", "--n", "0"],
             "kvabi: error: bench strict: argument --n: must be >= 1, got 0 (see "
             "'kvabi bench strict --help')"),
            (["bench", "strict", "--n"],
             "kvabi: error: bench strict: argument --n: expected one argument"),
        ]:
            rc, out, err = run(argv, capsys)
            assert rc == 2 and out == "", argv
            assert one_line(err).startswith(match), err
        assert run(["bench", "strict", "--n", "3"], capsys)[0] == 0
    finally:
        registry.reset()
    with pytest.raises(SystemExit):  # outside `kvabi bench`, argparse is argparse again
        argparse.ArgumentParser().parse_args(["--bogus"])
    capsys.readouterr()


def test_every_installed_bench_suite_gives_one_line_usage_errors(capsys):
    """Whatever suites are installed here (built-in and plugins'), an unknown option is a
    one-line usage error naming the suite."""
    from kvabi.commands.bench import suites

    names = sorted(suites())
    assert {"transforms", "layout", "overhead", "transfer"} <= set(names)
    for name in names:
        rc, out, err = run(["bench", name, "--no-such-option"], capsys)
        assert rc == 2 and out == "", name
        assert one_line(err).startswith(f"kvabi: error: bench {name}: unrecognized "
                                        "arguments: --no-such-option"), err
