"""`speculative_config` as vLLM names it: a dict (or `--speculative-config` JSON) with `method`,
`num_speculative_tokens`, `model`, `prompt_lookup_max` / `prompt_lookup_min`, `disable_by_batch_size`,
plus the top-level aliases `spec_method` / `spec_model` / `spec_tokens`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedllm.utils import json_dict_option

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
"""Accepted values of `method` ("[ngram]" is vLLM's older spelling of "ngram")."""


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    """The draft model or EAGLE head (a HF directory); None for n-gram."""
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    """No proposals in a step that runs more than this many requests (vLLM's option, same name): above
    some batch size verifying k extra tokens per request costs more than the accepted ones save."""
    draft_tensor_parallel_size: int | None = None
    quantization: str | None = None
    max_model_len: int | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method in ("draft_model", "eagle", "eagle3")

    @classmethod
    def from_args(
        cls,
        speculative_config: dict[str, Any] | str | None = None,
        spec_method: str | None = None,
        spec_model: str | None = None,
        spec_tokens: int | None = None,
    ) -> SpeculativeConfig | None:
        """The config from the dict / JSON and the aliases (an alias fills a key the dict leaves out, and
        must agree with it otherwise); None when speculation is off. Errors name the field."""
        d = json_dict_option(speculative_config, "speculative_config")
        for alias, key, value in (
            ("spec_method", "method", spec_method),
            ("spec_model", "model", spec_model),
            ("spec_tokens", "num_speculative_tokens", spec_tokens),
        ):
            if value is None:
                continue
            if key in d and d[key] != value:
                raise ValueError(f"{alias}: {value!r} contradicts speculative_config.{key}={d[key]!r}")
            d[key] = value
        if not d:
            return None
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        method = d.get("method")
        if method is None:  # as vLLM: a model means a draft model, none means nothing to infer from
            if d.get("model") is None:
                raise ValueError("speculative_config.method: required (one of ngram, draft_model, eagle, eagle3)")
            method = "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method: unknown method {method!r}; expected one of {', '.join(METHODS)}"
            )
        d["method"] = method
        k = d.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}")
        cfg = cls(**d)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:  # vLLM's defaults
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"speculative_config.{name}: must be an integer >= 1, got {v!r}")
            assert lo is not None and hi is not None
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min: {lo} is larger than prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
            if self.model is not None:
                raise ValueError("speculative_config.model: n-gram speculation takes no model")
        elif not self.model:
            raise ValueError(f"speculative_config.model: required for method {self.method!r}")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size: must be an integer >= 1, got {b!r}")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError("speculative_config.draft_tensor_parallel_size: only 1 is supported")
