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


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """One output constraint (vLLM's `StructuredOutputsParams`): exactly one of the six kinds is set."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (dict or its JSON text)."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """An EBNF (GBNF) grammar."""
    json_object: bool | None = None
    """Any JSON object."""
    structural_tag: str | None = None
    """xgrammar's structural tag, as JSON text."""
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) > 1:
            raise ValueError(f"structured_outputs: only one kind of constraint may be given, got {', '.join(kinds)}")
        if not kinds:
            raise ValueError(f"structured_outputs: one of {', '.join(_CONSTRAINT_KINDS)} must be given")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: `json`, `regex`, `choice`, `grammar`, `json_object` or `structural_tag`."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """Invalid values raise `ValueError` naming the field, at construction."""

    n: int = 1
    best_of: int | None = None
    """Accepted for compatibility; must equal n when given (vLLM v1 dropped best_of > n)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output (not the prompt)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output (not the prompt)."""
    repetition_penalty: float = 1.0
    """HF/CTRL penalty for tokens in the prompt or the output: positive logits divided by it,
    negative ones multiplied."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    """Per generated token: the sampled token's logprob and rank plus the top `logprobs` tokens
    (0 = only the sampled token, -1 = the whole vocabulary). None = no logprobs."""
    prompt_logprobs: int | None = None
    """Per prompt token (after the first): its logprob and rank plus the top `prompt_logprobs` tokens.
    Such requests skip the prefix cache (every prompt position needs its logits)."""
    logprob_token_ids: list[int] | None = None
    """Token ids whose logprob (and rank) is also reported at every position that reports logprobs."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit (clamped to [-100, 100], as vLLM)."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated."""
    bad_words: list[str] | None = None
    """Words never to generate; a multi-token word is blocked at its last token, when the output ends
    with the word's other tokens."""
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
    extra_args: dict[str, Any] | None = None
    """Free-form per-request arguments for custom logits processors."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (`pagedllm.structured_output`)."""
    # Filled in by the input processor (not by users).
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)
    eos_token_id: int | None = None
    bad_words_token_ids: list[list[int]] | None = None
    """`bad_words` tokenized (with and without a leading space), by the input processor."""

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
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias: keys must be token ids and values numbers ({e})") from None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.top_k is None or self.top_k < 0:  # -1 also means "off", as in older vLLM
            self.top_k = 0 if self.top_k is None or self.top_k == -1 else self.top_k
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: other knobs do not matter; normalise them so the sampler can take its fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"{field}: {msg}")

        for name in ("n", "best_of", "top_k", "seed", "logprobs", "prompt_logprobs", "max_tokens", "min_tokens"):
            v = getattr(self, name)  # the engine core's batch arrays hold them as int64
            if isinstance(v, int) and not -(2**63) <= v < 2**63:
                raise bad(name, f"must fit in a signed 64-bit integer, got {v}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature is None or self.temperature < 0.0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if self.best_of is not None and self.best_of != self.n:
            raise bad("best_of", f"must equal n={self.n} (best_of > n is not supported), got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {v}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < -1):
                raise bad(name, f"must be -1 (all), 0 or a positive integer, got {v!r}")
        for name in ("logprob_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise bad(name, "must be non-negative integer token ids")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must not be empty")
        if self.logit_bias is not None and any(t < 0 for t in self.logit_bias):
            raise bad("logit_bias", "token ids must be non-negative")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be non-empty strings")
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

    @property
    def has_penalties(self) -> bool:
        return (
            abs(self.presence_penalty) >= _SAMPLING_EPS
            or abs(self.frequency_penalty) >= _SAMPLING_EPS
            or abs(self.repetition_penalty - 1.0) >= _SAMPLING_EPS
        )

    def verify_against_vocab(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks needing the model: token ids inside the vocabulary, logprob counts <= max_logprobs
        (-1 = no limit; a request for -1 counts as the whole vocabulary, as vLLM)."""
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                k = vocab_size if v == -1 else v
                if k > limit:
                    raise ValueError(f"{name}: requested {k} logprobs, more than max_logprobs={limit}")
        checks: list[tuple[str, Any]] = [
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logprob_token_ids", self.logprob_token_ids or ()),
            ("stop_token_ids", self.stop_token_ids or ()),  # (min_tokens masks them in the logits)
            ("bad_words", [t for w in self.bad_words_token_ids or () for t in w]),
        ]
        for name, ids in checks:
            bad_ids = [t for t in ids if t >= vocab_size]
            if bad_ids:
                raise ValueError(f"{name}: token id {bad_ids[0]} is out of the vocabulary (size {vocab_size})")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` as vLLM does: each word alone and with a leading space (the second kept
        only when it tokenizes differently but to as many tokens)."""
        if not self.bad_words:
            return
        out: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if plain:
                out.append(plain)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        self.bad_words_token_ids = out

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """Parameters of `LLM.beam_search` (vLLM's names and defaults)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width: must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature: must be non-negative, got {self.temperature}")
