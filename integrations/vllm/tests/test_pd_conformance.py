"""vLLM's adapter passes kvabi's P/D conformance kit (specs/pd.md section 12): a vLLM engine
with KvabiConnector (its CPU attention, 32-token blocks; one engine process per role) against
kvabi's reference producers and consumers of other layouts, block sizes and TP sizes, hostile
ones included.  And a fault planted in the adapter (it tells vLLM a pull is done as soon as it
is queued) is caught."""
import pytest

from kvabi.testing import PDConformance
from kvabi.testing.pd import run_kit
from kvabi.transfer import nixl

from kvabi_vllm.tools.pd_kit import VllmEngine

ok, why = nixl.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)


class TestVllmAdapter(PDConformance):
    def make_engine(self):
        return VllmEngine()


def test_a_fault_planted_in_vllms_adapter_is_caught():
    (r,) = run_kit(VllmEngine(planted="early_done"), ["consumer.hostile"])
    assert not r.ok
    # a corrupting producer's request was reported done (vLLM would compute from its KV)
    assert any(p.startswith("a corrupt producer: accepted") for p in r.problems), r.problems
