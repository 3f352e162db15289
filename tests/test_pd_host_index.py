"""The host tier's index without an engine: a hit needs the request's own tokens (a key
alone, even a colliding one, is not trusted), ``cache_salt`` and the engine's seed separate
tenants and engines, memory is bounded with least-recently-used eviction that keeps what
is being saved; and its restorable prefix equals a direct formula."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvabi.pd.host_index import HostIndex, chain_keys

BS = 4


def _index(cap=8, groups=1, seed=b"model|fp"):
    return HostIndex(groups, cap, seed)


def _add_prompt(ix, toks, salt=None, held=(True,)):
    keys, parents, blocks = chain_keys(ix.seed, salt, toks, BS)
    evicted = []
    for k, p, b in zip(keys, parents, blocks):
        got = ix.add(k, p, b, held)
        assert got is not None
        evicted += got
    ix.touch(keys)  # as the scheduler side does after a save
    return keys, evicted


def _hit(ix, toks, salt=None, need=(1 << 40,)):
    return ix.hit(*chain_keys(ix.seed, salt, toks, BS), np.array(need))


def test_a_hit_is_the_longest_prefix_of_the_requests_own_tokens():
    ix = _index()
    toks = list(range(100, 120))  # 5 blocks
    _add_prompt(ix, toks)
    assert _hit(ix, toks) == 5
    other = toks[:9] + [7] + toks[10:]  # differs in block 2
    assert _hit(ix, other) == 2
    assert _hit(ix, toks[:7]) == 1


def test_salt_and_seed_separate_tenants_and_engines():
    ix = _index()
    toks = list(range(16))
    _add_prompt(ix, toks, salt="tenant-a")
    assert _hit(ix, toks, salt="tenant-a") == 4
    assert _hit(ix, toks, salt="tenant-b") == 0
    assert _hit(ix, toks) == 0
    other = HostIndex(1, 8, b"model|other-layout")
    assert other.hit(*chain_keys(other.seed, "tenant-a", toks, BS), np.array([1 << 40])) == 0


def test_a_colliding_key_is_not_trusted():
    """An entry found under the request's key but holding other tokens or another parent
    (what a chosen hash collision gives) is no hit."""
    ix = _index()
    victim = list(range(50, 58))
    keys, parents, blocks = chain_keys(ix.seed, None, victim, BS)
    attacker = list(range(200, 208))
    _, _, ablocks = chain_keys(ix.seed, None, attacker, BS)
    ix.add(keys[0], parents[0], ablocks[0], (True,))  # the attacker's bytes, the victim's key
    assert _hit(ix, victim) == 0
    ix2 = _index()
    ix2.add(keys[0], parents[0], blocks[0], (True,))
    ix2.add(keys[1], b"\x00" * 16, blocks[1], (True,))  # right tokens, another parent
    assert _hit(ix2, victim) == 1


def test_bounded_with_lru_eviction_that_keeps_pending_saves():
    ix = _index(cap=6)
    a, b = list(range(0, 12)), list(range(100, 112))  # 3 blocks each
    ka, _ = _add_prompt(ix, a)
    kb, _ = _add_prompt(ix, b)
    assert len(ix) == 6 and ix.used.tolist() == [6]
    assert _hit(ix, a) == 3  # a becomes the most recently used
    c = list(range(300, 308))
    kc, evicted = _add_prompt(ix, c)
    # b's deepest blocks go first (a hit touches a prefix's first block last)
    assert evicted == [kb[2], kb[1]] and len(ix) == 6 and ix.used.tolist() == [6]
    assert _hit(ix, b) == 1 and _hit(ix, a) == 3
    keys, parents, blocks = chain_keys(ix.seed, None, list(range(400, 404)), BS)
    every = set(ka) | set(kc) | {kb[0]}
    assert ix.add(keys[0], parents[0], blocks[0], (True,), keep=every) is None  # all pending
    assert len(ix) == 6


def test_many_prompts_stay_within_capacity_per_group():
    ix = _index(cap=20, groups=2)
    rng = np.random.default_rng(0)
    for i in range(300):
        toks = rng.integers(0, 50, size=int(rng.integers(4, 40))).tolist()
        held = (True, bool(i % 2))
        keys, parents, blocks = chain_keys(ix.seed, str(i % 3), toks, BS)
        for k, p, b in zip(keys, parents, blocks):
            if k not in ix:
                ix.add(k, p, b, held)
        assert (ix.used <= 20).all()
    assert len(ix) <= 40


@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=3),
       st.data())
def test_present_and_hit_follow_the_usable_prefix_formula(rows, data):
    """Build entries block by block as ``rows`` say each group holds them; the hit is the
    longest k whose last need[g] blocks every group holds."""
    g = len(rows)
    ix = HostIndex(g, 100, b"s")
    toks = list(range(24))
    keys, parents, blocks = chain_keys(ix.seed, None, toks, BS)
    held_any = [any(r[i] for r in rows) for i in range(6)]
    for i in range(6):
        if held_any[i]:
            ix.add(keys[i], parents[i], blocks[i], tuple(r[i] for r in rows))
    need = [data.draw(st.sampled_from([1, 2, 1 << 40])) for _ in rows]

    def ok(k):
        return all(all(row[i] for i in range(max(k - nb, 0), k)) for row, nb in zip(rows, need))

    assert ix.hit(keys, parents, blocks, np.array(need)) == max(k for k in range(7) if ok(k))
