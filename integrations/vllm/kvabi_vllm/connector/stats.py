"""KvabiConnector's transfer figures where vLLM users look.

The worker side records one entry per pull (seconds, seconds in NIXL READs, bytes, byte
regions, whether it relayouted) and one per refused request (by reason: the field its
message names).  vLLM drains them every step (``get_kv_connector_stats``), sums them over
its logging interval (the periodic "KV Transfer metrics: ..." line of its stat logger) and
hands them to :class:`KvabiPromMetrics`, which exports them on the server's ``/metrics``:

- ``vllm:kvabi_pull_seconds``, ``vllm:kvabi_pull_bytes``, ``vllm:kvabi_pull_regions``:
  histograms per pulled request (their ``_sum`` and ``_count`` are the running totals);
- ``vllm:kvabi_pulls_total{relayout="true"|"false"}``: pulls, relayouted or whole blocks;
- ``vllm:kvabi_refusals_total{reason=...}``: requests whose KV was refused, by reason.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

#: per pull, in this order
PULL_FIELDS = ("seconds", "read_seconds", "bytes", "regions", "relayout")
#: a reason label: the field a refusal names (bounded: anything else is "other")
_REASON = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]{0,47})(\[[^\]]*\])*[:=]")


def reason_of(message: str) -> str:
    """The Prometheus label of a refusal: the field its message opens with (indices
    dropped: ``kvabi_handshakes[0]: ...`` -> ``kvabi_handshakes``), else ``other``."""
    m = _REASON.match(str(message))
    return m.group(1) if m else "other"


@dataclass
class KvabiConnectorStats(KVConnectorStats):
    """The transfer figures of one interval (serializable: lists and a dict)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"pulls": [], "refusals": {}}

    def record_pull(self, seconds: float, read_seconds: float, nbytes: int, regions: int,
                    relayout: bool) -> None:
        self.data["pulls"].append([float(seconds), float(read_seconds), int(nbytes),
                                   int(regions), bool(relayout)])

    def record_refusal(self, message: str) -> None:
        reason = reason_of(message)
        self.data["refusals"][reason] = self.data["refusals"].get(reason, 0) + 1

    def take(self) -> KvabiConnectorStats:
        """The figures so far, leaving this one empty."""
        out = KvabiConnectorStats(data=self.data)
        self.reset()
        return out

    def is_empty(self) -> bool:
        return not self.data["pulls"] and not self.data["refusals"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            self.data["pulls"].extend(other.data["pulls"])
            for reason, n in other.data["refusals"].items():
                self.data["refusals"][reason] = self.data["refusals"].get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        pulls = self.data["pulls"]
        out: dict[str, int | float] = {"Pulls": len(pulls)}
        if pulls:
            secs = [p[0] for p in pulls]
            nbytes = sum(p[2] for p in pulls)
            out.update({
                "Relayouted": sum(1 for p in pulls if p[4]),
                "MiB": round(nbytes / 2**20, 3),
                "Regions": sum(p[3] for p in pulls),
                "Median pull ms": round(statistics.median(secs) * 1e3, 3),
                "MiB/s": round(nbytes / 2**20 / max(sum(secs), 1e-9), 1)})
        for reason, n in sorted(self.data["refusals"].items()):
            out[f"Refused ({reason})"] = n
        return out


class KvabiPromMetrics(KVConnectorPromMetrics):
    """KvabiConnector's Prometheus metrics (module docstring), per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def histogram(name, doc, buckets):
            h = self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                    labelnames=labelnames)
            return {i: h.labels(*v) for i, v in per_engine_labelvalues.items()}

        self.seconds = histogram(
            "vllm:kvabi_pull_seconds", "Seconds per request to pull its KV (KvabiConnector)",
            [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0])
        self.bytes = histogram(
            "vllm:kvabi_pull_bytes", "Bytes of KV pulled per request (KvabiConnector)",
            [4.0 ** i for i in range(6, 18)])
        self.regions = histogram(
            "vllm:kvabi_pull_regions",
            "Contiguous byte regions per pulled request (KvabiConnector)",
            [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144])
        self.pulls = self._counter_cls(
            name="vllm:kvabi_pulls", labelnames=labelnames + ["relayout"],
            documentation="Requests whose KV KvabiConnector pulled, by whether it "
                          "relayouted (other layout, block size or backend) or moved whole "
                          "blocks")
        self.refusals = self._counter_cls(
            name="vllm:kvabi_refusals", labelnames=labelnames + ["reason"],
            documentation="Requests whose KV KvabiConnector refused, by the field the "
                          "refusal names")

    def observe(self, transfer_stats_data, engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        for secs, _read, nbytes, regions, relayout in transfer_stats_data.get("pulls", ()):
            self.seconds[engine_idx].observe(secs)
            self.bytes[engine_idx].observe(nbytes)
            self.regions[engine_idx].observe(regions)
            self.pulls.labels(*labels, "true" if relayout else "false").inc()
        for reason, n in transfer_stats_data.get("refusals", {}).items():
            self.refusals.labels(*labels, reason).inc(n)
