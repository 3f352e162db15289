"""The model side: what each layer's cache is (``spec``: :class:`KVSpec`, :class:`LayerKV`;
``model_kv``: :class:`ModelKV`), read from Hugging Face configs (``hf_config``), quantized
caches (``quant``) and which KV heads a tensor-parallel rank holds (``shard``).

May import: util.
"""
