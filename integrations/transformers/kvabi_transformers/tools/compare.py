"""Run ``generate_batch`` and collect what a comparison needs: greedy tokens per prompt and
the logits of every step (the rows the LM head computes, in step order)."""
from __future__ import annotations

import numpy as np


def greedy_config(max_new_tokens: int):
    """A greedy GenerationConfig that never stops early (no EOS)."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                            pad_token_id=0)


def cb_config(max_batch_tokens: int = 512, num_blocks: int | None = 256, page_size=None):
    """A ContinuousBatchingConfig with a small step budget (transformers' default sizes
    its buffers and masks for 8192 tokens per step, slow for tiny CPU runs)."""
    from transformers import ContinuousBatchingConfig

    kw = {"max_batch_tokens": max_batch_tokens, "num_blocks": num_blocks}
    if page_size is not None:
        kw["page_size"] = page_size
    return ContinuousBatchingConfig(**kw)


def run_batch(model, prompts, max_new_tokens: int, *, config=None, logits: bool = True,
              progress_bar: bool = False):
    """(tokens per prompt, [logits of each step as float64 numpy [rows, vocab]])."""
    steps = []
    head = model.get_output_embeddings()
    hook = None
    if logits:
        hook = head.register_forward_hook(
            lambda mod, args, out: steps.append(out.detach().double().reshape(-1, out.shape[-1])
                                                .cpu().numpy()))
    try:
        out = model.generate_batch(inputs=prompts, generation_config=greedy_config(max_new_tokens),
                                   continuous_batching_config=config or cb_config(),
                                   progress_bar=progress_bar)
    finally:
        if hook is not None:
            hook.remove()
    results = list(out.values())
    errors = [r.error for r in results if r.error is not None]
    if errors or len(results) != len(prompts):
        raise RuntimeError(f"generate_batch failed: {len(results)} of {len(prompts)} results, "
                           f"errors: {errors[:2]}")
    return [list(r.generated_tokens) for r in results], steps


def worst_step_error(got, want) -> float:
    """Largest relative L2 error ||got - want|| / ||want|| over the steps' logits (the
    measure of specs/conformance.md); inf if the steps do not line up."""
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return float("inf")
    return max((float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300))
                for g, w in zip(got, want)), default=0.0)
