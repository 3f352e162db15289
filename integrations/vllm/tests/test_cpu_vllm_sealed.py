"""``cpu.vllm``'s prepared tensors changed in place after ``plan`` (``specs/security.md``
2.5): a block entry or a slot pointed past the cache once segfaulted vLLM's kernel on the
next call, a changed ``query_start_loc`` silently changed the output.  Every tensor and
array the plan prepared is changed in turn, in torch's inference mode as vLLM's engine
runs: the next ``write_kv`` and ``attention`` are refused naming it, the cache untouched.
Run in a process of its own: without the seal the first case is a segfault, which must
fail this test, not end the test session."""
import os
import subprocess
import sys
import textwrap

ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVABI_VLLM")}

CHILD = textwrap.dedent('''
    import dataclasses, sys
    import attrs, numpy as np, torch
    import kvabi

    def arrays(x, path="plan.prepared", seen=None):
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
                yield from arrays(getattr(x, f.name), f"{path}.{f.name}", seen)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                yield from arrays(getattr(x, f.name), f"{path}.{f.name}", seen)

    def far(a):  # a value a kernel would follow out of the cache
        if isinstance(a, torch.Tensor):
            if a.dtype.is_floating_point:
                a.view(-1)[:1].add_(1.0)
            elif a.dtype == torch.bool:
                a.view(-1)[:1].logical_not_()
            elif torch.iinfo(a.dtype).max >= 10**6:
                a.view(-1)[:1].fill_(10**6)
            else:  # bytes (the kernels' scheduler metadata)
                a.view(-1)[:1].add_(1)
        else:
            try:
                a.flags.writeable = True
            except ValueError:  # over memory no caller can write: nothing to check
                return False
            a.reshape(-1)[:1] = 10**6
        return True

    be = kvabi.get_backend("cpu.vllm")
    spec = kvabi.KVSpec("full", block_size=32, num_kv_heads=2, head_dim=64,
                        dtype="float32")
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        [3, 1, 2], [40, 7, 0], [[0, 2], [1, 0], [3, 0]], 32, num_blocks=4)
    rng = np.random.default_rng(0)
    kv = torch.from_numpy(rng.standard_normal((6, 2, 64)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((6, 4, 64)).astype(np.float32))
    seen = 0
    for preset in ("vllm.cpu", "vllm.cpu_kt", "vllm.LBHNC"):
        layout = kvabi.Layout.preset(preset, spec, 4, 1)
        with torch.inference_mode():
            paths = [p for p, a in arrays(be.plan(meta, spec, layout, num_q_heads=4,
                                                  sinks=np.zeros(4)).prepared)
                     if not (isinstance(a, torch.Tensor) and a.numel() == 0)
                     and not (isinstance(a, np.ndarray) and a.size == 0)]
            assert any(p.endswith(".table") for p in paths), paths
            for path in paths:
                plan = be.plan(meta, spec, layout, num_q_heads=4, sinks=np.zeros(4))
                cache = be.allocate(layout)
                be.write_kv(plan, cache, key=kv, value=kv)
                before = [p.clone() for p in cache]
                if not far(dict(arrays(plan.prepared))[path]):
                    continue
                for call in (lambda: be.attention(plan, cache, query=q),
                             lambda: be.write_kv(plan, cache, key=kv, value=kv)):
                    try:
                        call()
                    except kvabi.KVABIError as e:  # views of one storage: all named
                        assert path in str(e).split(": ")[0].split(", "), (path, str(e))
                    else:
                        raise SystemExit(f"{preset}: {path} changed, the call ran")
                assert all(torch.equal(a, b) for a, b in zip(cache, before)), path
                seen += 1
    print("refused", seen)
''')


def test_every_prepared_tensor_changed_in_place_is_refused():
    done = subprocess.run([sys.executable, "-c", CHILD], env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (f"exit {done.returncode} (-11: a kernel followed a changed "
                                  f"entry); stderr: {done.stderr[-3000:]}")
    n = int(done.stdout.strip().splitlines()[-1].split()[1])
    assert n >= 30, done.stdout  # every tensor of three layouts' plans
