"""The P/D kit (specs/pd.md section 12) against kvabi's reference engine: an honest engine
passes every check (two KV cache groups, one of them a sliding window whose dropped blocks
travel as the null block), and a fault planted in an engine's adapter is caught by the
check that covers it.  Skipped without NIXL."""
import numpy as np
import pytest

from kvabi.testing import PDConformance
from kvabi.testing.pd import ModelFacts, ReferenceEngine, run_kit
from kvabi.transfer import nixl

ok, why = nixl.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

FACTS = ModelFacts(windows=(None, 24), num_layers=2, num_kv_heads=2, head_dim=16,
                   block_size=32)


class TestAnHonestEngine(PDConformance):
    def make_engine(self):
        return ReferenceEngine(FACTS, preset="flashinfer.HND", label="engine")


@pytest.mark.parametrize("planted,check,problem", [
    # the adapter states keys where the engine writes values: consumers get other KV
    ("swapped_kv", "producer.honest", "key head 0: token 0 differs"),
    # it tells kvabi other destination blocks than the engine's: the KV is not where the
    # engine reads it
    ("shifted_blocks", "consumer.honest", "differs"),
    # it frees a granted request's blocks at once: the next request overwrites them
    ("early_free", "producer.honest", "token 0 differs"),
])
def test_a_fault_planted_in_an_adapter_is_caught(planted, check, problem):
    (r,) = run_kit(ReferenceEngine(FACTS, preset="flashinfer.HND", label="engine",
                                   planted=planted), [check])
    assert not r.ok and any(problem in p for p in r.problems), r.problems


def test_a_component_layout_moves_between_tp_sizes_byte_exact():
    """An engine whose cache is in the component form (vLLM's CPU layout: keys [D, N], values
    [N, D] per block and head) pulls from and serves TP-2 references of other layouts."""
    got = run_kit(ReferenceEngine(FACTS, preset="vllm.cpu", label="engine"),
                  ["consumer.honest", "producer.honest"])
    assert [r.name for r in got] == ["consumer.honest", "producer.honest"]
    assert all(r.ok for r in got), [r.problems for r in got]
    assert any("TP 2" in n for n in got[0].notes)


def test_kv_values_reads_each_token_through_the_layouts_own_views():
    """The kit's oracle of "the same KV": the bytes of each slot's token per layer and head,
    as indexing the cache's K and V views directly gives them (no deprecated call)."""
    import warnings

    from kvabi import KVCache, KVSpec, Layout
    from kvabi.testing.pd import kv_values

    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    cache = KVCache.allocate(Layout.preset("vllm.LBHNC", spec, 5, 3))
    rng = np.random.default_rng(0)
    for layer in range(3):
        for kv in range(2):
            view = cache.kv_view(layer, kv)  # [B, N, H, D]
            view[...] = rng.standard_normal(view.shape).astype(np.float32)
    slots = [5, 0, -1, 19]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kv_values(cache, slots)
    assert list(got["_held"]) == [True, True, False, True]
    for kv, name in enumerate(("key", "value")):
        for head in range(2):
            for i, s in enumerate(slots):
                want = (np.zeros((3, 8), np.float32) if s < 0 else np.stack(
                    [cache.kv_view(layer, kv)[s // 4, s % 4, head] for layer in range(3)]))
                assert got[name][head][i].tobytes() == want.tobytes(), (name, head, s)
