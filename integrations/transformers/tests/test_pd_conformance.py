"""transformers' continuous batching under the P/D conformance kit
(:class:`kvabi.testing.PDConformance`): every check of ``specs/pd.md``'s kit, consumer and
producer role, against reference peers of other layouts, block sizes and TP sizes; and a
fault planted in the adapter is caught."""
import pytest

from kvabi.testing import PDConformance
from kvabi.testing.pd import run_kit
from kvabi_transformers.tools.pd_kit import TransformersEngine

pytest.importorskip("nixl")


class TestTransformersOnExampleTorch(PDConformance):
    """example.torch, K and V planes (flash_attn), 32-token blocks."""

    def make_engine(self):
        return TransformersEngine("example.torch", "flash_attn", 32)


@pytest.mark.parametrize("planted, check", [("shifted_blocks", "consumer.honest"),
                                            ("early_free", "producer.honest")])
def test_a_fault_planted_in_the_adapter_is_caught(planted, check):
    (result,) = run_kit(TransformersEngine("reference", "vllm.LBHNC", 16, planted=planted),
                        [check])
    assert not result.ok, (planted, check)
