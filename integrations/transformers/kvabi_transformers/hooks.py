"""What ``use()`` attaches to a model: a continuous-batching manager factory, a forward
pre-hook that turns each step's inputs into kvabi metadata, and (prefill skip) the slicing
of the KV-shared layers' inputs."""
from __future__ import annotations

import copy
import types

import torch
from kvabi import KVABIError

from .session import activate, active_session


def install(model, integration) -> None:
    """Attach ``integration`` to ``model`` (replacing an earlier one)."""
    from .manager import KvabiManager

    for h in getattr(model, "_kvabi_hooks", None) or ():
        h.remove()
    base = getattr(model, "model", None)
    if base is not None:
        base.__dict__.pop("_maybe_slice_kv_shared_inputs", None)

    def init_continuous_batching(self, generation_config=None,
                                 continuous_batching_config=None, workload_hints=None):
        from transformers import ContinuousBatchingConfig

        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, KvabiManager) and cached.integration is integration:
            cached.switch_to_cb_friendly_attn(self)
            return cached
        gen = generation_config if generation_config is not None else self.generation_config
        if gen.eos_token_id is None:
            gen.eos_token_id = -1
        cb = copy.deepcopy(continuous_batching_config or ContinuousBatchingConfig())
        cb.page_size = integration.block_size  # transformers' pages are kvabi's blocks
        return KvabiManager(self, gen, cb, workload_hints, integration=integration)

    def pre_forward(module, args, kwargs):
        session = getattr(kwargs.get("cache"), "kvabi", None)
        activate(session)  # None for a forward outside kvabi's continuous batching
        if session is None:
            return None
        integration.session = session
        skip = integration.prefill_skip and "logits_to_keep" in kwargs
        step = session.begin_step(kwargs, skip)
        if step.skip_meta is not None:
            step.skip_index = torch.as_tensor(step.skip_rows, device=model.device)
            # The model's rows after the skipped layers are the kept tokens, in order.
            kwargs["logits_to_keep"] = torch.arange(len(step.skip_rows), device=model.device)
        return args, kwargs

    def post_forward(module, args, kwargs, output):
        session = getattr(kwargs.get("cache"), "kvabi", None)
        activate(None)
        step = None if session is None else session.step
        if step is not None and step.skip_index is not None and not step.skipping:
            # logits_to_keep already points at the kept rows: never return other rows' logits
            raise KVABIError(f"prefill_skip: {integration.model_type} did not run its "
                             "KV-shared layers through the slicing hook")
        return None

    model.init_continuous_batching = types.MethodType(init_continuous_batching, model)
    handles = [model.register_forward_pre_hook(pre_forward, with_kwargs=True),
               model.register_forward_hook(post_forward, with_kwargs=True)]
    if integration.prefill_skip:
        _install_slice(model.model, integration)
    model._kvabi_hooks = handles
    model._kvabi_integration = integration


def _install_slice(base, integration) -> None:
    """Run the KV-shared suffix on the kept tokens only when the step says so."""
    original = type(base)._maybe_slice_kv_shared_inputs

    # transformers passes the cache after logits_to_keep as ``past_key_values`` (5.23) or
    # ``cache`` (5.24): it goes through untouched, the step is this thread's session's.
    def sliced(self, hidden_states, per_layer_inputs, position_embeddings,
               causal_mask_mapping, logits_to_keep, *args, **kwargs):
        session = active_session()
        step = session.step if session is not None and session.integration is integration \
            else None
        if step is None or step.skip_index is None:
            return original(self, hidden_states, per_layer_inputs, position_embeddings,
                            causal_mask_mapping, logits_to_keep, *args, **kwargs)
        idx = step.skip_index
        step.skipping = True
        hidden_states = hidden_states[:, idx]
        if per_layer_inputs is not None:
            per_layer_inputs = per_layer_inputs[:, idx]
        position_embeddings = {k: (cos[:, idx], sin[:, idx])
                               for k, (cos, sin) in position_embeddings.items()}
        causal_mask_mapping = dict.fromkeys(causal_mask_mapping)
        return hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping

    base._maybe_slice_kv_shared_inputs = types.MethodType(sliced, base)
