"""The ``kvabi-vllm`` command."""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvabi-vllm", description="vLLM on kvabi")
    parser.parse_args(argv)
    return 0
