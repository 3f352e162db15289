"""use() checks the installed transformers once per process: its version against the tested
range (the package's own dependency range) and the continuous-batching internals
kvabi-transformers reaches into.  Every check is made to fail here, on a faked version or
on an internal changed the way a release could change it, and a refused use() leaves the
model as it was."""
import dataclasses
import inspect
import re
import tomllib
import typing
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from transformers.generation.continuous_batching import cache as tf_cache
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache_allocators.full_attention import (
    FullAttentionCacheAllocator)

import kvabi
import kvabi_transformers
from kvabi_transformers import compat
from kvabi_transformers.attention import kvabi_attention
from kvabi_transformers.session import Session, activate
from kvabi_transformers.tools.compare import cb_config, run_batch
from kvabi_transformers.tools.tiny_models import tiny_prompts

from tf_cases import model_of, model_state

MISMATCH = kvabi_transformers.TransformersMismatch
CB = "transformers.generation.continuous_batching"


@pytest.fixture
def unchecked(monkeypatch):
    """As if no use() had run in this process yet (the check runs once), without the
    environment's opt-out."""
    monkeypatch.setattr(compat, "_CHECKED", None)
    monkeypatch.delenv(compat.UNTESTED_ENV, raising=False)


def test_tested_range_is_the_package_dependency_range():
    pyproject = Path(kvabi_transformers.__file__).parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (dep,) = [Requirement(d) for d in deps if re.match(r"transformers\b", d)]
    assert dep.specifier == SpecifierSet(compat.TESTED)
    assert dep.extras == {"serving"}  # kvabi-transformers serve runs transformers serve


def test_the_installed_transformers_passes(unchecked):
    assert compat.internals_problems() == []
    kvabi_transformers.use(model_of("llama"))
    assert compat._CHECKED == transformers.__version__ == compat.installed_version()


@pytest.mark.parametrize("version", ["5.23.0", "5.23.4", "5.24.0", "5.24.2"])
def test_versions_in_the_tested_range_pass(unchecked, version):
    compat.check_version(version)


@pytest.mark.parametrize("version", ["5.25.0", "5.22.2", "6.0.0", "5.25.0.dev0", "main"])
def test_an_untested_version_is_refused_naming_it_and_the_range(unchecked, monkeypatch,
                                                                  version):
    monkeypatch.setattr(compat, "installed_version", lambda: version)
    model = model_of("llama")
    before = model_state(model)
    with pytest.raises(MISMATCH, match=f"^transformers: {re.escape(version)} is installed; "
                       "kvabi-transformers is tested with transformers "
                       f"{re.escape(compat.TESTED)} .*set {compat.UNTESTED_ENV}=1"):
        kvabi_transformers.use(model)
    assert model_state(model) == before
    assert compat._CHECKED is None


def test_an_untested_version_only_warns_when_asked(unchecked, monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda: "5.25.0")
    monkeypatch.setenv(compat.UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match=f"transformers: 5.25.0 is installed; .*"
                      f"{re.escape(compat.TESTED)}.*going on untested"):
        model = kvabi_transformers.use(model_of("llama"))
    assert model._kvabi_integration is not None


def test_checked_once_per_process_and_version(unchecked, monkeypatch):
    calls = []
    probe = compat.internals_problems
    monkeypatch.setattr(compat, "internals_problems", lambda: calls.append(1) or probe())
    kvabi_transformers.use(model_of("llama"))
    kvabi_transformers.use(model_of("llama"))
    assert len(calls) == 1
    # another release in the same process (a local build of a tested one) is checked again
    local = transformers.__version__ + "+local"
    monkeypatch.setattr(compat, "installed_version", lambda: local)
    kvabi_transformers.use(model_of("llama"))
    assert len(calls) == 2


def test_the_tables_describe_kvabi_transformers_own_overrides():
    """OVERRIDDEN states the parameters of kvabi-transformers' own overrides: what a
    release is compared against (an override may add keyword-only parameters of its own,
    e.g. add_request's kv_transfer_params)."""
    from kvabi_transformers.connector.hooks import (KvabiOutputRouter, PDBatchProcessor,
                                                    PDSchedulerMixin)
    from kvabi_transformers.manager import KvabiManager, KvabiPagedCache

    model = kvabi_transformers.use(model_of("llama"))
    ours = {"PagedAttentionCache": KvabiPagedCache, "ContinuousBatchingManager": KvabiManager,
            "Scheduler": PDSchedulerMixin, "ContinuousBatchProcessor": PDBatchProcessor,
            "OutputRouter": KvabiOutputRouter}
    for path, names in compat.OVERRIDDEN.items():
        cls, method = path.split(".")[-2:]
        fn = model.init_continuous_batching if method == "init_continuous_batching" \
            else getattr(ours[cls], method)
        params = ["**" if p.kind is p.VAR_KEYWORD else p.name
                  for p in inspect.signature(fn).parameters.values()
                  if p.name != "self" and p.kind is not p.KEYWORD_ONLY]
        assert tuple(params) == names, path


def test_step_inputs_are_the_keywords_a_step_reads(monkeypatch):
    """STEP_INPUTS holds every forward keyword a step reads (prefill skip included): the
    ones a release must still pass."""
    read = {"cache"}  # the pre-hook finds the session through it

    class Reading(dict):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

    begin = Session.begin_step
    monkeypatch.setattr(Session, "begin_step",
                        lambda self, kwargs, skip: begin(self, Reading(kwargs), skip))
    model = kvabi_transformers.use(model_of("gemma4"), prefill_skip=True)
    run_batch(model, tiny_prompts(2), 2, config=cb_config(), logits=False)
    assert read == set(compat.STEP_INPUTS)


def _replace_init(cls, drop: str):
    """cls.__init__ as a release that dropped the parameter ``drop`` would have it."""
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", drop)]
    ns: dict = {}
    exec(f"def __init__(self, {', '.join(params)}): pass", ns)
    return ns["__init__"]


def _update_renamed(self, key_states, value_states, layer_idx, cache_kwargs):
    return key_states, value_states


def _manager_init(self, model, generation_config, continuous_batching_config,
                  workload_hints=None):
    self.model = model  # sets none of the queues, the router, the logits processor ...


def _shifted_rows(self, request_id, past_length, query_length):
    # values where keys were: a release that moved K/V rows within a block
    rows = _ORIGINAL_WRITE(self, request_id, past_length, query_length)
    return [r + self.tokens_per_page for r in rows]


_ORIGINAL_WRITE = FullAttentionCacheAllocator.get_write_indices


@dataclasses.dataclass
class _ConfigWithoutOffload:
    page_size: int = 16
    num_blocks: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    scheduler_type: str = "fifo"
    safety_margin: float = 0.2
    max_requests_per_batch: int | None = None


class _ArgsWithoutReadIndex(typing.TypedDict):
    cache: object
    cu_seq_lens_q: torch.Tensor
    position_ids: torch.Tensor
    write_index: list
    logits_indices: torch.Tensor


#: (target, replacement or None to delete it, what the refusal must say)
CHANGES = [
    (f"{CB}.cache.PagedAttentionCache.perform_cache_copy", None,
     "cache.PagedAttentionCache.perform_cache_copy is gone"),
    (f"{CB}.initialization.update_cb_config_after_cache_creation", None,
     "initialization.update_cb_config_after_cache_creation is gone"),
    (f"{CB}.cache.PagedAttentionCache.update", _update_renamed,
     r"cache.PagedAttentionCache.update takes \(key_states, value_states, layer_idx, "
     r"cache_kwargs\); kvabi-transformers overrides it as \(key_states, value_states, "
     r"layer_idx, kwargs\)"),
    (f"{CB}.continuous_api.ContinuousBatchProcessor.__init__",
     _replace_init(continuous_api.ContinuousBatchProcessor, "scheduler"),
     r"continuous_api.ContinuousBatchProcessor.__init__ takes no scheduler \(it takes "
     r"\(cache, "),
    (f"{CB}.continuous_api.ContinuousBatchingManager.__init__", _manager_init,
     "ContinuousBatchingManager.__init__ no longer sets generation_config, "
     "continuous_batching_config, distributed_helper, logit_processor"),
    ("transformers.ContinuousBatchingConfig", _ConfigWithoutOffload,
     "ContinuousBatchingConfig has no cpu_offload_space"),
    (f"{CB}.input_outputs.PagedAttentionArgs", _ArgsWithoutReadIndex,
     r"the step's forward keywords \(PagedAttentionArgs\) have no read_index"),
    (f"{CB}.cache_allocators.full_attention.FullAttentionCacheAllocator.get_write_indices",
     _shifted_rows, r"PagedAttentionCache of one bookkeeping layer: position 0 of a request "
     r"is written to row \d+; kvabi-transformers reads row \d+ as its slot"),
    (f"{CB}.cache.PagedAttentionCache.__init__",
     _replace_init(tf_cache.PagedAttentionCache, "distributed_helper"),
     "cache.PagedAttentionCache.__init__ takes no distributed_helper"),
]


@pytest.mark.parametrize("target, replacement, says", CHANGES,
                         ids=[c[0].rsplit(".", 1)[-1] for c in CHANGES])
@pytest.mark.parametrize("untested_ok", [False, True])
def test_a_changed_internal_is_refused_naming_it(unchecked, monkeypatch, target, replacement,
                                                 says, untested_ok):
    if untested_ok:  # the opt-out covers the version only, never a changed internal
        monkeypatch.setenv(compat.UNTESTED_ENV, "1")
    model = model_of("llama")
    before = model_state(model)
    if replacement is None:
        monkeypatch.delattr(target)
    else:
        monkeypatch.setattr(target, replacement)
    with pytest.raises(MISMATCH, match=f"^transformers: {re.escape(transformers.__version__)}"
                       " is installed, and continuous batching's internals differ from what "
                       f"kvabi-transformers reaches into \\(tested: {re.escape(compat.TESTED)}"
                       f"\\): .*{says}"):
        kvabi_transformers.use(model)
    assert model_state(model) == before
    assert compat._CHECKED is None


def test_prefill_skip_checks_the_slicing_hook_it_wraps(monkeypatch):
    model = model_of("gemma4")
    base = type(model.model)

    def moved(self, hidden_states, position_embeddings, per_layer_inputs,
              causal_mask_mapping, logits_to_keep, cache, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(base, "_maybe_slice_kv_shared_inputs", moved)
    before = model_state(model)
    with pytest.raises(MISMATCH, match=r"^prefill_skip: gemma4_text: Gemma4TextModel."
                       r"_maybe_slice_kv_shared_inputs takes \(hidden_states, "
                       r"position_embeddings, per_layer_inputs, .*; prefill skip wraps it as "
                       r"\(hidden_states, per_layer_inputs, position_embeddings, "):
        kvabi_transformers.use(model, prefill_skip=True)
    assert model_state(model) == before


def test_kvabi_attention_outside_a_step_of_its_model_is_refused():
    """The attention finds its session as the step running in this thread; a forward
    outside kvabi's continuous batching, or another model's session, is refused."""
    model = kvabi_transformers.use(model_of("llama"))
    attn = model.config._attn_implementation
    model.set_attn_implementation("kvabi")
    try:
        with pytest.raises(kvabi.KVABIError, match="has no kvabi paged cache"):
            model(torch.tensor([[5, 6, 7]]))
    finally:
        model.set_attn_implementation(attn)
    other = kvabi_transformers.use(model_of("llama"))
    session = Session.__new__(Session)  # the step state of `other`, without its caches
    session.integration = other._kvabi_integration
    module = model._kvabi_integration.modules[0]
    assert session.serves(other._kvabi_integration.modules[0]) and not session.serves(module)
    q = torch.zeros(1, 4, 3, 16)
    activate(session)
    try:
        with pytest.raises(kvabi.KVABIError, match="has no kvabi paged cache"):
            kvabi_attention(module, q, q, q, None)
    finally:
        activate(None)
