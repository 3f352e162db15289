"""Plans are made once per step and KV group and reused by every layer, each layer's sinks
coming with its attention call."""
from kvabi.backend.reference import ReferenceBackend
import kvabi_transformers
from kvabi_transformers.tools.compare import cb_config, run_batch, worst_step_error
from kvabi_transformers.tools.tiny_models import tiny_model

from tf_cases import NEW_TOKENS, prompts

_WANT = {}


def gpt_oss4():
    return tiny_model("gpt_oss", layers=4, seed=2)  # two layers per KV group


def want():
    if not _WANT:
        _WANT["r"] = run_batch(gpt_oss4(), prompts(), NEW_TOKENS, config=cb_config())
    return _WANT["r"]


class Counting(ReferenceBackend):
    """The reference backend counting plans and the sinks each attention call gets."""

    name = "reference"

    def __init__(self):
        super().__init__()
        self.plans, self.call_sinks = 0, 0

    def prepare(self, plan):
        self.plans += 1
        return super().prepare(plan)

    def attend(self, sinks, **kw):
        self.call_sinks += sinks is not None
        return super().attend(sinks=sinks, **kw)


def test_plans_per_step(sessions):
    backend = Counting()
    model = kvabi_transformers.use(gpt_oss4(), backend)
    tokens, logits = run_batch(model, prompts(), NEW_TOKENS, config=cb_config())
    want_tokens, want_logits = want()
    assert tokens == want_tokens
    assert worst_step_error(logits, want_logits) <= 1e-5
    steps = sessions[-1].stats["steps"]
    # plus verify_layout's when the caches are made: per KV group (2), one write and so one
    # plan for each of its 2 samples (layer 0's first slot, layer 1's last)
    assert backend.plans == 2 * steps + 2 * 2
    assert backend.call_sinks == 4 * steps
