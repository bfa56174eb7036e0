"""What the dashboard shows, read from the same Prometheus registry that `/metrics` renders (so the two
always agree) plus the core's last `SchedulerStats` for the KV-block grid. Nothing here runs per engine
step: a snapshot is computed when the page polls."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.metrics.prometheus import PrometheusStatLogger

HISTORY_SECONDS = 300.0
"""Tokens/s history kept for the charts ("the last minutes")."""
HISTORY_MIN_INTERVAL = 0.9
"""At most one history point per this many seconds, however many pages poll."""

_SCALARS = {
    "running": "pagedllm:num_requests_running",
    "waiting": "pagedllm:num_requests_waiting",
    "kv_cache_usage": "pagedllm:kv_cache_usage_perc",
    "preemptions": "pagedllm:num_preemptions_total",
    "prefix_cache_queries": "pagedllm:prefix_cache_queries_total",
    "prefix_cache_hits": "pagedllm:prefix_cache_hits_total",
    "prompt_tokens": "pagedllm:prompt_tokens_total",
    "generation_tokens": "pagedllm:generation_tokens_total",
}
_HISTOGRAMS = {"ttft": "pagedllm:time_to_first_token_seconds", "itl": "pagedllm:inter_token_latency_seconds"}
_SAMPLE_NAMES = [
    *_SCALARS.values(),
    "pagedllm:request_success_total",
    *(h + suffix for h in _HISTOGRAMS.values() for suffix in ("_bucket", "_sum", "_count")),
]


def read_registry(prometheus: PrometheusStatLogger) -> dict[str, Any]:
    """The dashboard's counters, gauges and histograms as plain numbers, from `prometheus.registry`."""
    samples: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {k: [] for k in _HISTOGRAMS}
    hist_base = {v: k for k, v in _HISTOGRAMS.items()}
    requests: dict[str, int] = {}
    # Only the collectors shown (restricted_registry): collecting every metric costs several times more.
    for metric in prometheus.registry.restricted_registry(_SAMPLE_NAMES).collect():
        for s in metric.samples:
            if s.labels.get("model_name") != prometheus.model_name:
                continue
            if s.name == "pagedllm:request_success_total":
                requests[s.labels["finished_reason"]] = int(s.value)
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in hist_base:
                le = float(s.labels["le"])
                buckets[hist_base[s.name[: -len("_bucket")]]].append((le, s.value))
            else:
                samples[s.name] = s.value
    out: dict[str, Any] = {key: samples.get(name, 0.0) for key, name in _SCALARS.items()}
    for key in ("running", "waiting", "preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        out[key] = int(out[key])
    out["prompt_tokens"] = int(out["prompt_tokens"])
    out["generation_tokens"] = int(out["generation_tokens"])
    out["requests"] = requests
    for key, name in _HISTOGRAMS.items():
        pairs = sorted(buckets[key])
        out[key] = {
            "le": [le if math.isfinite(le) else None for le, _ in pairs],  # +Inf is not JSON
            "cumulative": [int(v) for _, v in pairs],
            "sum": samples.get(name + "_sum", 0.0),
            "count": int(samples.get(name + "_count", 0)),
        }
    return out


class DashboardStats:
    """Builds `/dashboard/api/stats` bodies and keeps a short token-count history for the rate charts."""

    def __init__(self, prometheus: PrometheusStatLogger | None, engine: AsyncLLM) -> None:
        self.prometheus = prometheus
        self.engine = engine
        self.history: deque[tuple[float, int, int]] = deque()
        self.started = time.time()

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        if self.prometheus is None:
            return {"time": now, "available": False}
        body = read_registry(self.prometheus)
        total, in_use, cached_free = self.prometheus.last_scheduler_stats.kv_blocks
        if total == 0:  # no step yet: the pool is all free (the core reports its size, null block included)
            info = getattr(self.engine.engine_core, "ready_info", None) or {}
            total = max(int(info.get("num_blocks", 1)) - 1, 0)
        body["kv_blocks"] = {"total": total, "in_use": in_use, "cached_free": cached_free}
        if not self.history or now - self.history[-1][0] >= HISTORY_MIN_INTERVAL:
            self.history.append((now, body["prompt_tokens"], body["generation_tokens"]))
        while self.history and now - self.history[0][0] > HISTORY_SECONDS:
            self.history.popleft()
        body.update(
            time=now,
            available=True,
            model=self.prometheus.model_name,
            engine_alive=not self.engine.errored,
            history=[list(h) for h in self.history],
        )
        return body
