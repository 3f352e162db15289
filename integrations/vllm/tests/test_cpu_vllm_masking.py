"""``cpu.vllm`` masks per query: a NaN value row in a block two requests share, seen by the
first queries of one request's window and by no query of the other, and a NaN in the
step's own values (past the causal bound of the queries before it) reach exactly the
queries that see them (their output NaN); every other query equals the reference on the
clean inputs.  In the layout whose keys are read in place and in one copied whole."""
import numpy as np
import pytest

import kvabi
from kvabi.testing.cases import AttentionCase
from kvabi.testing.harness import Runner, step_inputs

from kvabi_vllm.cpu_backend import CpuVllmBackend

W, BS = 8, 16


def _case(layout_name):
    spec = kvabi.KVSpec("sliding_window", block_size=BS, num_kv_heads=2, head_dim=32,
                        dtype="float32", window=W)
    # request 0: a decode at position 40; request 1: 8 new tokens at 20..27; both read
    # block 0 (their shared prefix)
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        [1, 8], [40, 20], [[0, 1, 2], [0, 3, 0]], BS, num_blocks=4)
    layout = kvabi.Layout.preset(layout_name, spec, num_blocks=4)
    return AttentionCase(spec, layout, meta, num_q_heads=4, seed=5)


def _sees(meta, slot_of, token: int, j: int) -> bool:
    """The semantics: token's request reads position j, within its window and causal."""
    p = int(meta.positions[token])
    return slot_of(token, j) is not None and max(0, p - W + 1) <= j <= p


@pytest.mark.parametrize("layout_name", ["vllm.cpu_kt", "vllm.LBHNC"])
def test_a_poisoned_row_reaches_exactly_the_queries_that_see_it(layout_name):
    case = _case(layout_name)
    meta, i = case.meta, case.inputs()
    k, v, q = step_inputs(case)
    clean = Runner(kvabi.get_backend("reference"), case, oracle=True)
    plan = clean.plan(meta)
    clean.write(plan, k, v)
    want = clean.attend(plan, q)[0]

    pv = i.pool_v.copy()
    pv[0, 0 * BS + 14, 1] = np.nan  # block 0 row 14, head 1: request 1 at 20, 21 sees it
    v2 = v.copy()
    v2[1 + 5, 0] = np.inf  # request 1's token at position 25, head 0
    b = Runner(CpuVllmBackend(), case, oracle=False, pool=(i.pool_k, pv))
    bplan = b.plan(meta)
    b.write(bplan, k, v2)
    got = b.attend(bplan, q)[0]

    def slot_of(t, j):
        r = int(meta.token_request[t])
        return j if j < int(meta.seq_lens[r]) else None

    nan = np.zeros((meta.num_actual_tokens, 4), bool)  # [token, query head]
    for t in range(meta.num_actual_tokens):  # a test oracle: one token at a time
        if int(meta.token_request[t]) == 1:
            nan[t, 2:] |= _sees(meta, slot_of, t, 14)   # KV head 1 -> query heads 2, 3
            nan[t, :2] |= _sees(meta, slot_of, t, 25)   # KV head 0 -> query heads 0, 1
    assert nan.any() and (~nan).any()
    assert np.isnan(got[:meta.num_actual_tokens][nan]).all()
    ok = ~nan
    np.testing.assert_allclose(got[:meta.num_actual_tokens][ok],
                               want[:meta.num_actual_tokens][ok], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_merge_entries_is_any_and_all_over_the_pairs_of_an_entry(shared):
    """Per distinct block: the rows some reader sees (any), and those every reader sees
    (all), against a loop over the entries; with and without blocks read twice."""
    from kvabi_vllm.cpu_masking import merge_entries

    rng = np.random.default_rng(int(shared))
    for _ in range(200):
        n, bs = int(rng.integers(1, 30)), int(rng.integers(1, 9))
        ne = int(rng.integers(1, n + 1)) if shared else n
        inv = np.concatenate([np.arange(ne), rng.integers(0, ne, n - ne)])
        rng.shuffle(inv)
        some, every = rng.random((n, bs)) < 0.5, rng.random((n, bs)) < 0.5
        s, e = merge_entries(some, every, inv, ne)
        for k in range(ne):
            assert (s[k] == some[inv == k].any(0)).all()
            assert (e[k] == every[inv == k].all(0)).all()
