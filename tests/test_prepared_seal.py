"""What a backend prepared for a step stays as ``plan`` made it (``specs/security.md`` 2.5):
every prepared array of every backend here is changed after ``plan`` through its own
framework's API, and the next ``write_kv`` / ``attention`` must refuse the plan by the
array's place (``plan.prepared.<field>``) before any backend code runs, with the cache's
bytes untouched; an unchanged plan serves every layer, again and again.

The arrays are found by a walk written here (attrs and dataclass fields, tuples, lists,
dicts), not by the seal's own.
"""
from __future__ import annotations

import dataclasses
import types

import attrs
import numpy as np
import pytest

import kvabi
from kvabi import CommonAttentionMetadata, KVABIError, KVSpec, Layout
from kvabi.util.frozen import is_frozen
from kvabi.backend.reference import ReferenceBackend

torch = pytest.importorskip("torch")

SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=32, dtype="float32")
META = CommonAttentionMetadata.from_lengths([3, 1], [2, 6], [[0, 1, 0], [2, 3, 4]], 4,
                                            num_blocks=6)


def _backends():
    out = {name: (lambda n=name: kvabi.get_backend(n)) for name in kvabi.backend_names()
           if kvabi.get_backend(name).available()[0]}
    try:  # the CUDA adapters through their emulators (CPU)
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parents[1] / "backends" / "cuda" / "tests"))
        from emulators import flash_attn_emulator, flashinfer_emulator
        from kvabi_cuda.flash_attn_backend import FlashAttnBackend
        from kvabi_cuda.flashinfer_backend import FlashInferBackend

        out["flashinfer (emulated)"] = lambda: FlashInferBackend(
            library=flashinfer_emulator, device="cpu")
        out["flash_attn (emulated)"] = lambda: FlashAttnBackend(
            library=flash_attn_emulator, device="cpu")
    except ImportError:
        pass
    return out


BACKENDS = _backends()


def arrays(x, path="plan.prepared", seen=None):
    """(path, array) of every numpy array and torch tensor ``x`` holds."""
    seen = set() if seen is None else seen
    if id(x) in seen:
        return
    seen.add(id(x))
    if isinstance(x, (np.ndarray, torch.Tensor)):
        yield path, x
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from arrays(v, f"{path}[{i}]", seen)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from arrays(v, f"{path}[{k!r}]", seen)
    elif attrs.has(type(x)):
        for f in attrs.fields(type(x)):
            yield from arrays(getattr(x, f.name), f"{path}.{f.name.lstrip('_')}", seen)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from arrays(getattr(x, f.name), f"{path}.{f.name}", seen)


def spec_for(be) -> KVSpec:
    """SPEC, or its int8 per-tensor twin for a backend of quantized caches only."""
    if not be.refusals(SPEC):
        return SPEC
    return KVSpec("full", block_size=4, num_kv_heads=2, head_dim=32, dtype="int8",
                  quant="per_tensor")


def setup(be, spec=None, meta=META):
    spec = spec_for(be) if spec is None else spec
    layout = Layout.preset(be.preferred_layouts(spec)[0], spec, 6, 2)
    rng = np.random.default_rng(0)
    key = rng.standard_normal((meta.num_tokens, 2, 32)).astype(np.float32)
    return layout, key


def change(a) -> bool:
    """Change ``a`` through its framework's own API; False where it cannot be changed."""
    if isinstance(a, torch.Tensor):
        if not a.numel():
            return False
        flat = a.view(-1) if a.is_contiguous() else a
        flat.view(-1)[:1].copy_(flat.view(-1)[:1] + 1) if a.dtype != torch.bool else \
            flat.view(-1)[:1].logical_not_()
        return True
    try:
        a.flags.writeable = True
    except ValueError:
        assert is_frozen(a) or not a.flags.writeable
        return False  # over an immutable buffer: no caller can write it
    if a.size:
        a.reshape(-1)[:1] = a.reshape(-1)[:1]  # any write: the flag is what is checked
    return True


def _bytes(cache):
    return [np.array(kvabi.tensors.to_numpy(p)).tobytes() for p in cache]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_prepared_array_changed_after_plan_is_refused(name):
    be = BACKENDS[name]()
    layout, key = setup(be)
    spec = spec_for(be)
    first = be.plan(META, spec, layout, num_q_heads=4)
    found = list(arrays(first.prepared))
    assert found or be.framework == "jax", f"{name}: no prepared arrays found"
    changed = 0
    for i, (path, _) in enumerate(found):
        plan = be.plan(META, spec, layout, num_q_heads=4)  # a fresh plan per array
        cache = be.allocate(layout)
        before = _bytes(cache)
        if be.framework == "jax":
            continue
        target = dict(arrays(plan.prepared))[path]
        if not change(target):
            continue
        changed += 1
        for call in (lambda: be.write_kv(plan, cache, key=key, value=key, layer=1),
                     lambda: be.attention(plan, cache, query=np.concatenate([key, key], 1),
                                          layer=0)):
            with pytest.raises(KVABIError, match=r"^plan\.prepared"):
                call()
        assert _bytes(cache) == before, f"{name}: {path} changed, the cache was written"
    assert changed or be.framework == "jax" or all(
        isinstance(a, np.ndarray) and is_frozen(a) for _, a in found)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_an_unchanged_plan_serves_every_layer_again_and_again(name):
    be = BACKENDS[name]()
    layout, key = setup(be)
    spec = spec_for(be)
    plan = be.plan(META, spec, layout, num_q_heads=4)
    cache = be.allocate(layout)
    q = np.concatenate([key, key], 1)
    for _ in range(2):
        for layer in (0, 1):
            cache = be.write_kv(plan, cache, key=key, value=key, layer=layer)
            be.attention(plan, cache, query=q, layer=layer)
            if be.capabilities(spec).sinks:  # per-call data made later (prepared_for)
                be.attention(plan, cache, query=q, layer=layer, sinks=np.zeros(4))


def test_prepared_torch_tensors_under_inference_mode_are_sealed_too():
    """vLLM runs its engine in torch's inference mode, whose tensors have no version
    counter: the base class prepares outside it, so a change is still caught."""
    be = kvabi.get_backend("example.torch")
    layout, key = setup(be)
    with torch.inference_mode():
        plan = be.plan(META, SPEC, layout, num_q_heads=4)
        cache = be.allocate(layout)
        tensors = [a for _, a in arrays(plan.prepared) if isinstance(a, torch.Tensor)]
        assert tensors and not any(t.is_inference() for t in tensors)
        be.write_kv(plan, cache, key=key, value=key)
        tensors[0].view(-1)[:1].add_(1)
        with pytest.raises(KVABIError, match=r"^plan\.prepared\.\w+: written after plan"):
            be.write_kv(plan, cache, key=key, value=key)


class _DictPrepared(ReferenceBackend):
    """A backend keeping its step data in mutable containers, and one array made later."""

    name = "test.dict_prepared"

    def prepare(self, plan):
        work = super().prepare(plan)
        return {"work": work, "rows": [np.arange(3)], "later": None}

    def write(self, plan, cache, key, value, layer, scales=None):
        inner = types.SimpleNamespace(spec=plan.spec, meta=plan.meta,
                                      prepared=plan.prepared["work"])
        self.prepared_for(plan, "extra", lambda: np.arange(4))
        return ReferenceBackend.write(self, inner, cache, key, value, layer)


@pytest.mark.parametrize("how", ["add", "rebind", "remove", "list_append", "list_rebind",
                                 "later_array", "later_flag"])
def test_mutable_containers_and_later_data_are_held_by_identity(how):
    be = _DictPrepared()
    layout, key = setup(be)
    plan = be.plan(META, SPEC, layout, num_q_heads=4)
    cache = be.allocate(layout)
    be.write_kv(plan, cache, key=key, value=key)  # makes "extra"
    p = plan.prepared
    if how == "add":
        p["new"] = 1
    elif how == "rebind":
        p["later"] = np.zeros(3)
    elif how == "remove":
        del p["later"]
    elif how == "list_append":
        p["rows"].append(np.arange(2))
    elif how == "list_rebind":
        p["rows"][0] = np.arange(3)
    else:
        extra = plan._seal._memo["extra"][0]  # the backend's own, made by prepared_for
        if how == "later_flag":
            extra.flags.writeable = True
        else:
            with pytest.raises(ValueError):
                extra[0] = 7  # read-only once made
            return
    with pytest.raises(KVABIError, match=r"^plan\.prepared"):
        be.write_kv(plan, cache, key=key, value=key)


def test_prepared_for_takes_only_this_backends_plans():
    be, other = _DictPrepared(), _DictPrepared()
    layout, _ = setup(be)
    plan = be.plan(META, SPEC, layout, num_q_heads=4)
    with pytest.raises(KVABIError, match=r"^plan: must come from"):
        other.prepared_for(plan, "x", lambda: 1)
    assert be.prepared_for(plan, "x", lambda: 1) == 1
    assert be.prepared_for(plan, "x", lambda: 2) == 1  # made once
