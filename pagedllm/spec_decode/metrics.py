"""Speculative decoding's metrics, as vLLM names them: Prometheus counters
`pagedllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos` (label `position`), and the periodic log line (acceptance rate, mean
acceptance length: 1 + accepted tokens per draft, per-position acceptance)."""

from __future__ import annotations

from typing import Any

from pagedllm.logger import init_logger
from pagedllm.messages import SpecDecodingStats

logger = init_logger(__name__)


class SpecDecodingProm:
    def __init__(self, registry: Any, model_name: str) -> None:
        """`registry`: a prometheus_client CollectorRegistry (prometheus_client is imported here only: the
        offline `LLM` path does not need it)."""
        from prometheus_client import Counter

        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:spec_decode_{name}", doc, labels, registry=registry).labels(model_name)

        self.num_drafts = counter("num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("num_accepted_tokens", "Number of accepted tokens.")
        self._per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "position"],
            registry=registry,
        )
        self.model_name = model_name
        self.per_pos: list[Any] = []

    def observe(self, s: SpecDecodingStats) -> None:
        self.num_drafts.inc(s.num_drafts)
        self.num_draft_tokens.inc(s.num_draft_tokens)
        self.num_accepted_tokens.inc(s.num_accepted_tokens)
        while len(self.per_pos) < len(s.num_accepted_tokens_per_pos):
            self.per_pos.append(self._per_pos.labels(self.model_name, str(len(self.per_pos))))
        for c, n in zip(self.per_pos, s.num_accepted_tokens_per_pos):
            c.inc(n)


class SpecDecodingLogging:
    """Sums the stats between log lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.per_pos: list[int] = []

    def observe(self, s: SpecDecodingStats) -> None:
        self.num_drafts += s.num_drafts
        self.num_draft_tokens += s.num_draft_tokens
        self.num_accepted_tokens += s.num_accepted_tokens
        if len(self.per_pos) < len(s.num_accepted_tokens_per_pos):
            self.per_pos.extend([0] * (len(s.num_accepted_tokens_per_pos) - len(self.per_pos)))
        for i, n in enumerate(s.num_accepted_tokens_per_pos):
            self.per_pos[i] += n

    def log(self, dt: float) -> None:
        if not self.num_drafts:
            return
        rate = self.num_accepted_tokens / max(self.num_draft_tokens, 1)
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, Drafted "
            "throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate: "
            "%s, Avg Draft acceptance rate: %.1f%%",
            1 + self.num_accepted_tokens / self.num_drafts,
            self.num_accepted_tokens / dt,
            self.num_draft_tokens / dt,
            self.num_accepted_tokens,
            self.num_draft_tokens,
            ", ".join(f"{n / self.num_drafts:.3f}" for n in self.per_pos),
            rate * 100,
        )
        self.reset()
