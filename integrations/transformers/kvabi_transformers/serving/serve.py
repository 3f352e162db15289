"""``kvabi-transformers serve MODEL [options]``: transformers' own OpenAI-compatible server,
``transformers serve MODEL --continuous-batching``, with the model's KV cache and attention
on kvabi (:func:`kvabi_transformers.use`) and, given ``--kv-transfer-config``, kvabi's P/D
protocol over NIXL (a producer, a consumer or both, for vLLM's KvabiConnector or any engine
speaking ``specs/pd.md``; ``kvabi proxy`` fronts a pair).

What it changes in transformers' server, and nothing else: the model is served through
``use()`` once loaded (``ModelManager._load_model``); the completion and chat routes take
and answer kvabi's fields (:mod:`.routes`); ``--served-model-name`` lets a request name the
model as the other server of a pair names it; ``GET /kvabi/status`` says what runs.  Every
other option is ``transformers serve``'s.
"""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys

from kvabi import KVABIError

HELP = """\
kvabi options (the rest are transformers serve's; its help follows):
  --kvabi-backend NAME     kvabi backend of attention (default reference; `kvabi backends`)
  --kvabi-layout PRESET    kvabi layout of the cache (default: the backend's first)
  --kvabi-block-size N     tokens per block (default: the backend's); --cb-block-size too
  --kvabi-memory BYTES     KV cache size, e.g. 64MiB (default 64MiB; replaces --cb-num-blocks)
  --kvabi-prefill-skip     run KV-shared layers on the tokens whose logits are needed only
  --kv-transfer-config JSON  P/D, as vLLM's: '{"kv_role": "kv_producer"}' (kv_consumer,
                           kv_both; "kv_connector_extra_config": {"pull_timeout_s": 30, ...})
  --served-model-name NAME  the name requests may give the model (besides MODEL)
"""
#: transformers serve options this command decides itself
REFUSED = {"--no-continuous-batching": "kvabi serves continuous batching",
           "--cb-num-blocks": "the cache is sized by --kvabi-memory",
           "--attn-implementation": "attention is kvabi's (--kvabi-backend)"}
log = logging.getLogger("kvabi_transformers.serve")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvabi-transformers serve", add_help=False)
    p.add_argument("--kvabi-backend", default="reference")
    p.add_argument("--kvabi-layout", default=None)
    p.add_argument("--kvabi-block-size", default=None)
    p.add_argument("--cb-block-size", default=None)
    p.add_argument("--kvabi-memory", default="64MiB")
    p.add_argument("--kvabi-prefill-skip", action="store_true")
    p.add_argument("--kv-transfer-config", default=None)
    p.add_argument("--served-model-name", default=None)
    return p


def use_options(ns) -> dict:
    """The keyword arguments of :func:`kvabi_transformers.use` the command line asks;
    KVABIError naming the option."""
    from ..connector.settings import pd_options

    pd = None
    if ns.kv_transfer_config is not None:
        try:
            pd = json.loads(ns.kv_transfer_config)
        except ValueError as e:
            raise KVABIError(f"--kv-transfer-config: not JSON ({e})") from None
        pd = pd_options(pd)
    bs = ns.kvabi_block_size if ns.kvabi_block_size is not None else ns.cb_block_size
    if bs is not None:
        try:
            bs = int(bs)
        except ValueError:
            raise KVABIError(f"--kvabi-block-size: must be an integer, got {bs!r}") from None
    return {"backend": ns.kvabi_backend, "layout": ns.kvabi_layout, "block_size": bs,
            "memory": ns.kvabi_memory, "prefill_skip": ns.kvabi_prefill_skip, "pd": pd}


def install(options: dict, served_name: str | None) -> None:
    """Patch transformers' server (this process): models served through ``use()``, kvabi's
    routes on the app it builds."""
    import transformers.cli.serving.model_manager as mm
    import transformers.cli.serving.server as server

    import kvabi_transformers

    from . import routes

    load = mm.ModelManager._load_model
    if getattr(load, "_kvabi", False):
        return

    def _load_model(self, *args, **kwargs):
        model = load(self, *args, **kwargs)
        opts = dict(options)
        backend, layout = opts.pop("backend"), opts.pop("layout")
        kvabi_transformers.use(model, backend, layout, **opts)
        integ = model._kvabi_integration
        log.info("kvabi-transformers: attention on kvabi backend %s, layouts %s, %d-token "
                    "blocks; P/D %s", integ.backend.name, ", ".join(integ.layout_names),
                    integ.block_size, integ.pd.settings.role if integ.pd else "off")
        return model

    _load_model._kvabi = True
    mm.ModelManager._load_model = _load_model
    build = server.build_server
    sig = inspect.signature(build)

    def build_server(*args, **kwargs):
        app = build(*args, **kwargs)
        got = sig.bind(*args, **kwargs).arguments
        manager = got["model_manager"]

        def models():
            return [m.model for m in list(manager.loaded_models.values())
                    if getattr(m, "model", None) is not None]

        routes.install(app, {"completion": got["completion_handler"],
                             "chat": got["chat_handler"]}, models,
                       served=(served_name, manager.force_model))
        return app

    server.build_server = build_server


def main(argv=None) -> int:
    """Run the server (``kvabi-transformers serve MODEL [options]``) until interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print("usage: kvabi-transformers serve MODEL [kvabi options] [transformers serve "
              "options]\n\ntransformers' OpenAI-compatible server (continuous batching) with "
              "the KV cache and attention on kvabi, and kvabi's P/D with "
              "--kv-transfer-config.\n")
        print(HELP)
    ns, rest = parser().parse_known_args(argv)
    for opt, why in REFUSED.items():
        if any(a == opt or a.startswith(opt + "=") for a in rest):
            print(f"kvabi-transformers serve: error: {opt}: {why}", file=sys.stderr)
            return 2
    from ..compat import ensure_transformers, serving_problems

    try:
        options = use_options(ns)
        ensure_transformers()
        problems = serving_problems()
        if problems:
            raise KVABIError("transformers serve: " + "; ".join(problems))
    except KVABIError as e:
        print(f"kvabi-transformers serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("kvabi", "kvabi_transformers"):
        logging.getLogger(name).setLevel(logging.INFO)
    install(options, ns.served_model_name)
    if "--continuous-batching" not in rest:
        rest.append("--continuous-batching")
    from transformers.cli.transformers import app

    try:
        app(["serve", *rest], prog_name="kvabi-transformers serve")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KVABIError as e:  # refused at start (use(), the P/D settings): the reason
        print(f"kvabi-transformers serve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
