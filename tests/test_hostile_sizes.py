"""A size an untrusted text states bounds what its reader spends, never the size itself
(``specs/security.md`` section 2, *Time and memory*): descriptors, handshakes, shard groups,
configs and checksums of a few hundred bytes that state a huge head count, block size,
block count, layer count, model head count or chunk.

Every case runs in a process of its own under an address-space limit (a reader that tried
to allocate GiBs gets a MemoryError there, not the machine's OOM killer) and must answer,
as the text deserves, a result or a KVABIError whose message starts with the field, while
allocating at most :data:`PEAK` bytes (tracemalloc, numpy included).  A fixed corpus runs in
``make test``; ``make thorough`` adds thousands of random descriptors of that kind.
"""
from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvabi import KVSpec, Layout
from kvabi.testing.profiles import current_profile

WORKER = Path(__file__).with_name("hostile_sizes_worker.py")
#: address space of the worker (Python and numpy take a few hundred MiB of it)
LIMIT = 2 << 30
#: what one hostile case may allocate: O(the text), far below what its sizes state
PEAK = 32 << 20
#: the whole batch; a hang fails saying so
TIMEOUT = 600
FIELD = re.compile(r"^[A-Za-z_][\w.\[\]'-]*: ")
SPEC = KVSpec("full", block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def doc(preset="flashinfer.HND", sizes=None, shard=None, spec=SPEC, blocks=8, layers=2):
    """A preset's descriptor (a dict) with ``sizes`` changed and a ``shard`` stated."""
    d = json.loads(Layout.preset(preset, spec, blocks, layers).to_json())
    d["sizes"].update(sizes or {})
    if shard is not None:
        d["shard"] = shard
    return d


def checksums_text(tokens, chunk, heads=(0,), rows=1, value="0" * 16):
    return json.dumps({"sum": "kvsum1", "heads": list(heads), "layers": [0, 1],
                       "tokens": tokens, "chunk": chunk,
                       "values": [[value] * len(heads)] * rows})


def run_cases(cases):
    """The worker's answer to every case (see the module docstring)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    try:
        done = subprocess.run([sys.executable, str(WORKER)], input=json.dumps(cases),
                              capture_output=True, text=True, timeout=TIMEOUT,
                              preexec_fn=limit, cwd=WORKER.parent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not answer {len(cases)} hostile cases within "
                    f"{TIMEOUT} s (a reader spending time in a stated size?)")
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == len(cases), (
        f"worker exited {done.returncode} after {len(lines)} of {len(cases)} cases "
        f"(the next: {cases[len(lines)] if len(lines) < len(cases) else None!r:.300}); "
        f"stderr: {done.stderr[-2000:]}")
    return [json.loads(x) for x in lines]


def check(cases, results):
    bad = []
    for case, got in zip(cases, results):
        want = case.get("want")  # None: any answer; "ok"; or the field a refusal names
        why = None
        if got["peak"] > PEAK:
            why = f"allocated {got['peak'] / 2**20:.0f} MiB"
        elif "error" in got and (got["error"] != "KVABIError" or not FIELD.match(
                got["message"])):
            why = f"{got['error']}: {got['message']}"
        elif want == "ok" and "error" in got:
            why = f"refused: {got['message']}"
        elif want not in (None, "ok") and not got.get("message", "").startswith(want):
            why = f"answered {got.get('message', got.get('ok'))!r}, expected {want}: ..."
        if why:
            bad.append(f"{case.get('name', case['op'])}: {why} ({got['seconds']:.2f} s)")
    assert not bad, "\n".join(bad)


# -- the fixed corpus (make test) ----------------------------------------------------------
H24, BIG = 2**24, 2**62
CORPUS = [
    # a ~300-byte descriptor stating 2**24 heads: labelled in O(text), not O(H)
    dict(name="H=2**24 fingerprint", op="layout", doc=doc(sizes={"H": H24}), want="ok"),
    dict(name="H=2**40 fingerprint", op="layout", doc=doc(sizes={"H": 2**40}), want="ok"),
    dict(name="H=2**24 component form", op="handshake",
         doc=json.loads(Layout.preset("vllm.fp8_per_token_head", KVSpec(
             "full", block_size=16, num_kv_heads=H24, head_dim=64, dtype="float8_e4m3fn",
             quant="per_token_head"), 8, 2).to_json()), want="ok"),
    dict(name="H=2**24 handshake", op="handshake", doc=doc(sizes={"H": H24}), want="ok"),
    dict(name="shard of 2**62 heads, 2**62 ranks", op="handshake",
         doc=doc(sizes={"H": 1}, shard={"heads": [0], "of": BIG, "rank": 0, "ranks": BIG}),
         want="ok"),
    dict(name="2**40 layers of one plane each", op="handshake",
         doc=doc(sizes={"L": 2**40}), want="planes.address"),
    dict(name="negotiate: H=2**24 peer", op="negotiate", docs=[doc(sizes={"H": H24})],
         want="shard.of"),
    dict(name="negotiate: block size 2**30", op="negotiate",
         docs=[doc(sizes={"N": 2**30})], want="ok"),
    dict(name="negotiate: 2**40 blocks", op="negotiate", docs=[doc(sizes={"B": 2**40})],
         want="ok"),
    dict(name="negotiate: ranks of a 2**62-head model", op="negotiate",
         docs=[doc(sizes={"H": 1}, shard={"heads": [i], "of": BIG, "rank": i, "ranks": 2})
               for i in range(2)], want="shard.of"),
    dict(name="plan_shard: block size 2**30", op="plan_shard",
         docs=[doc(sizes={"N": 2**30})], want="ok"),
    dict(name="plan_shard: whole H=2**24 peer", op="plan_shard",
         docs=[doc(sizes={"H": H24})], want="dst_layout.shard.of"),
    dict(name="plan_shard_blocks: block size 2**30", op="plan_shard_blocks",
         docs=[doc(sizes={"N": 2**30})], src_blocks=[0], dst_blocks=[0], want="dst_blocks"),
    # a peer's strides put 2**40 bytes between its blocks (or inside one): a staged pull
    # holds what the plan moves, not what the peer's blocks span
    dict(name="staging: blocks 2**40 bytes apart", op="staging", src_blocks=[0, 1, 2],
         dst_blocks=[0, 1, 2], doc=dict(doc(), strides={"B": 2**40, "KV": 4096, "H": 2048,
                                                         "N": 128, "D": 2}), want="ok"),
    dict(name="staging: heads 2**40 bytes apart", op="staging", src_blocks=[0, 1],
         dst_blocks=[3, 1], doc=dict(doc(), strides={"B": 2**42, "KV": 2**41, "H": 2**40,
                                                      "N": 128, "D": 2}), want="ok"),
    dict(name="group of one rank of 2**62 heads", op="check_group",
         docs=[doc(sizes={"H": 1}, shard={"heads": [0], "of": BIG, "rank": 0, "ranks": 1})],
         want="sources: global head 1 of"),
    dict(name="group: a whole H=2**24 rank", op="check_group", docs=[doc(sizes={"H": H24})],
         want="ok"),
    dict(name="TP view of 2**24 KV heads over 2**20 ranks", op="tp_view", tp=2**20,
         rank=2**20 - 1, config={"model_type": "llama", "num_hidden_layers": 2,
                                 "num_attention_heads": H24, "num_key_value_heads": H24,
                                 "hidden_size": 64 * H24, "head_dim": 64}, want="ok"),
    dict(name="checksums of 2**62 tokens in chunks of 2**62", op="checksums_json",
         text=checksums_text(BIG, BIG), want="ok"),
    dict(name="checksums of 2**62 tokens in chunks of 1", op="checksums_json",
         text=checksums_text(BIG, 1), want="checksums.values"),
    dict(name="a peer's chunk of 2**40 tokens", op="checksums", chunk=2**40, want="ok"),
]
CORPUS += [dict(name=f"checksum value {v!r}", op="checksums_json",
                text=checksums_text(16, 16, value=v), want="checksums.values")
           for v in ("1_0", " 10 ", "+10", "0x10", "00000000000000000", "000000000000000G",
                     "00000000000000AB")]


def test_a_fixed_corpus_of_huge_stated_sizes():
    check(CORPUS, run_cases(CORPUS))


def test_the_worker_sees_what_an_unbounded_reader_costs():
    """The measure can fail: a reader that builds a list of the stated heads (what the
    fingerprint did) is caught by the peak, not by the machine."""
    got = run_cases([dict(op="checksums_json", name="probe",
                          text=checksums_text(16, 16, heads=range(600_000)))])
    with pytest.raises(AssertionError, match="allocated"):
        check([dict(op="checksums_json", name="probe")], got)


# -- random hostile descriptors (make thorough: thousands) -----------------------------------
PRESETS = ("flashinfer.HND", "flashinfer.NHD", "vllm.LBHNC", "vllm.BHLNC", "tpu.combined",
           "tpu.hidden", "flash_attn", "vllm.cpu", "vllm.fp8_per_token_head")
CASES = 3000 if current_profile() == "thorough" else 60


def _huge(rng) -> int:
    return int(rng.choice([2**int(rng.integers(17, 63)), int(rng.integers(2**20, 2**62)),
                           2**63 - 1, 2**31, 2**32 + 1]))


def _random_doc(rng, preset) -> dict:
    sizes = {}
    for axis in rng.choice(["L", "B", "N", "H"], size=int(rng.integers(1, 3)), replace=False):
        sizes[str(axis)] = _huge(rng)
    shard = None
    if rng.random() < 0.5:
        of = _huge(rng) if rng.random() < 0.5 else 2
        ranks = _huge(rng) if rng.random() < 0.5 else int(rng.integers(1, 3))
        heads = sorted(set(int(h) for h in rng.integers(0, min(of, 2**62), size=int(
            rng.integers(1, 4)))))
        sizes["H"] = len(heads)
        shard = {"heads": heads, "of": of, "rank": int(rng.integers(0, min(ranks, 4))),
                 "ranks": ranks}
    spec = SPEC if "fp8" not in preset else KVSpec("full", block_size=16, num_kv_heads=2,
                                                   head_dim=64, dtype="float8_e4m3fn",
                                                   quant="per_token_head")
    return doc(preset, sizes, shard, spec=spec)


def random_cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        preset = str(rng.choice(PRESETS))
        op = str(rng.choice(["layout", "handshake", "negotiate", "plan_shard", "check_group"]))
        docs = [_random_doc(rng, preset) for _ in range(int(rng.integers(1, 3)))]
        case = dict(name=f"random {i} ({op}, {preset})", op=op, doc=docs[0], docs=docs)
        if op in ("negotiate", "plan_shard") and preset != "vllm.fp8_per_token_head":
            case["preset"] = preset
        elif op in ("negotiate", "plan_shard"):
            case["op"] = "layout"
        out.append(case)
    return out


def test_random_descriptors_stating_huge_sizes():
    cases = random_cases(CASES, seed=32)
    for start in range(0, len(cases), 500):  # one worker per batch (a crash names its case)
        batch = cases[start:start + 500]
        check(batch, run_cases(batch))
