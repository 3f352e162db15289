"""P/D between transformers' continuous-batching engines in this process, over NIXL
(loopback), through kvabi.pd: both roles, different backends, layouts and block sizes on
the two sides, and what a consumer must refuse.

Engines (one tiny random Llama, the same weights everywhere; shared by the module):
``ref`` on the numpy reference backend (vllm.LBHNC, 16-token blocks) and ``torch`` on
example.torch (flash_attn planes, 32-token blocks), both kv_both.  The greedy tokens of a
request prefilled by one and decoded by the other equal the decoding engine's own; the KV
the decoding engine pulled equals, layer by layer, the KV it computes itself for the same
prompt (read from its own held blocks: a wrong head order or a shifted block would differ);
refused, forged, replayed parameters and a producer that died fail that request alone,
within the deadline, and afterwards nothing is held, pulled or waiting anywhere.
"""
import time

import numpy as np
import pytest

from kvabi.pd import ASK
from kvabi_transformers.connector import model_identity
from kvabi_transformers.connector.producer import HELD
from kvabi.pd import PDSettings
from kvabi.testing.pd import ModelFacts, ReferenceEngine
from kvabi_transformers.tools.pd_values import request_floats
from kvabi_transformers.tools.tiny_models import tiny_prompts

from pd_cases import NEW_TOKENS, generate, idle, manager, results, wait_until

pytest.importorskip("nixl")
PULL_TIMEOUT = 6.0
HOLD_TIMEOUT = 20.0


@pytest.fixture(scope="module")
def engines():
    opts = {"pull_timeout_s": PULL_TIMEOUT, "hold_timeout_s": HOLD_TIMEOUT}
    ref = manager("reference", "vllm.LBHNC", 16, **opts)
    torch_ = manager("example.torch", "flash_attn", 32, **opts)
    yield {"ref": ref, "torch": torch_}
    for m in (ref, torch_):
        m.stop(block=True, timeout=30)


def prompts():
    return tiny_prompts(4, lengths=(9, 23, 40, 57), shared_prefix=0, seed=3)


def prefill(producer, ps, tag):
    """The producer's answers for ``ps`` (each prefilled, one token, held)."""
    out = generate(producer, ps, tag, params=[dict(ASK)] * len(ps), max_new_tokens=1)
    answers = [out[f"{tag}{i}"].kv_transfer_params for i in range(len(ps))]
    assert all(isinstance(a, dict) and a["do_remote_prefill"] for a in answers), answers
    return answers


def tokens(out, tag, n):
    return [out[f"{tag}{i}"].generated_tokens for i in range(n)]


@pytest.mark.parametrize("direction", [("ref", "torch"), ("torch", "ref")])
def test_tokens_equal_the_decoding_engines_own(engines, direction):
    producer, consumer = (engines[d] for d in direction)
    ps = prompts()
    tag = "".join(direction)
    answers = prefill(producer, ps, f"{tag}-p")
    before = consumer.batch_processor.cache.kvabi.stats["tokens"]
    pd = generate(consumer, ps, f"{tag}-d", params=answers)
    computed = consumer.batch_processor.cache.kvabi.stats["tokens"] - before
    own = generate(consumer, ps, f"{tag}-s")
    assert all(o.error is None for o in pd.values()), [o.error for o in pd.values()]
    want = tokens(own, f"{tag}-s", len(ps))
    assert tokens(pd, f"{tag}-d", len(ps)) == want
    assert min(len(set(t)) for t in want) > 2  # varied continuations: the check means something
    # the prompt was not computed again: its last token and the new ones only
    assert computed == len(ps) * NEW_TOKENS
    wait_until(lambda: idle(producer) and idle(consumer), "both engines hold nothing")


def test_pulled_kv_equals_the_kv_the_consumer_computes(engines):
    producer, consumer = engines["ref"], engines["torch"]
    ps = prompts()
    conn = consumer.connector
    pulled = {}
    resume = conn.consumer.resume

    def snapshot(state, n):  # the pulled KV, read before the request computes anything
        alloc = next(iter(conn.cache.cache_allocators.values()))
        blocks = conn.caches.kvabi_blocks(alloc.block_table[state.request_id])[0]
        pulled[state.request_id] = request_floats(conn.caches.caches[0], blocks, n)
        resume(state, n)

    conn.consumer.resume = snapshot
    try:
        generate(consumer, ps, "kv-d", params=prefill(producer, ps, "kv-p"))
    finally:
        conn.consumer.resume = resume
    # the consumer computes the same prompts itself and holds their blocks (as a producer)
    own = prefill(consumer, ps, "kv-own")
    alloc = next(iter(conn.cache.cache_allocators.values()))
    for i, (p, answer) in enumerate(zip(ps, own)):
        blocks = conn.caches.kvabi_blocks(alloc.block_table[HELD + f"kv-own{i}"])[0]
        mine = request_floats(conn.caches.caches[0], blocks, len(p))
        got = pulled[f"kv-d{i}"]
        assert got.shape == mine.shape == (2, 2, len(p), 2, 16)
        for layer in range(got.shape[0]):
            np.testing.assert_allclose(got[layer], mine[layer], rtol=1e-4, atol=1e-4,
                                       err_msg=f"prompt {i} layer {layer}")
        # a wrong head order or a block shifted by one would not pass this comparison
        assert not np.allclose(got[:, :, :, ::-1], mine, rtol=1e-4, atol=1e-4)
        assert not np.allclose(got[:, :, 1:], mine[:, :, :-1], rtol=1e-4, atol=1e-4)
    # nobody pulls the consumer's own held blocks: hold_timeout_s frees them
    wait_until(lambda: idle(consumer), "the consumer's own grants expire",
               timeout=HOLD_TIMEOUT + 30)


def reference_producer(consumer, prompt, fault):
    """The P/D kit's reference engine (numpy caches, the consumer's model identity and
    shapes) as a producer with ``fault`` (``dying``: gone once it answered; ``frozen``: never
    writes its grant record): (the engine, its answer for ``prompt``)."""
    identity = model_identity(consumer.model.config.get_text_config())
    ref = ReferenceEngine(ModelFacts(num_layers=2, num_kv_heads=2, head_dim=16, vocab=128,
                                     block_size=16, model_id=identity), fault=fault)
    ref.start("producer", PDSettings(role="producer"))
    (answer,) = ref.prefill([prompt])
    return ref, answer


def failed(out, rid):
    o = out[rid]
    assert o.error is not None, (rid, o.generated_tokens)
    return o.error


def test_malformed_forged_and_replayed_parameters_fail_alone(engines):
    producer, consumer = engines["ref"], engines["torch"]
    ps = prompts()
    good = prefill(producer, ps[:3], "bad-p")
    honest = dict(good[0])

    def edit(**kw):
        a = dict(good[1])
        a.update(kw)
        return a
    cases = {  # request id suffix: (prompt, params, the refusal's field)
        "list": (ps[1], [1, 2], "kv_transfer_params"),
        "nofield": (ps[1], {k: v for k, v in good[1].items() if k != "kvabi_grant"},
                    "kvabi_grant"),
        "nonce": (ps[1], edit(kvabi_grant={"slot": 0, "nonce": "zz"}), "kvabi_grant.nonce"),
        "slot": (ps[1], edit(kvabi_grant={"slot": 10**6, "nonce": "0" * 32}),
                 "kvabi_grant.slot"),
        "block": (ps[1], edit(remote_block_ids=[[10**6] * len(good[1]["remote_block_ids"][0])]),
                  "remote_block_ids[0][0]"),
        "tokens": (ps[1], edit(remote_num_tokens=10**6), "remote_num_tokens"),
        "other": (ps[3][:len(ps[2])], dict(good[2]), "kvabi_grant"),   # another prompt
        "forged": (ps[1], edit(kvabi_grant={"slot": good[1]["kvabi_grant"]["slot"],
                                            "nonce": "ab" * 16}), "kvabi_grant"),
    }
    ids = {f"bad-{k}": v for k, v in cases.items()}
    for rid, (p, params, _) in ids.items():
        consumer.add_request(p, request_id=rid, max_new_tokens=4, kv_transfer_params=params)
    consumer.add_request(ps[0], request_id="bad-honest", max_new_tokens=4,
                         kv_transfer_params=honest)
    out = results(consumer, list(ids) + ["bad-honest"], "refused and honest requests")
    for rid, (_, _, field) in ids.items():
        assert failed(out, rid).startswith(field), (rid, out[rid].error)
    assert out["bad-honest"].error is None
    own = generate(consumer, [ps[0]], "bad-own", max_new_tokens=4)
    assert out["bad-honest"].generated_tokens == own["bad-own0"].generated_tokens
    # the same answer again (a replay), once it was pulled
    consumer.add_request(ps[0], request_id="bad-replay", max_new_tokens=4,
                         kv_transfer_params=honest)
    err = failed(results(consumer, ["bad-replay"], "a replayed grant"), "bad-replay")
    assert err.startswith("kvabi_grant") and ("already" in err), err
    # the forged ones freed nothing: good[1] is still held until its own consumer reads it
    generate(consumer, [ps[1]], "bad-late", params=[good[1]], max_new_tokens=4)
    wait_until(lambda: idle(producer) and idle(consumer), "both engines hold nothing",
               timeout=HOLD_TIMEOUT + 30)


def test_a_dying_or_frozen_producer_fails_the_request_within_the_deadline(engines):
    consumer = engines["torch"]
    ps = prompts()
    dead, dead_answer = reference_producer(consumer, ps[1], "dying")
    frozen, frozen_answer = reference_producer(consumer, ps[2], "frozen")
    t0 = time.monotonic()
    consumer.add_request(ps[1], request_id="dead", max_new_tokens=4,
                         kv_transfer_params=dead_answer)
    consumer.add_request(ps[2], request_id="frozen", max_new_tokens=4,
                         kv_transfer_params=frozen_answer)
    consumer.add_request(ps[0], request_id="alive", max_new_tokens=4)
    out = results(consumer, ["dead", "frozen", "alive"], "requests to a dead, a frozen "
                  "and no producer", timeout=PULL_TIMEOUT + 60)
    took = time.monotonic() - t0
    assert out["alive"].error is None
    assert failed(out, "dead") and failed(out, "frozen")
    assert "pull_timeout_s" in out["frozen"].error, out["frozen"].error
    assert took < PULL_TIMEOUT + 10, took
    frozen.stop()
    wait_until(lambda: idle(consumer), "the consumer holds nothing")


def test_a_request_cancelled_while_pulling_keeps_its_blocks_until_the_pull_ends(engines):
    consumer = engines["torch"]
    ps = prompts()
    frozen, answer = reference_producer(consumer, ps[3], "frozen")
    conn = consumer.connector
    alloc = next(iter(conn.cache.cache_allocators.values()))
    consumer.add_request(ps[3], request_id="cancel", max_new_tokens=4, kv_transfer_params=answer)
    wait_until(lambda: "cancel" in conn.consumer.pulling, "the pull of 'cancel' started")
    consumer.cancel_request("cancel")
    wait_until(lambda: "cancel" in conn.consumer.cancelled, "'cancel' marked cancelled")
    assert "cancel" in alloc.block_table  # a late READ may not land in reused blocks
    wait_until(lambda: "cancel" not in alloc.block_table, "the pull given up, blocks freed",
               timeout=PULL_TIMEOUT + 30)
    assert consumer.get_result("cancel", timeout=0.5) is None  # nothing delivered
    frozen.stop()
    wait_until(lambda: idle(consumer), "the consumer holds nothing")


def test_a_grant_nobody_reads_expires_and_frees_the_blocks(engines):
    producer = engines["ref"]
    conn = producer.connector
    alloc = next(iter(conn.cache.cache_allocators.values()))
    prefill(producer, prompts()[:1], "expire")
    assert HELD + "expire0" in alloc.block_table
    wait_until(lambda: HELD + "expire0" not in alloc.block_table, "the grant expires",
               timeout=HOLD_TIMEOUT + 30)
    wait_until(lambda: idle(producer), "the producer holds nothing")


def test_bfloat16_between_layouts_and_block_sizes_gives_the_decoders_own_tokens():
    """In bfloat16 two engines computing the same KV (one backend) and holding it in other
    layouts and block sizes: P/D tokens equal the decoder's own exactly, both ways (across
    engine makes each rounds its own KV: integrations/pd/tests)."""
    opts = {"pull_timeout_s": PULL_TIMEOUT, "hold_timeout_s": HOLD_TIMEOUT}
    a = manager("reference", "vllm.LBHNC", 16, dtype="bfloat16", **opts)
    b = manager("reference", "flashinfer.HND", 32, dtype="bfloat16", **opts)
    try:
        ps = prompts()
        for producer, consumer, tag in ((a, b, "ab"), (b, a, "ba")):
            pd = generate(consumer, ps, f"bf-{tag}-d", params=prefill(producer, ps, f"bf-{tag}-p"))
            own = generate(consumer, ps, f"bf-{tag}-s")
            assert all(o.error is None for o in pd.values())
            assert tokens(pd, f"bf-{tag}-d", len(ps)) == tokens(own, f"bf-{tag}-s", len(ps)), tag
        wait_until(lambda: idle(a) and idle(b), "both engines hold nothing")
    finally:
        for m in (a, b):
            m.stop(block=True, timeout=30)
