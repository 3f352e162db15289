"""transformers' continuous batching with kvabi underneath.

transformers keeps everything that decides *what* runs: its scheduler, its request states
and its block allocator (which request gets which block, prefix sharing, freeing).  kvabi
holds *where* K/V live and computes attention.  The allocator is run on a bookkeeping
config: one full-attention layer of 128-byte token rows, so that a sector is exactly one
block and block ids map 1:1 onto kvabi's pool.  Every layer (sliding ones included) then
gets a block table covering its whole sequence: transformers' sliding ring buffer keeps
only ``window`` slots, fewer than a prefill chunk needs (``window - 1 + chunk``) when keys
are written before they are read, as kvabi's write-then-attend contract does.
"""
from __future__ import annotations

import copy
import threading
import uuid
import weakref

from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager, ContinuousBatchProcessor)
from transformers.generation.continuous_batching.initialization import (
    update_cb_config_after_cache_creation)
from transformers.generation.continuous_batching.scheduler import (SCHEDULER_MAPPING,
                                                                   FIFOScheduler)

from kvabi import KVABIError

from .connector.front import Incoming, TransformersConnector
from .connector.hooks import KvabiOutputRouter, PDBatchProcessor, pd_scheduler
from .serving.context import current_request
from .session import Session

ATTENTION_NAME = "kvabi"


def bookkeeping_config(config, dtype):
    """A config of one full-attention layer whose K and V token rows are 64 bytes each (one
    kv head), so that a page of any block size is a multiple of transformers' 128-byte
    sector alignment; the model's width and vocabulary are kept for transformers' sizing
    of its step buffers."""
    from transformers import PretrainedConfig

    return PretrainedConfig(num_hidden_layers=1, num_attention_heads=1,
                            num_key_value_heads=1, head_dim=max(1, 64 // dtype.itemsize),
                            hidden_size=config.hidden_size, vocab_size=config.vocab_size)


class KvabiPagedCache(PagedAttentionCache):
    """transformers' paged cache run for its bookkeeping only; K/V live in kvabi caches
    (``self.kvabi``, a :class:`~kvabi_transformers.session.Session`)."""

    def __init__(self, integration, *, config, continuous_batching_config, device,
                 distributed_helper, dtype, model_supports_logits_to_keep=False):
        super().__init__(config=bookkeeping_config(config, dtype),
                         continuous_batching_config=continuous_batching_config,
                         device=device, distributed_helper=distributed_helper, dtype=dtype,
                         model_supports_logits_to_keep=model_supports_logits_to_keep)
        (allocator,) = self.cache_allocators.values()
        first = self.pool.num_reserved_sectors * allocator.blocks_per_sector
        self.kvabi = Session(integration, num_blocks=allocator.num_blocks,
                             stride=allocator.block_physical_stride, first_block=first)

    #: requests whose blocks hold KV pulled from another engine (the connector's): never
    #: offered to prefix sharing
    kvabi_pulled: set = frozenset()

    def mark_complete_blocks(self, state, complete_blocks) -> None:
        """transformers' prefix sharing hashes a request's full blocks; KV pulled from
        another engine serves only the request that asked for it."""
        if state.request_id not in self.kvabi_pulled:
            super().mark_complete_blocks(state, complete_blocks)

    def update(self, key_states, value_states, layer_idx, kwargs):
        """The new K/V as given: kvabi's attention writes them, into kvabi caches.  From
        transformers 5.24 the model's own attention layers call this before the attention
        function (5.23: the attention function did, and kvabi's never does); transformers'
        bookkeeping tensor holds no K/V (its rows are not the model's heads)."""
        return key_states, value_states

    def perform_cache_copy(self, copy_src_and_dst) -> None:
        """Forked requests (``num_return_sequences``) get copies of their parent's blocks
        that are not shared: transformers copies its bookkeeping rows, kvabi the K/V."""
        super().perform_cache_copy(copy_src_and_dst)
        for src, dst in copy_src_and_dst.values():
            self.kvabi.copy_blocks(src, dst)


class KvabiManager(ContinuousBatchingManager):
    """A ContinuousBatchingManager whose model attends with kvabi (attention implementation
    ``"kvabi"``) over kvabi caches sized by kvabi's memory plan."""

    def __init__(self, model, generation_config, continuous_batching_config,
                 workload_hints=None, *, integration):
        self.integration = integration
        cb = copy.deepcopy(continuous_batching_config)
        # kvabi reads block ids from the read/write indices: no block-table fast path.
        cb.max_blocks_per_request = 0
        cb.num_blocks = integration.plan_blocks(workload_hints)
        # transformers' CPU swap pool copies its own cache rows, not kvabi's blocks: starved
        # requests are soft-reset (recomputed) instead.
        cb.cpu_offload_space = 0.0
        # Prefix sharing where transformers itself would share (full attention only).
        if not integration.all_full:
            cb.allow_block_sharing = False
        try:
            super().__init__(model=model, generation_config=generation_config,
                             continuous_batching_config=cb, workload_hints=workload_hints)
        except BaseException:
            self.restore_attention(model)
            raise
        #: the P/D connector of the current batch processor (None without pd= or before
        #: the loop made one)
        self.connector = None
        self._incoming = Incoming()
        # request id -> (prompt ids, generated ids) of finished requests whose caller asked
        # for them (None while running); taken by take_token_ids
        self._token_ids: dict = {}
        self._token_lock = threading.Lock()
        self.output_router = KvabiOutputRouter(self)
        integration.manager = weakref.ref(self)

    def add_request(self, input_ids, request_id=None, max_new_tokens=None, streaming=False,
                    record_timestamps=False, eos_token_id=None, *, kv_transfer_params=None,
                    **logit_processor_kwargs):
        """transformers' ``add_request``; ``kv_transfer_params`` (P/D, ``use(..., pd=...)``):
        the ask of a producer (``kvabi.pd.ASK``) or a producer's answer to pull from."""
        asked = current_request()
        if asked is not None and asked.request_id == request_id:  # served over HTTP
            if kv_transfer_params is None:
                kv_transfer_params = asked.kv_transfer_params
            if asked.ignore_eos:
                eos_token_id = -1
            if asked.return_token_ids:
                with self._token_lock:
                    self._token_ids[request_id] = None
        if kv_transfer_params is not None:
            if self.integration.pd is None:
                raise KVABIError("kv_transfer_params: this model is not set up for P/D "
                                 "(kvabi_transformers.use(..., pd=...))")
            if request_id is None:
                request_id = f"kvabi-{uuid.uuid4().hex}"
            self._incoming.put(request_id, kv_transfer_params)
        try:
            got = super().add_request(input_ids, request_id=request_id,
                                      max_new_tokens=max_new_tokens, streaming=streaming,
                                      record_timestamps=record_timestamps,
                                      eos_token_id=eos_token_id, **logit_processor_kwargs)
        except BaseException:
            if kv_transfer_params is not None:
                self._incoming.pop(request_id)
            raise
        if got is None and kv_transfer_params is not None:  # dropped: never enters the loop
            self._incoming.pop(request_id)
        return got

    def finished_output(self, output) -> None:
        """Complete a finished output before it is delivered (the loop's thread):
        ``output.kv_transfer_params`` (a producer's answer or None); token ids kept where
        the caller asked for them."""
        conn = self.connector
        output.kv_transfer_params = None if conn is None else \
            conn.producer.answer(output.request_id)
        with self._token_lock:
            if output.request_id in self._token_ids:
                self._token_ids[output.request_id] = (list(output.prompt_ids),
                                                      list(output.generated_tokens))

    def take_token_ids(self, request_id: str):
        """(prompt ids, generated ids) of a finished request served with
        ``return_token_ids`` (then forgotten), or None."""
        with self._token_lock:
            return self._token_ids.pop(request_id, None)

    def take_kv_transfer_params(self, request_id: str):
        """The answer (``kv_transfer_params``) of finished producer request ``request_id``
        (then forgotten), or None."""
        conn = self.connector
        return None if conn is None else conn.take_answer(request_id)

    def stop(self, block=True, timeout=None, keep_for_next_session=False, hard_stop=False):
        super().stop(block=block, timeout=timeout,
                     keep_for_next_session=keep_for_next_session, hard_stop=hard_stop)
        if not keep_for_next_session and self.connector is not None and block:
            self.connector.close()
            self.connector = None

    def warmup(self) -> None:
        """transformers' warmup (it allocates the caches and runs dummy steps); when it
        fails the model's attention is switched back, since no ``stop()`` follows."""
        try:
            super().warmup()
        except BaseException:
            self.restore_attention(self.model)
            raise

    def restore_attention(self, model) -> None:
        """Give ``model`` back the attention implementation it had before this manager."""
        original = getattr(self, "_original_attn_impl", None)
        if original is not None:
            model.set_attn_implementation(original)
            self._original_attn_impl = None

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        current = model.config._attn_implementation
        if current != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
            self._original_attn_impl = current

    def _create_batch_processor(self):
        existing = getattr(self, "batch_processor", None)
        if isinstance(existing, ContinuousBatchProcessor):
            existing.reset()  # held and pulled blocks are freed: a new connector
            if self.connector is not None:
                self._connect(existing.cache, existing.scheduler, existing)
            return existing
        text_config = self.model.config.get_text_config()
        keep_logits = getattr(self.model, "_supports_logits_to_keep", None)
        cache = KvabiPagedCache(
            self.integration, config=text_config,
            continuous_batching_config=self.continuous_batching_config,
            device=self.model.device, distributed_helper=self.distributed_helper,
            dtype=self.model.dtype,
            model_supports_logits_to_keep=callable(keep_logits) and keep_logits())
        self._use_prefix_sharing = cache.use_prefix_sharing
        update_cb_config_after_cache_creation(cb_config=self.continuous_batching_config,
                                              num_blocks=cache.num_blocks,
                                              max_batch_tokens=cache.max_batch_tokens)
        cfg = self.continuous_batching_config
        scheduler_cls = SCHEDULER_MAPPING.get(cfg.scheduler_type, FIFOScheduler)
        pd = self.integration.pd is not None
        if pd:
            scheduler_cls = pd_scheduler(scheduler_cls)
        scheduler = scheduler_cls(cache=cache, safety_margin=cfg.safety_margin,
                                  max_requests_per_batch=cfg.max_requests_per_batch)
        processor = (PDBatchProcessor if pd else ContinuousBatchProcessor)(
            cache=cache, config=text_config, generation_config=self.generation_config,
            continuous_batching_config=cfg, logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None,
            output_router=self.output_router,
            background_thread_status=self.background_thread_status,
            model_device=self.model.device, model_dtype=self.model.dtype,
            scheduler=scheduler, distributed_helper=self.distributed_helper)
        if pd:
            self._connect(cache, scheduler, processor)
        return processor

    def _connect(self, cache, scheduler, processor) -> None:
        """A P/D connector for this cache (the one before it closed)."""
        if self.connector is not None:
            self.connector.close()
        self.connector = conn = TransformersConnector(
            cache, self.integration.pd, model_config=self.model.config.get_text_config(),
            router=self.output_router, incoming=self._incoming)
        conn.scheduler = scheduler
        scheduler.kvabi_pd = processor.kvabi_pd = conn
        cache.kvabi_pulled = conn.consumer.pulled
