"""``kvabi-vllm demo``'s P/D pair: vLLM's CPU backend prefills, the kvabi backend
example.torch decodes on another layout and block size, KvabiConnector moves the KV over
NIXL with relayout (:func:`kvabi_vllm.tools.pd.demo_pair`)."""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="kvabi-vllm demo (P/D pair)",
        description="prefill on vLLM's CPU backend (LBHNC, 32-token blocks), decode on the "
                    "kvabi backend example.torch (cross-layer BLHNC, 64-token blocks) in a "
                    "second process; KvabiConnector over NIXL; tokens compared with the "
                    "decode engine alone").parse_args(argv)
    from .pd import demo_pair

    return 0 if demo_pair() else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
