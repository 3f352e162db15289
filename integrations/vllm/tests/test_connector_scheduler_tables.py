"""KvabiConnector's scheduler side over a few hundred requests, driven as vLLM's scheduler
drives it (enter, allocate, build the step, finish), honest and hostile mixed: every
refusal reaches the worker side as that request's failure with its reason, honest pulls
and grants go through, and every per-request table is empty again (or bounded) after."""
import types

import numpy as np
import pytest

import kvabi
from kvabi.transfer.handshake import make_handshake
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvabi.pd.record import table_layout
from kvabi_vllm.connector.config import ConnectorConfig
from kvabi_vllm.connector.meta import KvabiHandshakeMetadata
from kvabi_vllm.connector.scheduler import KvabiConnectorScheduler

BS = 16


def _msg(layout):
    return make_handshake(agent_name="producer", host="127.0.0.1", port=5555, memory="DRAM",
                          layout=layout, planes=[(1 << 20, layout.plane_nbytes, 0)])


SPEC = kvabi.KVSpec("full", block_size=BS, num_kv_heads=2, head_dim=32, dtype="float32")
KV = _msg(kvabi.Layout.preset("vllm.LBHNC", SPEC, num_blocks=512, num_layers=2))
GRANTS = _msg(table_layout(64, 4096))


def _config(role, **kw):
    return ConnectorConfig(producer=role == "kv_producer", consumer=role == "kv_consumer",
                           engine="e", block_size=BS, groups=(None,), windows=(None,), model="m",
                           max_model_len=1024, **kw)


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def _request(i, prompt, params, salt=None):
    return types.SimpleNamespace(
        request_id=f"req-{i}", prompt_token_ids=prompt, kv_transfer_params=params,
        status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=len(prompt),
        all_token_ids=list(prompt) + [1], cache_salt=salt)


def _remote(i, n, nonce=None):
    return {"kvabi_pd": [1, 0], "do_remote_prefill": True, "remote_num_tokens": n,
            "remote_block_ids": [list(range(1 + i % 200, 1 + i % 200 + -(-n // BS)))],
            "kvabi_handshakes": [{"kv": KV}], "kvabi_grants": GRANTS,
            "kvabi_grant": {"slot": i % 64, "nonce": nonce or f"{i:032x}"}}


def _step(sched, req, num_computed=0):
    count, async_load = sched.get_num_new_matched_tokens(req, num_computed)
    sched.update_state_after_alloc(req, _Blocks(range(100, 100 + 8)), count)
    return count, async_load, sched.build_connector_meta(None)


def test_a_decode_scheduler_over_hundreds_of_requests():
    s = KvabiConnectorScheduler(_config("kv_consumer"))
    rng = np.random.default_rng(0)
    kinds = ["honest", "malformed", "type", "short", "none"]
    seen = {k: 0 for k in kinds}
    for i in range(400):
        kind = kinds[i % len(kinds)]
        n = int(rng.integers(8, 100))
        prompt = list(range(n))
        params = {"honest": _remote(i, n), "malformed": {**_remote(i, n), "remote_block_ids": [[]]},
                  "type": [1, 2], "short": _remote(i, n + 5), "none": None}[kind]
        req = _request(i, prompt, params)
        count, async_load, meta = _step(s, req)
        if kind == "honest":
            assert (count, async_load) == (n, True) and not meta.work.fails
            (pull,) = meta.work.pulls
            assert pull.start == 0 and pull.num_tokens == n and pull.remote.num_tokens == n
        elif kind == "none":
            assert (count, async_load) == (0, False) and not meta.work.fails and not meta.work.pulls
        else:  # refused: an asynchronous load the worker reports failed, with the reason
            assert async_load and count == n and not meta.work.pulls
            (fail,) = meta.work.fails
            want = {"malformed": r"remote_block_ids\[0\]: must list",
                    "type": "kv_transfer_params: must be an object",
                    "short": "remote_num_tokens: .* exceeds this request's prompt"}[kind]
            import re

            assert re.match(want, fail.reason), fail.reason
            # vLLM computes it itself if its policy says recompute: asked again, no refusal
            again = s.get_num_new_matched_tokens(req, 0)
            assert again == (0, False)
        seen[kind] += 1
        assert s.request_finished(req, ([1, 2],)) == (False, None)
        assert s.table_sizes()["entries"] == 0
    assert all(v > 50 for v in seen.values())
    assert s.table_sizes()["refusals"] <= 256


def test_a_prefill_scheduler_holds_at_most_max_held_and_frees_slots():
    s = KvabiConnectorScheduler(_config("kv_producer", max_held=16))
    s.set_xfer_handshake_metadata({0: KvabiHandshakeMetadata([{"kv": KV}], GRANTS, b"")})
    held, refused, slots = [], 0, set()
    for i in range(300):
        req = _request(i, list(range(40)), {"do_remote_decode": True})
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        hold, params = s.request_finished(req, ([7, 8, 9, 10],))
        meta = s.build_connector_meta(None)
        if hold:
            held.append(req.request_id)
            (g,) = meta.work.grants
            assert params["remote_block_ids"] == [[7, 8, 9]]  # 40 tokens of 16: 3 blocks
            assert params["kvabi_grant"] == {"slot": g.slot, "nonce": g.nonce.hex()}
            assert g.tokens != b"" and g.num_tokens == 40
            slots.add(g.slot)
        else:
            refused += 1
            assert params is None and not meta.work.grants
        if i % 40 == 39:  # decode engines read some: their blocks are freed
            done, held = held[:5], held[5:]
            s.update_connector_output(KVConnectorOutput(finished_sending=set(done)))
        assert s.table_sizes()["held"] == len(held) <= 16
    assert refused > 0 and slots <= set(range(16))
    assert s.table_sizes()["entries"] == 0


@pytest.mark.parametrize("salted", [False, True])
def test_a_host_tier_scheduler_is_bounded_and_keyed_by_salt(salted):
    s = KvabiConnectorScheduler(_config("kv_both", host_blocks=32))
    s.set_xfer_handshake_metadata({0: KvabiHandshakeMetadata([], "", b"seed")})
    rng = np.random.default_rng(1)
    base = rng.integers(0, 1000, size=64).tolist()
    first = _request(0, base, None, salt="a")
    assert s.request_finished(first, (list(range(1, 5)),))[0]
    meta = s.build_connector_meta(None)
    assert len(meta.work.saves[0].keys) == 4  # 64 tokens + 1: four full blocks
    probe = _request(1, base + [5], None, salt="b" if salted else "a")
    count, _ = s.get_num_new_matched_tokens(probe, 0)
    assert count == (0 if salted else 64)
    s.request_finished(probe, (list(range(1, 6)),))
    evicted = 0
    for i in range(2, 300):
        toks = rng.integers(0, 1000, size=int(rng.integers(16, 80))).tolist()
        req = _request(i, toks, None if i % 5 else {"kvabi_host": False}, salt="a")
        s.get_num_new_matched_tokens(req, 0)
        s.request_finished(req, (list(range(1, 6)),))
        meta = s.build_connector_meta(None)
        evicted += len(meta.work.evicts)
        if i % 5 == 0:
            assert not meta.work.saves  # opted out
        assert s.table_sizes()["host_entries"] <= 32 and s.table_sizes()["entries"] == 0
    assert evicted > 0


def test_a_tensor_parallel_prefill_scheduler_sends_every_ranks_messages_in_rank_order():
    """Under TP 2 each worker (rank) sends its own messages; a held request's parameters
    list them per place in rank order (whatever order vLLM hands them over), and a decode
    scheduler reads them back as two producer ranks."""
    import attrs

    spec = kvabi.KVSpec("full", block_size=BS, num_kv_heads=1, head_dim=32, dtype="float32")
    lay = kvabi.Layout.preset("vllm.LBHNC", spec, num_blocks=512, num_layers=2)
    kv = [_msg(attrs.evolve(lay, shard=kvabi.Shard.tp(r, 2, 2))) for r in range(2)]
    grants = [_msg(table_layout(64, 4096 + 64 * r)) for r in range(2)]
    s = KvabiConnectorScheduler(_config("kv_producer"))
    s.set_xfer_handshake_metadata({r: KvabiHandshakeMetadata([{"kv": kv[r]}], grants[r], b"")
                                   for r in (1, 0)})
    req = _request(0, list(range(40)), {"do_remote_decode": True})
    s.get_num_new_matched_tokens(req, 0)
    hold, params = s.request_finished(req, ([7, 8, 9, 10],))
    assert hold and params["kvabi_handshakes"] == [{"kv": kv}]
    assert params["kvabi_grants"] == grants
    d = KvabiConnectorScheduler(_config("kv_consumer"))
    back = _request(1, list(range(40)), {**params, "do_remote_prefill": True})
    count, _, meta = _step(d, back)
    (pull,) = meta.work.pulls
    assert count == 40 and pull.remote.ranks == 2 and pull.remote.grants == tuple(grants)
