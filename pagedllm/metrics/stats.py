"""What the output processor observes per iteration, for the stat loggers (Prometheus, the periodic log)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    e2e_latency: float
    """Seconds from arrival to finish."""
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    ttft: float | None
    """Seconds from arrival to the first output token (None when it finished without any)."""


@dataclass
class IterationStats:
    """What one `process_outputs` call observed, for metrics (Prometheus counters and histograms)."""

    iteration_timestamp: float
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that produced their first token in this iteration."""
    num_generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    """Seconds since the previous token step, one per request that got tokens in a decode step."""
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
