"""vLLM and transformers serving each other's prefills over NIXL, as people serve them:
``kvabi-vllm serve`` (vLLM's environment) and ``kvabi-transformers serve`` (transformers'
continuous batching, this environment), both kv_both, one random checkpoint
(``kvabi_vllm.tools.checkpoints``: weights std 0.3, a byte tokenizer), and ``kvabi proxy``
in front of each direction.  Started once per dtype and shared by the module's tests.

- Greedy tokens through the proxy (prefilled by one engine, decoded by the other) equal the
  decoding server's own tokens for the same prompts, both directions, float32 and bfloat16
  (in bfloat16 the first ``TOKENS_EQUAL`` tokens: each engine rounds its own KV); layouts and
  block sizes differ on the two sides (see ``PAIRS``).
- The KV each engine computes for a prompt, pulled by a third party through the protocol
  (the P/D kit's :class:`kvabi.testing.pd.ReferenceEngine`), agrees layer by layer within
  the dtype's tolerance: what a consumer pulls (byte-exact, checksummed) is what it would
  have computed itself, and a wrong head order or a shifted block would show.
- Malformed, forged and replayed parameters sent to the transformers server fail that
  request alone (status 500, the reason naming the field), a producer that died fails it
  within ``pull_timeout_s``, the next request is served, and no table holds anything after.
"""
import concurrent.futures as cf
import subprocess
import time

import numpy as np
import pytest

from kvabi.pd import ASK
from kvabi_transformers.connector import model_identity
from kvabi.pd import PDSettings
from kvabi.testing.pd import ModelFacts, ReferenceEngine
from kvabi_transformers.tools.pd_values import floats
from kvabi_transformers.tools.pd_servers import MODEL, Engine, call, pd_servers

CALL_TIMEOUT = 180.0
PULL_TIMEOUT = 10.0
PROMPTS = ["Hello there, how are you doing today?", "The quick brown fox jumps over",
           "kvabi moves KV caches between engines and layouts", "One two three four five",
           "Prefill here, decode there: the same tokens either way, in any layout."]
NEW_TOKENS = 8
EXTRA = {"pull_timeout_s": PULL_TIMEOUT, "hold_timeout_s": 60.0}
#: per dtype: the transformers server and the vLLM server, whose layouts and block sizes
#: differ (float32: tpu.jax's tpu.combined, K and V folded into the head axis and head_dim
#: padded to 128, against the kvabi backend example.torch in vLLM on cross-layer BLHNC;
#: bfloat16: the reference backend on flashinfer.HND, 64-token blocks, against vLLM's own
#: CPU attention, whose keys are stored transposed)
PAIRS = {
    "float32": (Engine("transformers", block_size=16, dtype="float32", backend="tpu.jax",
                       layout="tpu.combined", extra=EXTRA),
                Engine("vllm", block_size=32, dtype="float32", extra=EXTRA,
                       env={"KVABI_VLLM_BACKEND": "example.torch", "KVABI_VLLM_LAYOUT": "BLHNC",
                            "VLLM_KV_CACHE_LAYOUT": "BLHNC"})),
    "bfloat16": (Engine("transformers", block_size=64, dtype="bfloat16",
                        backend="reference", layout="flashinfer.HND", extra=EXTRA),
                 Engine("vllm", block_size=32, dtype="bfloat16", extra=EXTRA)),
}
#: how closely two engines' KV of one prompt agree, per layer (relative L2).  In bfloat16
#: each engine rounds its own projections and rotary embedding: measured 0.003 at layer 0
#: growing to 0.05 at layer 3 (a head order or block shift: 1.35 and more).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
#: greedy tokens compared per prompt.  In bfloat16 those KV differences (each engine's own
#: computation, not the transfer: pulls are checksummed byte-exact) flip a greedy token of
#: this random model after 3 to 12 tokens (measured over PROMPTS, both directions)
TOKENS_EQUAL = {"float32": NEW_TOKENS, "bfloat16": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, vllm_python):
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    subprocess.run([vllm_python, "-m", "kvabi_vllm.tools.checkpoints", str(path)], check=True,
                   timeout=600, capture_output=True)
    return path


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, checkpoint, vllm_python, tmp_path_factory):
    """{"dtype", "urls", "logs", "engines"}: the two servers and a proxy per direction
    (``tv``: prefilled by transformers, decoded by vLLM; ``vt``: the reverse)."""
    dtype = request.param
    t, v = PAIRS[dtype]
    work = tmp_path_factory.mktemp(f"pd-{dtype}")
    with pd_servers(checkpoint, work, {"t": t, "v": v}, {"tv": ("t", "v"), "vt": ("v", "t")},
                    vllm_python=vllm_python, proxy_timeout=CALL_TIMEOUT) as run:
        yield {"dtype": dtype, "engines": {"t": t, "v": v}, "model": checkpoint, **run}


def reference(pair, role: str, fault=None) -> ReferenceEngine:
    """The P/D kit's reference engine (numpy caches) with the pair's model shapes, dtype
    and identity, started as ``role``: a third party to both servers."""
    from transformers import AutoConfig

    facts = ModelFacts(num_layers=4, num_kv_heads=2, head_dim=32, dtype=pair["dtype"],
                       vocab=259, block_size=16, max_tokens=1024, model_id=model_identity(
                           AutoConfig.from_pretrained(str(pair["model"]))))
    ref = ReferenceEngine(facts, fault=fault, num_blocks=256)
    ref.start(role, PDSettings(role=role, pull_timeout_s=PULL_TIMEOUT))
    return ref


def complete(url, prompt, max_tokens=NEW_TOKENS, **extra):
    """(status, answer) of a greedy completion of ``prompt`` at ``url``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    return call(url + "/v1/completions", body, timeout=CALL_TIMEOUT)


def token_ids(r):
    """(prompt token ids, generated token ids) of a successful completion."""
    status, got = r
    assert status == 200, got
    c = got["choices"][0]
    return list(c["prompt_token_ids"]), list(c["token_ids"])


def answer(r) -> dict:
    """A producer's answer (kv_transfer_params) in a successful completion."""
    status, got = r
    assert status == 200 and isinstance(got.get("kv_transfer_params"), dict), got
    return got["kv_transfer_params"]


@pytest.mark.parametrize("direction", ["tv", "vt"])
def test_tokens_across_engines_equal_the_decoding_servers_own(pair, direction):
    urls = pair["urls"]
    decoder = urls[direction[1]]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:  # concurrent requests, each its own
        pd = list(ex.map(lambda p: token_ids(complete(urls[direction], p)), PROMPTS))
    own = [token_ids(complete(decoder, p)) for p in PROMPTS]
    assert [o[0] for o in pd] == [o[0] for o in own]  # both engines' tokenizers agree
    k = TOKENS_EQUAL[pair["dtype"]]
    assert [o[1][:k] for o in pd] == [o[1][:k] for o in own], (pair["dtype"], direction)
    assert min(len(set(o[1])) for o in own) > 2  # varied continuations: the check means something


def test_each_engines_kv_of_a_prompt_agrees_layer_by_layer(pair):
    """The KV a consumer pulls is the producer's, byte for byte (checksums); here the two
    producers' KV of the same prompts, pulled by a third party, agree within the dtype's
    tolerance in every layer, key and value: what either engine pulls is what it computes."""
    urls, dtype = pair["urls"], pair["dtype"]
    ref = reference(pair, "consumer")
    try:
        for i, prompt in enumerate(PROMPTS):
            kv = {}
            for side in ("t", "v"):
                r = complete(urls[side], prompt, max_tokens=1, kv_transfer_params=dict(ASK))
                ids, _ = token_ids(r)
                got = ref.decode([(f"{side}{i}", ids, answer(r))])[f"{side}{i}"]
                assert got.reason is None, (side, got.reason)
                kv[side] = floats(got.kv[0], dtype)
            t, v = kv["t"], kv["v"]
            assert t.shape == v.shape == (4, 2, len(ids), 2, 32)
            for layer in range(4):
                err = rel_l2(t[layer], v[layer])
                assert err < TOLERANCE[dtype], (dtype, prompt, layer, err)
            # a wrong head order or a block shifted by one would not agree
            assert rel_l2(t[:, :, :, ::-1], v) > 5 * TOLERANCE[dtype]
            assert rel_l2(t[:, :, 1:], v[:, :, :-1]) > 5 * TOLERANCE[dtype]
    finally:
        ref.stop()


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def status(url):
    return call(url + "/kvabi/status", timeout=30)[1]["models"][0]


def test_hostile_parameters_fail_alone_on_the_transformers_server(pair):
    urls = pair["urls"]
    good = [answer(complete(urls["v"], p, max_tokens=1, kv_transfer_params=dict(ASK)))
            for p in PROMPTS[:3]]

    def edit(i, **kw):
        return {**good[i], **kw}
    cases = {
        "not an object": (PROMPTS[1], [1, 2], "kv_transfer_params"),
        "no grant": (PROMPTS[1], {k: v for k, v in good[1].items() if k != "kvabi_grant"},
                     "kvabi_grant"),
        "bad nonce": (PROMPTS[1], edit(1, kvabi_grant={"slot": 0, "nonce": "zz"}),
                      "kvabi_grant.nonce"),
        "forged nonce": (PROMPTS[1], edit(1, kvabi_grant={**good[1]["kvabi_grant"],
                                                          "nonce": "ab" * 16}), "kvabi_grant"),
        "another prompt": (PROMPTS[2][::-1], good[2], "kvabi_grant"),
        "blocks": (PROMPTS[1], edit(1, remote_block_ids=[[10**6] * len(
            good[1]["remote_block_ids"][0])]), "remote_block_ids[0][0]"),
    }
    with cf.ThreadPoolExecutor(len(cases) + 1) as ex:
        honest = ex.submit(complete, urls["t"], PROMPTS[0], kv_transfer_params=good[0])
        bad = {k: ex.submit(complete, urls["t"], p, kv_transfer_params=params)
               for k, (p, params, _) in cases.items()}
    k = TOKENS_EQUAL[pair["dtype"]]
    own = token_ids(complete(urls["t"], PROMPTS[0]))[1]
    assert token_ids(honest.result())[1][:k] == own[:k]
    for what, f in bad.items():
        status, got = f.result()
        assert status == 500, (what, status, got)
        assert got["error"]["message"].startswith(cases[what][2]), (what, got)
    # a replay of the honest answer
    status, got = complete(urls["t"], PROMPTS[0], kv_transfer_params=good[0])
    assert status == 500 and got["error"]["message"].startswith("kvabi_grant"), got
    # the forged ones freed nothing: their producer still holds good[1] for its consumer
    assert token_ids(complete(urls["t"], PROMPTS[1], kv_transfer_params=good[1]))[1][:k] == \
        token_ids(complete(urls["t"], PROMPTS[1]))[1][:k]
    # a producer that died before the consumer read it, and one that never publishes
    ids = token_ids(complete(urls["t"], PROMPTS[4], max_tokens=1))[0]
    dead, frozen = reference(pair, "producer", "dying"), reference(pair, "producer", "frozen")
    # (the kit's reference engine: its KV is not the model's, the pulls never get that far)
    answers = {"dead": dead.prefill([ids])[0], "frozen": frozen.prefill([ids])[0]}
    try:
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(2) as ex:
            got = {k: ex.submit(complete, urls["t"], PROMPTS[4], kv_transfer_params=a)
                   for k, a in answers.items()}
        took = time.monotonic() - t0
        for what, f in got.items():
            status, body = f.result()
            assert status == 500, (what, status, body)
        assert "pull_timeout_s" in got["frozen"].result()[1]["error"]["message"]
        assert took < PULL_TIMEOUT + 20, took
    finally:
        frozen.stop()
    assert token_ids(complete(urls["t"], PROMPTS[2]))  # the next request is served
    wait_idle(urls["t"])


def wait_idle(url, timeout=90.0):
    keep = ("peers", "pull_stats", "used_grants", "answers", "refusals")  # bounded history
    deadline = time.monotonic() + timeout
    while True:
        tables = status(url)["pd"]["tables"]
        busy = {k: v for k, v in tables.items() if v and k not in keep}
        if not busy:
            return
        assert time.monotonic() < deadline, f"{url} still holds {busy} after {timeout:g} s"
        time.sleep(1)
