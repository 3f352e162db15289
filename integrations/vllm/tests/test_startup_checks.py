"""Configuration mistakes are refused loudly, once, at the earliest point, naming the
variable or option, its value and the fix (``kvabi_vllm.startup``).

The kvabi variables are checked where the plugin loads; what depends on the model and the
options right after vLLM builds its configuration (``EngineArgs.create_engine_config``, in
the process that starts the engine, before any engine process exists).  One run with the
engine core in its own process shows the refusal arriving once, in the main process, with
no engine process started."""
import os
import subprocess
import sys

import pytest

from kvabi_vllm import env
from kvabi_vllm.env import ConfigError
from kvabi_vllm.tools.checkpoints import write_checkpoint
from kvabi_vllm.tools.engine import setup_env


def refused(fn, *words):
    """The ConfigError of ``fn()``; each of ``words`` is in its message."""
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    for w in words:
        assert w in msg, (w, msg)
    return msg


# -- the variables, where the plugin loads -------------------------------------------------
def test_an_empty_backend_variable_is_refused():
    refused(lambda: env.backend_from_env({"KVABI_VLLM_BACKEND": " "}),
            "KVABI_VLLM_BACKEND", "empty", "reference", "unset it")


def test_a_layout_without_a_backend_is_refused():
    refused(lambda: env.backend_from_env({"KVABI_VLLM_LAYOUT": "BLHNC"}),
            "KVABI_VLLM_LAYOUT=BLHNC", "KVABI_VLLM_BACKEND", "unset KVABI_VLLM_LAYOUT")


def test_a_layout_vllm_does_not_name_is_refused():
    refused(lambda: env.backend_from_env({"KVABI_VLLM_BACKEND": "reference",
                                              "KVABI_VLLM_LAYOUT": "NHD"}),
            "KVABI_VLLM_LAYOUT='NHD'", "LBHNC", "BLHNC")


def test_an_unknown_backend_names_the_variable_and_the_registered_ones():
    refused(lambda: env.backend_from_env({"KVABI_VLLM_BACKEND": "trial.naiv"}),
            "KVABI_VLLM_BACKEND=trial.naiv", "cpu.vllm", "example.torch", "kvabi backends")


def test_set_variables_are_accepted_and_unset_ones_leave_vllm_alone():
    assert env.backend_from_env({"KVABI_VLLM_BACKEND": "reference",
                                     "KVABI_VLLM_LAYOUT": "BLHNC"}) == "reference"
    assert env.backend_from_env({}) is None


# -- the configuration, right after vLLM builds it -------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    setup_env(quiet=True)
    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": write_checkpoint("llama", root / "llama"),
            "head48": write_checkpoint("llama", root / "head48", head_dim=48, heads=2,
                                       hidden=96),
            "kv3": write_checkpoint("llama", root / "kv3", heads=6, kv_heads=3, hidden=192)}


def config(model, monkeypatch, backend, **kw):
    """vLLM's own configuration of ``model`` with ``KVABI_VLLM_BACKEND=backend``, through
    ``EngineArgs.create_engine_config`` as an engine builds it (the plugin's check runs)."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv("KVABI_VLLM_LAYOUT", raising=False)
    if backend is None:
        monkeypatch.delenv("KVABI_VLLM_BACKEND", raising=False)
    else:
        monkeypatch.setenv("KVABI_VLLM_BACKEND", backend)
    args = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", block_size=32,
                max_model_len=256, enforce_eager=True)
    args.update(kw)
    engine_args = EngineArgs(**args)  # loads the plugin, which installs the check
    return engine_args.create_engine_config()


def test_a_block_size_the_backend_cannot_take_is_refused_by_kvabi_name(llama, monkeypatch):
    msg = refused(lambda: config(llama["llama"], monkeypatch, "cpu.vllm", block_size=8),
                  "KVABI_VLLM_BACKEND=cpu.vllm", "block_size 8", "--block-size", "32")
    assert "CPU_ATTN" not in msg


def test_a_dtype_the_backend_does_not_serve_is_refused(llama, monkeypatch):
    refused(lambda: config(llama["llama"], monkeypatch, "example.torch", dtype="bfloat16"),
            "KVABI_VLLM_BACKEND=example.torch", "dtype bfloat16", "--dtype float32")


def test_a_head_size_the_backend_does_not_serve_is_refused(llama, monkeypatch):
    refused(lambda: config(llama["head48"], monkeypatch, "cpu.vllm"),
            "KVABI_VLLM_BACKEND=cpu.vllm", "head_dim 48", "`kvabi backends`")


def test_the_kv_cache_memory_vllm_would_refuse_names_its_variable(llama, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # vLLM's CPU worker reserves this fraction of the node's total memory, always more than
    # is available
    refused(lambda: config(llama["llama"], monkeypatch, "reference",
                           gpu_memory_utilization=0.9999),
            "VLLM_CPU_KVCACHE_SPACE", "not set", "0.9999", "VLLM_CPU_KVCACHE_SPACE=1")


def test_a_served_configuration_passes_and_names_what_runs(llama, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env._said.clear()
    cfg = config(llama["llama"], monkeypatch, "cpu.vllm")
    assert cfg.cache_config.block_size == 32
    # the line said in this process (a server's log shows it: test_serving)
    line, = env._said
    # cpu.vllm's first layout is vLLM's own cache (vllm.cpu), allocated as vLLM's LBHNC
    assert "kvabi backend cpu.vllm" in line and "kvabi layout vllm.cpu " in line and \
        "LBHNC" in line


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_pd_under_tensor_parallelism_starts_where_the_heads_split(llama, monkeypatch, role):
    # each rank's layouts state its shard of the KV heads (kvabi.Shard.tp): TP 2 over the
    # llama's 2 KV heads starts; 3 KV heads over 2 ranks have no split and are refused
    from vllm.config import KVTransferConfig

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    kv = dict(kv_connector="KvabiConnector", kv_connector_module_path="kvabi_vllm.connector")
    cfg = config(llama["llama"], monkeypatch, None, tensor_parallel_size=2,
                 kv_transfer_config=KVTransferConfig(kv_role=role, **kv))
    assert cfg.parallel_config.tensor_parallel_size == 2
    config(llama["llama"], monkeypatch, None,
           kv_transfer_config=KVTransferConfig(kv_role=role, **kv))
    refused(lambda: config(llama["kv3"], monkeypatch, None, tensor_parallel_size=2,
                           kv_transfer_config=KVTransferConfig(kv_role=role, **kv)),
            "--tensor-parallel-size 2", f"kv_role={role}", "3 KV heads", "2 ranks")


def test_without_kvabi_vllm_is_left_alone(llama, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # no kvabi backend, no KvabiConnector: not even the memory check (vLLM's own business)
    cfg = config(llama["llama"], monkeypatch, None, gpu_memory_utilization=0.9999)
    assert cfg.cache_config.gpu_memory_utilization == 0.9999


# -- once, in the main process, before an engine process starts -----------------------------
def test_the_server_command_refuses_once_before_the_engine_core_starts(llama):
    """``kvabi-vllm serve`` (engine core in its own process) with a block size cpu.vllm does
    not take: one line naming the variable, the size and the option, exit status 2, and no
    engine process started."""
    env = {**os.environ, "KVABI_VLLM_BACKEND": "cpu.vllm", "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = subprocess.run([sys.executable, "-m", "kvabi_vllm.cli", "serve",
                          str(llama["llama"]), "--dtype", "float32", "--block-size", "8",
                          "--enforce-eager"],
                         env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    line, = [x for x in text.splitlines() if "block_size 8" in x]
    assert line.startswith("kvabi-vllm serve: error: KVABI_VLLM_BACKEND=cpu.vllm"), line
    assert "--block-size" in line and "Traceback" not in text
    assert "EngineCore" not in text, "an engine process started before the refusal"


def test_the_demo_refuses_a_backend_name_it_does_not_know(capsys):
    from kvabi_vllm.tools import demo

    assert demo.main(["--backends", "reference", "trial.naiv"]) == 2
    err = capsys.readouterr().err
    assert "--backends: trial.naiv not a kvabi backend" in err and "example.torch" in err
