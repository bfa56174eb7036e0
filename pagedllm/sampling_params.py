"""Sampling parameters of one request (vLLM's names and defaults)."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0
    """Every output carries all text/tokens so far."""
    DELTA = 1
    """Every output carries only what is new since the last one."""
    FINAL_ONLY = 2
    """Only the finished output is returned."""


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """Invalid values raise `ValueError` naming the field, at construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the input processor (not by users).
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed == -1:
            self.seed = None
        if self.top_k is None or self.top_k < 0:  # -1 also means "off", as in older vLLM
            self.top_k = 0 if self.top_k is None or self.top_k == -1 else self.top_k
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: other knobs do not matter; normalise them so the sampler can take its fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"{field}: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature is None or self.temperature < 0.0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):  # type: ignore[union-attr]
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not self.detokenize and self.stop:
            raise bad("stop", "stop strings need detokenize=True")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        return cls(**{k: v for k, v in kwargs.items() if v is not None})
