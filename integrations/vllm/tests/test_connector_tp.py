"""KvabiConnector under tensor parallelism: P/D roles at TP > 1 are refused at engine start
naming the role and the TP size (the connector does not state a rank's shard of the KV
heads yet); TP 1 and the host tier alone at any TP size start."""
import numpy as np
import pytest

from kvabi import KVABIError
from kvabi_vllm.connector_config import ConnectorConfig, check_pd_tp, tp_size


def _config(role):
    return ConnectorConfig(producer=role == "kv_producer", consumer=role == "kv_consumer",
                           engine="e", block_size=16, groups=(None,),
                           need_back=np.array([1 << 40]), windows=(None,), model="m",
                           max_model_len=1024, host_blocks=8)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_pd_under_tp_is_refused_at_start_naming_role_and_size(role):
    with pytest.raises(KVABIError, match=rf"kv_role: {role} with tensor_parallel_size=2"):
        check_pd_tp(_config(role), 2)
    check_pd_tp(_config(role), 1)


def test_host_tier_alone_starts_at_any_tp():
    for tp in (1, 2, 4):
        check_pd_tp(_config("kv_both"), tp)
    assert tp_size() == 1  # no TP group in this process
