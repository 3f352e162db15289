"""``kvabi plan``: the KV cache of Hugging Face model configs and what a budget holds."""
from __future__ import annotations

import argparse
import json

from ..layout.presets import PRESETS
from ..memory.planning import SCHEMES, MemoryPlan, parse_bytes, plan_memory
from ..model.hf_config import hf_max_model_len, load_hf_config, resolve_kv_dtype, text_config
from ..model.model_kv import ModelKV
from ..util.argtypes import from_kvabi, positive_int

EPILOG = """\
With --json, one config prints one JSON object and several print a JSON array of
objects, in the order given.  Each object has: config, model_type, layers,
kv_bytes_per_token, memory_bytes, used_bytes, scheme, groups (kind, layers, block_size,
num_kv_heads, head_dim, head_dim_v, dtype, page_bytes, num_blocks, bytes, and window or
chunk), shared_layers (layer -> owner), prefill_skip_layers, max_tokens,
context_bounded, max_model_len, max_query_len, max_concurrent_requests.

max_tokens is the tokens of context the cache holds at once over all requests (the
token slots of the full-attention groups).  When every layer is windowed or chunked
(context_bounded false) a request's length is not bounded by memory and max_tokens is
what the requests' windows may hold together.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("configs", nargs="+", metavar="CONFIG",
                        help="Hugging Face config.json files (or folders holding one)")
    parser.add_argument("--memory", default="16GiB", type=_bytes_arg,
                        help="KV cache budget, e.g. 16GiB, 80GB, 512MiB (default 16GiB)")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per block (default 16)")
    parser.add_argument("--kv-dtype", default=None,
                        type=from_kvabi(resolve_kv_dtype, "dtype"),
                        help="cache dtype (bfloat16, float16, float32, float8_e4m3fn, "
                             "float8_e5m2, int8; aliases fp8, bf16, ...); default: the "
                             "config's torch_dtype, else bfloat16")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="request length for max_concurrent_requests (default: the "
                             "config's max_position_embeddings)")
    parser.add_argument("--max-query-len", type=positive_int, default=1,
                        help="new tokens per request per step (default 1, decode)")
    parser.add_argument("--scheme", choices=SCHEMES, default="equal",
                        help="equal: same blocks in every group (default); demand: sized "
                             "for requests of --max-model-len")
    parser.add_argument("--layout", default=None, metavar="PRESET", choices=PRESETS,
                        help="layout preset the caches will use, so its padding is paid "
                             "for (e.g. tpu.combined pads the head dim to 128); default: "
                             "unpadded pages")
    parser.add_argument("--json", action="store_true", help="print JSON (see below)")


_bytes_arg = from_kvabi(parse_bytes, "size")


def plan_config(path: str, args: argparse.Namespace) -> tuple[dict, MemoryPlan]:
    """The plan of one config under the command's options, and its JSON object."""
    raw = load_hf_config(path)
    model = ModelKV.from_hf_config(raw, block_size=args.block_size, kv_dtype=args.kv_dtype)
    max_len = args.max_model_len if args.max_model_len is not None else hf_max_model_len(raw)
    plan = plan_memory(model, args.memory, max_model_len=max_len,
                       max_query_len=args.max_query_len, scheme=args.scheme,
                       layout=getattr(args, "layout", None))
    return {"config": path, "model_type": text_config(raw).get("model_type"),
            "layout": getattr(args, "layout", None),
            **plan.to_dict()}, plan


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _layer_ranges(names) -> str:
    """Compact layer indices: ``0-3,5`` for runs, ``1-41:2`` for strided runs of 3+."""
    try:
        idx = [int(n.rsplit(".", 1)[1]) for n in names]
    except (IndexError, ValueError):
        return ",".join(names)
    out, k = [], 0
    while k < len(idx):
        end, step = k, (idx[k + 1] - idx[k]) if k + 1 < len(idx) else 0
        while step > 0 and end + 1 < len(idx) and idx[end + 1] - idx[end] == step:
            end += 1
        if step == 1 and end > k or end - k >= 2:
            out.append(f"{idx[k]}-{idx[end]}" + ("" if step == 1 else f":{step}"))
            k = end + 1
        else:
            out.append(str(idx[k]))
            k += 1
    return ",".join(out)


def format_plan(d: dict) -> str:
    """A readable table of one plan's JSON object."""
    lines = [f"{d['config']}  ({d['model_type'] or 'unknown model_type'}, {d['layers']} layers)",
             f"  KV bytes per token: {d['kv_bytes_per_token']:,}   budget: "
             f"{_size(d['memory_bytes'])}, used {_size(d['used_bytes'])} ({d['scheme']}"
             + (f", layout {d['layout']}" if d.get("layout") else "") + ")"]
    header = ("kind", "span", "heads x dim", "dtype", "layers", "page bytes", "blocks",
              "bytes")
    rows = []
    for g in d["groups"]:
        span = g.get("window", g.get("chunk", "-"))
        dims = (f"{g['num_kv_heads']}x{g['head_dim']}" if g["head_dim_v"] == g["head_dim"]
                else f"{g['num_kv_heads']}x{g['head_dim']}/{g['head_dim_v']}")
        rows.append((g["kind"], str(span), dims, g["dtype"],
                     f"{len(g['layers'])}: {_layer_ranges(g['layers'])}",
                     f"{g['page_bytes']:,}", f"{g['num_blocks']:,}", _size(g["bytes"])))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    shared = d["shared_layers"]
    if shared:
        lines.append(f"  shared layers (no cache): {len(shared)}: "
                     f"{_layer_ranges(list(shared))}; prefill skip: "
                     f"{_layer_ranges(d['prefill_skip_layers']) or 'none'}")
    tokens = f"  max tokens: {d['max_tokens']:,}"
    if not d["context_bounded"]:
        tokens += " (all layers windowed/chunked: tokens the windows hold together)"
    if d["max_model_len"] is not None:
        tokens += (f"   concurrent requests at {d['max_model_len']:,} tokens: "
                   f"{d['max_concurrent_requests']:,}")
    lines.append(tokens)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    objects = [plan_config(path, args)[0] for path in args.configs]
    if args.json:
        print(json.dumps(objects[0] if len(objects) == 1 else objects, indent=2))
    else:
        print("\n\n".join(format_plan(d) for d in objects))
    return 0
