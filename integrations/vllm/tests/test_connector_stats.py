"""KvabiConnector's transfer figures (``kvabi_vllm.connector.stats``) without an engine: what
a pull and a refusal record, how intervals add up, the periodic log line's figures, and
what Prometheus exports (through prometheus_client's own registry and text format).  The
same figures through a real server's ``/metrics``: ``test_serving.py``."""
import functools
from types import SimpleNamespace as types_ns

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvabi_vllm.connector import KvabiConnector
from kvabi_vllm.connector.stats import KvabiConnectorStats, KvabiPromMetrics, reason_of


def test_a_refusal_is_counted_by_the_field_it_names():
    assert reason_of("kvabi_handshakes[0]: the peer serves parts ['kv']") == "kvabi_handshakes"
    assert reason_of("transfer: READ of 12 bytes did not finish") == "transfer"
    assert reason_of("dst_layout.components.key.dtype: float32 != bfloat16") == \
        "dst_layout.components.key.dtype"
    assert reason_of("something went wrong") == "other"
    assert reason_of("") == "other"


def test_intervals_add_up_and_reduce_to_the_logged_figures():
    a, b = KvabiConnectorStats(), KvabiConnectorStats()
    a.record_pull(0.010, 0.004, 3 << 20, 100, relayout=True)
    a.record_refusal("kvabi_handshakes: no pair to copy between")
    b.record_pull(0.030, 0.020, 1 << 20, 7, relayout=False)
    b.record_refusal("kvabi_handshakes[1]: must be an object")
    b.record_refusal("transfer: timed out")
    assert KvabiConnectorStats().is_empty() and not a.is_empty()
    # what vLLM does: the worker's figures travel as their data, then add up
    total = KvabiConnector.build_kv_connector_stats(a.take().data).aggregate(
        KvabiConnector.build_kv_connector_stats(b.data))
    assert a.is_empty()
    assert total.reduce() == {"Pulls": 2, "Relayouted": 1, "MiB": 4.0, "Regions": 107,
                              "Median pull ms": 20.0, "MiB/s": 100.0,
                              "Refused (kvabi_handshakes)": 2, "Refused (transfer)": 1}


def test_prometheus_exports_per_request_and_cumulative_figures():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (Gauge, Counter, Histogram)}
    labels = {0: ["tiny", "0"]}
    config = types_ns(kv_transfer_config=None)
    prom = KvabiConnector.build_prom_metrics(config, types, ["model_name", "engine"], labels)
    assert isinstance(prom, KvabiPromMetrics)
    s = KvabiConnectorStats()
    s.record_pull(0.002, 0.001, 5000, 3, relayout=True)
    s.record_pull(0.004, 0.002, 7000, 5, relayout=True)
    s.record_pull(0.5, 0.4, 9000, 1, relayout=False)
    s.record_refusal("kvabi_handshakes: tampered")
    prom.observe(s.data, engine_idx=0)
    text = generate_latest(registry).decode()
    want = [
        'vllm:kvabi_pulls_total{engine="0",model_name="tiny",relayout="true"} 2.0',
        'vllm:kvabi_pulls_total{engine="0",model_name="tiny",relayout="false"} 1.0',
        'vllm:kvabi_refusals_total{engine="0",model_name="tiny",reason="kvabi_handshakes"} 1.0',
        'vllm:kvabi_pull_bytes_sum{engine="0",model_name="tiny"} 21000.0',
        'vllm:kvabi_pull_regions_sum{engine="0",model_name="tiny"} 9.0',
        'vllm:kvabi_pull_seconds_count{engine="0",model_name="tiny"} 3.0',
        # per request: two pulls under 5 ms, one between 0.25 and 0.5 s
        'vllm:kvabi_pull_seconds_bucket{engine="0",le="0.005",model_name="tiny"} 2.0',
        'vllm:kvabi_pull_seconds_bucket{engine="0",le="0.25",model_name="tiny"} 2.0',
        'vllm:kvabi_pull_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 3.0',
    ]
    for line in want:
        assert line in text, (line, text)
