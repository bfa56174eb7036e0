"""A snapshot of a Prometheus registry as plain objects (vLLM's `vllm.v1.metrics.reader`): what
`LLM.get_metrics()` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)
    """Cumulative count per upper bound ("+Inf" included), as Prometheus exposes them."""


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    out: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out.append(Counter(family.name, dict(s.labels), int(s.value)))
        elif family.type == "gauge":
            for s in family.samples:
                out.append(Gauge(family.name, dict(s.labels), float(s.value)))
        elif family.type == "histogram":
            series: dict[tuple, Histogram] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                key = tuple(sorted(labels.items()))
                h = series.setdefault(key, Histogram(family.name, labels, 0, 0.0))
                if s.name.endswith("_bucket"):
                    h.buckets[s.labels["le"]] = int(s.value)
                elif s.name.endswith("_count"):
                    h.count = int(s.value)
                elif s.name.endswith("_sum"):
                    h.sum = float(s.value)
            out.extend(series.values())
    return out
