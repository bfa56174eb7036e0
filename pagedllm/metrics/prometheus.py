"""Prometheus metrics under `pagedllm:` names, mirroring vLLM's production metrics (`vllm:*`).

Semantics follow vLLM: prefix-cache queries and hits count tokens; KV usage counts free cached blocks as
free; counters get prometheus_client's `_total` suffix. Every metric carries a `model_name` label.

Each logger has its own `CollectorRegistry` (exposed at `/metrics`), so several engines in one process
(tests) do not collide in the global registry.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.messages import SchedulerStats
from pagedllm.metrics.stats import IterationStats
from pagedllm.spec_decode.metrics import SpecDecodingProm

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return buckets
            buckets.append(v)
        exponent += 1


class PrometheusStatLogger:
    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter(
            "pagedllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: self._request_success.labels(model_name, reason) for reason in ("stop", "length", "abort")
        }
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self._last_preemptions = 0
        self.spec_decoding = SpecDecodingProm(r, model_name)
        self.lora_info: Gauge | None = None
        self.max_lora = 0
        self.last_scheduler_stats = SchedulerStats()
        """The core's latest gauges, kept for readers outside Prometheus (the web dashboard's KV grid)."""

    def enable_data_parallel(self, client: Any) -> None:
        """Per engine core (label `engine`): `pagedllm:engine_requests_routed_total` (requests sent to it) and
        `pagedllm:engine_requests_in_flight`, read from the front end's `DPAsyncMPClient`."""
        routed = Counter(
            "pagedllm:engine_requests_routed",
            "Requests the front end sent to each engine core (data parallelism).",
            ["model_name", "engine"],
            registry=self.registry,
        )
        in_flight = Gauge(
            "pagedllm:engine_requests_in_flight",
            "Requests in flight per engine core (data parallelism).",
            ["model_name", "engine"],
            registry=self.registry,
        )
        counters = [routed.labels(self.model_name, str(i)) for i in range(len(client.clients))]
        for i in range(len(client.clients)):
            in_flight.labels(self.model_name, str(i)).set_function(functools.partial(_item, client.in_flight, i))

        def on_route(i: int) -> None:
            counters[i].inc()

        client.on_route = on_route

    def enable_lora_info(self, max_lora: int) -> None:
        """`pagedllm:lora_requests_info` (vLLM's vllm:lora_requests_info): a gauge whose labels list the
        adapters of the waiting and running requests; its value is the time of the last update."""
        self.max_lora = max_lora
        self.lora_info = Gauge(
            "pagedllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        queue_times: Sequence[float] = (),
    ) -> None:
        if scheduler_stats is not None:
            s = self.last_scheduler_stats = scheduler_stats
            self.num_requests_running.set(s.num_running_reqs)
            self.num_requests_waiting.set(s.num_waiting_reqs)
            self.kv_cache_usage.set(s.kv_cache_usage)
            if s.prefix_cache_queries:
                self.prefix_cache_queries.inc(s.prefix_cache_queries)
            if s.prefix_cache_hits:
                self.prefix_cache_hits.inc(s.prefix_cache_hits)
            # SchedulerStats.num_preemptions is the core's running total.
            if s.num_preemptions > self._last_preemptions:
                self.num_preemptions.inc(s.num_preemptions - self._last_preemptions)
            self._last_preemptions = s.num_preemptions
            if s.spec_decoding_stats is not None:
                self.spec_decoding.observe(s.spec_decoding_stats)
            if self.lora_info is not None:
                self.lora_info.labels(
                    str(self.max_lora), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)
                ).set_to_current_time()
        for q in queue_times:
            self.queue_time.observe(q)
        if iteration_stats is None:
            return
        it = iteration_stats
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for t in it.ttfts:
            self.ttft.observe(t)
        for t in it.itls:
            self.itl.observe(t)
        for fin in it.finished_requests:
            counter = self.request_success.get(fin.finish_reason)
            if counter is None:
                counter = self.request_success[fin.finish_reason] = self._request_success.labels(
                    self.model_name, fin.finish_reason
                )
            counter.inc()
            self.e2e.observe(fin.e2e_latency)
            self.request_prompt_tokens.observe(fin.num_prompt_tokens)
            self.request_generation_tokens.observe(fin.num_generation_tokens)

    def log(self) -> None:
        """Nothing to print: Prometheus pulls."""

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _item(values: list[int], i: int) -> float:
    return float(values[i])
