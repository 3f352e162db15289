"""The attention function registered with ``transformers.AttentionInterface``."""
from __future__ import annotations

from kvabi import KVABIError

from .session import active_session


def kvabi_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    """transformers' attention call, answered by the kvabi session of the paged cache.

    ``query`` [1, Hq, T, D], ``key``/``value`` [1, Hkv, T, D] (the step's new tokens; ignored
    by layers that share another layer's cache); the mask is unused: kvabi metadata says
    which keys each query sees.  The session is the one of the step the model runs in this
    thread (transformers >= 5.24 passes no cache here).  Returns ([1, T, Hq, Dv], None)."""
    session = active_session()
    if session is None or not session.serves(module):
        raise KVABIError("attention: the 'kvabi' implementation serves transformers' "
                         "continuous batching (generate_batch) of a model passed to "
                         "kvabi_transformers.use(); this call has no kvabi paged cache")
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    return session.attend(module, query, key, value, scaling, kwargs.get("softcap"))
