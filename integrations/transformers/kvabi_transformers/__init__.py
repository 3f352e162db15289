"""kvabi inside Hugging Face transformers: continuous batching (``generate_batch``) with K/V
in kvabi layouts and attention on any kvabi backend.

    import kvabi_transformers
    kvabi_transformers.use(model, backend="tpu.jax", layout="tpu.combined")
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
"""
from .compat import TransformersMismatch
from .integration import use

__all__ = ["TransformersMismatch", "use"]
__version__ = "0.1.0"
