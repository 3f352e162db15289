"""Every option of every kvabi-vllm command says what it does in ``--help``: each command's
parser is caught where it parses (nothing runs) and every argument is checked for a help
text."""
import argparse

import pytest

from kvabi_vllm import proxy
from kvabi_vllm.tools import (bench, bench_pd, bench_tax, checkpoints, cpu_bench, demo,
                              demo_pd, pd)

COMMANDS = {"kvabi-vllm proxy": proxy.main, "kvabi-vllm demo": demo.main,
            "kvabi bench vllm": bench.main, "bench_pd": bench_pd.main,
            "bench_tax": bench_tax.main, "checkpoints": checkpoints.main,
            "kvabi bench cpu.vllm": cpu_bench.main, "demo_pd": demo_pd.main,
            "tools.pd": pd.main}


class Parsed(Exception):
    pass


def parsers(parser):
    """``parser`` and its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_described(name, monkeypatch):
    caught = []

    def parse_args(self, *args, **kwargs):
        caught.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    with pytest.raises(Parsed):
        COMMANDS[name]([])
    parser, = caught
    assert parser.description, name
    for p in parsers(parser):
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help.strip(), (name, p.prog, action.dest)
