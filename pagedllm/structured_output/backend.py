"""The xgrammar backend: a `StructuredOutputsParams` -> a compiled grammar -> per-request matchers.

`validate` checks a constraint without a tokenizer (cheap: the front end calls it before queueing);
`XgrammarBackend.compile` needs the tokenizer's vocabulary and runs in the manager's compile threads.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.config import StructuredOutputsConfig

if TYPE_CHECKING:
    import xgrammar as xgr

GrammarKey = tuple[str, str, bool, bool, int | None]


def _json_text(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _no_additional_properties(schema: Any) -> Any:
    """A copy of the schema where every object without an `additionalProperties` rule forbids extra keys."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def grammar_key(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> GrammarKey:
    """What the compiled grammar depends on: equal keys share one compilation."""
    kind = params.kind
    value: Any = getattr(params, kind)
    text = _json_text(value) if kind in ("json", "choice", "json_object") else str(value)
    compact = params.disable_any_whitespace or config.disable_any_whitespace
    no_extra = params.disable_additional_properties or config.disable_additional_properties
    return (kind, text, compact, no_extra, config.max_whitespace_count)


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema(params: StructuredOutputsParams, no_extra: bool) -> str | dict[str, Any]:
    value = params.json
    assert value is not None
    if no_extra:
        loaded = json.loads(value) if isinstance(value, str) else value
        return _no_additional_properties(loaded)
    return value


def _structural_tag_args(text: str) -> tuple[Any, ...]:
    """xgrammar's structural tag: the current format (one JSON object) or vLLM's older
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    import xgrammar as xgr

    data = json.loads(text)
    if isinstance(data, dict) and "structures" in data:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in data["structures"]
        ]
        return (items, data["triggers"])
    return (text,)


_FIELD = {
    "json": "structured_outputs.json",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
    "json_object": "structured_outputs.json_object",
    "structural_tag": "structured_outputs.structural_tag",
}


def validate(params: StructuredOutputsParams, config: StructuredOutputsConfig | None = None) -> None:
    """ValueError naming the field for a constraint xgrammar cannot parse (invalid JSON schema, regex,
    EBNF grammar or structural tag). No tokenizer needed."""
    import xgrammar as xgr

    config = config or StructuredOutputsConfig()
    kind = params.kind
    what = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar"}.get(kind, kind)
    grammar: xgr.Grammar | None = None
    try:
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(
                _schema(params, config.disable_additional_properties), any_whitespace=False
            )
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(params.regex or "")
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(params.grammar or "")
        elif kind == "choice":
            grammar = xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
        elif kind == "structural_tag":
            grammar = xgr.Grammar.from_structural_tag(*_structural_tag_args(params.structural_tag or ""))
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{_FIELD[kind]}: invalid {what}: {_short(e)}") from None
    if grammar is not None and _matches_nothing(grammar):
        raise ValueError(f"{_FIELD[kind]}: invalid {what}: no text can match it")


@functools.cache
def _byte_compiler() -> xgr.GrammarCompiler:
    """A compiler over a vocabulary of the 256 single bytes and a stop token (cheap: no tokenizer)."""
    import xgrammar as xgr

    vocab = [bytes([i]) for i in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


_MAX_EMPTINESS_CHECK_CHARS = 32768
"""Larger grammars (as EBNF text) skip `_matches_nothing`: compiling them can take seconds even over 257
tokens (a JSON object of 3000 optional properties: ~50 s), while a grammar matching nothing is small."""


def _matches_nothing(grammar: xgr.Grammar) -> bool:
    """Whether the grammar allows no first byte and not the empty text either (e.g. a JSON schema whose
    `$ref`s only recurse): its requests would fail at their first token, as a grammar error. Grammars
    above `_MAX_EMPTINESS_CHECK_CHARS` are not checked (False)."""
    import xgrammar as xgr

    if len(str(grammar)) > _MAX_EMPTINESS_CHECK_CHARS:
        return False
    compiled = _byte_compiler().compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def _short(e: BaseException) -> str:
    """xgrammar's C++ errors start with a source location ("[time] file.cc:123: ..."): keep the message."""
    msg = str(e).strip()
    if msg.startswith("[") and ": " in msg:
        msg = msg.split(": ", 1)[1]
    return msg.splitlines()[0] if msg else type(e).__name__


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, over the ids it has text for: min(the model's vocabulary, the tokenizer's).
    The rest of the model's (padded) vocabulary is never allowed under a grammar; xgrammar is given only these, since
    padding ids it cannot read make its fill ~150x slower (64 rows inside a JSON string: 20 ms instead of 0.13 ms
    with a 49k tokenizer on a 152k model)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=min(vocab_size, len(tokenizer)), stop_token_ids=list(stop_token_ids)
    )


class XgrammarBackend:
    """Compiles constraints for one tokenizer (thread-safe: xgrammar's compiler may be called concurrently)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], config: StructuredOutputsConfig
    ) -> None:
        self._setup(tokenizer_info(tokenizer, vocab_size, stop_token_ids), vocab_size, config)

    @classmethod
    def from_tokenizer_info(cls, info_json: str, vocab_size: int, config: StructuredOutputsConfig) -> XgrammarBackend:
        """A backend from `tokenizer_info(...).serialize_json()`: no tokenizer loaded (the grammar server's start;
        a GGUF's tokenizer takes seconds to build)."""
        import xgrammar as xgr

        self = cls.__new__(cls)
        self._setup(xgr.TokenizerInfo.deserialize_json(info_json), vocab_size, config)
        return self

    def _setup(self, info: xgr.TokenizerInfo, vocab_size: int, config: StructuredOutputsConfig) -> None:
        import xgrammar as xgr

        self.config = config
        self.vocab_size = vocab_size
        self.valid_vocab = info.vocab_size
        """Ids the tokenizer has text for (`tokenizer_info`)."""
        self.tokenizer_info = info
        # A grammar's per-state token masks are computed in parallel: a new schema's first token waits for it.
        # xgrammar's cache (besides the manager's, by request key) keeps the token masks of the rules a grammar
        # is built from: a new JSON schema whose fields are strings, numbers, arrays, ... like an earlier one's
        # compiles in a few ms instead of a pass over the whole vocabulary (~55 ms on a GPU host, 300 ms here).
        threads = min(16, os.cpu_count() or 1)
        cache_mb = envs.PAGEDLLM_XGRAMMAR_CACHE_MB
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=threads, cache_enabled=cache_mb > 0, cache_limit_bytes=cache_mb << 20
        )

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, _, compact, no_extra, max_ws = grammar_key(params, self.config)
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(
                _schema(params, no_extra), any_whitespace=not compact, max_whitespace_cnt=None if compact else max_ws
            )
        if kind == "json_object":
            return c.compile_json_schema(
                '{"type": "object"}', any_whitespace=not compact, max_whitespace_cnt=None if compact else max_ws
            )
        if kind == "regex":
            return c.compile_regex(params.regex or "")
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(params.choice or []))
        if kind == "grammar":
            return c.compile_grammar(params.grammar or "")
        return c.compile_structural_tag(*_structural_tag_args(params.structural_tag or ""))

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)
