"""transformers' continuous batching speaking kvabi's P/D protocol (``specs/pd.md``), both
roles, through the core's :mod:`kvabi.pd`: this package supplies the engine facts only.

    kvabi_transformers.use(model, backend, layout, pd={"kv_role": "kv_both"})
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    manager.add_request(prompt, request_id="a", max_new_tokens=1,
                        kv_transfer_params={"do_remote_decode": True})   # producer
    out = manager.get_result("a")     # out.kv_transfer_params: the answer for a consumer
    manager.add_request(prompt, request_id="b", kv_transfer_params=answer)  # consumer

- :mod:`.front`: the connector of one run (kvabi.pd's Endpoint driven from the loop);
- :mod:`.consumer`: a request whose prompt KV is pulled waits outside the scheduler, then
  resumes with its prompt computed (as transformers' prefix sharing resumes one);
- :mod:`.producer`: a finished request's blocks held under a grant, freed once read;
- :mod:`.caches`: transformers' paged cache (the session's kvabi caches) as P/D parts;
- :mod:`.hooks`: the scheduler, batch processor and output router that call the connector;
- :mod:`.settings`: the ``pd=`` options.
"""
from .front import TransformersConnector, model_identity
from .settings import PDOptions, pd_options

__all__ = ["PDOptions", "TransformersConnector", "model_identity", "pd_options"]
