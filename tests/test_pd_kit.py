"""The P/D kit (specs/pd.md section 12) against kvabi's reference engine: an honest engine
passes every check (two KV cache groups, one of them a sliding window whose dropped blocks
travel as the null block), and a fault planted in an engine's adapter is caught by the
check that covers it.  Skipped without NIXL."""
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
