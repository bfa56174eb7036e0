"""Stat loggers fed by the async engine's output loop, and the periodic log line (vLLM's LoggingStatLogger).

Each engine step delivers the core's `SchedulerStats` (gauges and per-step deltas of prefix-cache
counters) and the front end's `IterationStats` (tokens, TTFT, ITL, finished requests) to every logger's
`record`. Loggers must be cheap: `record` runs on the event loop once per step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from pagedllm.logger import init_logger
from pagedllm.messages import SchedulerStats
from pagedllm.metrics.stats import IterationStats
from pagedllm.spec_decode.metrics import SpecDecodingLogging

logger = init_logger(__name__)


class StatLogger(Protocol):
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        queue_times: Sequence[float] = (),
    ) -> None: ...

    def log(self) -> None: ...


class LoggingStatLogger:
    """Accumulates tokens between `log()` calls and prints vLLM's periodic one-line summary."""

    def __init__(self) -> None:
        self.last_log_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_scheduler_stats = SchedulerStats()
        self.total_prefix_queries = 0
        self.total_prefix_hits = 0
        self._last_logged_idle = False
        self.spec_decoding = SpecDecodingLogging()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        queue_times: Sequence[float] = (),
    ) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            self.total_prefix_queries += scheduler_stats.prefix_cache_queries
            self.total_prefix_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.spec_decoding_stats is not None:
                self.spec_decoding.observe(scheduler_stats.spec_decoding_stats)

    def log(self) -> None:
        now = time.monotonic()
        dt = max(now - self.last_log_time, 1e-9)
        s = self.last_scheduler_stats
        idle = not (self.num_prompt_tokens or self.num_generation_tokens or s.num_running_reqs or s.num_waiting_reqs)
        if idle and self._last_logged_idle:
            self.last_log_time = now
            return  # one idle line after activity, then quiet
        hit_rate = self.total_prefix_hits / self.total_prefix_queries if self.total_prefix_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.num_prompt_tokens / dt,
            self.num_generation_tokens / dt,
            s.num_running_reqs,
            s.num_waiting_reqs,
            s.kv_cache_usage * 100,
            hit_rate * 100,
        )
        self.spec_decoding.log(dt)
        self._last_logged_idle = idle
        self.last_log_time = now
        self.num_prompt_tokens = self.num_generation_tokens = 0
