"""KV-shared layers (Gemma 4) never write, and prefill skip changes no token."""
import pytest
import kvabi
import kvabi_transformers
from kvabi.backend.reference import ReferenceBackend
from kvabi_transformers.model_kv import config_dict
from kvabi_transformers.tools.compare import cb_config, run_batch, worst_step_error

from tf_cases import NEW_TOKENS, baseline, model_of, prompts


class Spy(ReferenceBackend):
    """The reference backend, recording the (kind, layer) of every write and attention."""

    name = "reference"

    def __init__(self):
        super().__init__()
        self.writes, self.reads = [], []

    def write(self, plan, layer, **kw):
        self.writes.append((plan.spec.kind, layer))
        return super().write(plan=plan, layer=layer, **kw)

    def attend(self, plan, layer, **kw):
        self.reads.append((plan.spec.kind, layer))
        return super().attend(plan=plan, layer=layer, **kw)


def test_shared_layers_never_write(sessions):
    model = model_of("gemma4")
    mkv = kvabi.ModelKV.from_hf_config(config_dict(model.config), kv_dtype="float32")
    # layers 0 (sliding) and 1 (full) own caches; 2 and 3 read them
    assert mkv.shared_layers == {"layers.2": "layers.0", "layers.3": "layers.1"}
    spy = Spy()
    kvabi_transformers.use(model, spy)
    tokens, _ = run_batch(model, prompts(), NEW_TOKENS, config=cb_config(), logits=False)
    assert tokens == baseline("gemma4")[0]
    steps = sessions[-1].stats["steps"]
    assert steps >= NEW_TOKENS
    # one write per owner per step, in each group's only layer (plus the one write per
    # cache of verify_layout when the caches are made); every layer attends
    assert sorted(set(spy.writes)) == [("full", 0), ("sliding_window", 0)]
    assert len(spy.writes) == 2 * steps + 2
    assert len(spy.reads) == 4 * steps


@pytest.mark.parametrize("backend,layout", [("reference", None), ("tpu.jax", "tpu.combined")])
def test_prefill_skip_same_tokens(backend, layout, sessions):
    ok, why = kvabi.get_backend(backend).available()
    if not ok:
        pytest.skip(why)
    want_tokens, want_logits = baseline("gemma4")
    model = kvabi_transformers.use(model_of("gemma4"), backend, layout, prefill_skip=True)
    tokens, logits = run_batch(model, prompts(), NEW_TOKENS, config=cb_config())
    assert tokens == want_tokens
    assert worst_step_error(logits, want_logits) <= 1e-5
    stats = sessions[-1].stats
    # The prefill step ran the shared layers on 7 rows instead of every prompt token.
    assert stats["skipped_rows"] == sum(len(p) for p in prompts()) - len(prompts())


def test_prefill_skip_refused_without_shared_layers():
    with pytest.raises(kvabi.KVABIError, match="prefill_skip: llama has no KV-shared"):
        kvabi_transformers.use(model_of("llama"), prefill_skip=True)


def test_gemma4_wider_full_layers_match_generate():
    # Full-attention layers with their own head size (global_head_dim 32 vs 16): two KV
    # groups of different shapes.  transformers' own continuous batching cannot size its
    # cache for this model, so the oracle is its plain `generate`, prompt by prompt.
    import torch
    from kvabi_transformers.tools.tiny_models import tiny_model

    model = tiny_model("gemma4", layers=4, seed=1, global_head_dim=32)
    want = []
    for p in prompts():
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    assert len({t for seq in want for t in seq}) > 5, want  # varied continuations
    kvabi_transformers.use(model, "reference", prefill_skip=True)
    specs = [g.spec.head_dim for g in model._kvabi_integration.model_kv.groups]
    assert sorted(specs) == [16, 32]
    tokens, _ = run_batch(model, prompts(), NEW_TOKENS, config=cb_config(), logits=False)
    assert tokens == want


def test_prefill_skip_never_returns_other_rows(monkeypatch):
    # If the model stopped calling the slicing hook, the step must fail, not answer with
    # the logits of other tokens.
    model = kvabi_transformers.use(model_of("gemma4"), prefill_skip=True)
    base = model.model
    monkeypatch.setattr(base, "_maybe_slice_kv_shared_inputs",
                        lambda h, p, e, m, k, past_key_values=None, **kw: (h, p, e, m))
    with pytest.raises(RuntimeError, match="generate_batch failed.*did not run its KV-shared"):
        run_batch(model, prompts(), NEW_TOKENS, config=cb_config(), logits=False)
