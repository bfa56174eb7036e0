"""`structured_outputs_config` / `reasoning_parser` engine arguments and the front end's constraint check
(no model needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from pagedllm import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import choice_ebnf, grammar_key, validate  # noqa: E402
from pagedllm.structured_output.config import StructuredOutputsConfig  # noqa: E402


def test_config_from_dict_and_json() -> None:
    cfg = StructuredOutputsConfig.from_value('{"backend": "xgrammar", "disable_any_whitespace": true}')
    assert cfg.backend == "xgrammar" and cfg.disable_any_whitespace
    assert StructuredOutputsConfig.from_value(None) == StructuredOutputsConfig()
    for bad, field in [
        ({"backend": "outlines"}, "structured_outputs_config.backend"),
        ({"nope": 1}, "structured_outputs_config"),
        ("{not json", "structured_outputs_config"),
        ({"max_whitespace_count": -1}, "structured_outputs_config.max_whitespace_count"),
        ({"reasoning_parser": "no_such_parser"}, "reasoning_parser"),
    ]:
        with pytest.raises(ValueError, match=rf"^{field}: "):
            StructuredOutputsConfig.from_value(bad)  # type: ignore[arg-type]


def test_engine_args_carry_the_config() -> None:
    from pagedllm import EngineArgs

    with pytest.raises(ValueError, match=r"^reasoning_parser: unknown parser"):
        EngineArgs(reasoning_parser="no_such_parser", load_format="dummy").create_engine_config()


def test_validate_names_the_field() -> None:
    validate(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    validate(StructuredOutputsParams(regex=r"\d+"))
    validate(StructuredOutputsParams(grammar='root ::= "a" | "b"'))
    validate(StructuredOutputsParams(choice=['say "hi"', "a\\b", "naïve"]))
    for so, field in [
        (StructuredOutputsParams(json="{"), "structured_outputs.json"),
        (StructuredOutputsParams(json={"type": 5}), "structured_outputs.json"),
        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
        (StructuredOutputsParams(structural_tag="{"), "structured_outputs.structural_tag"),
    ]:
        with pytest.raises(ValueError, match=rf"^{field}: invalid"):
            validate(so)


def test_choice_grammar_escapes_and_keys() -> None:
    assert choice_ebnf(['a"b']) == 'root ::= "a\\"b"'
    cfg = StructuredOutputsConfig()
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json={"a": 2, "b": 1})
    assert grammar_key(a, cfg) == grammar_key(b, cfg)  # one compilation for equal schemas
    assert grammar_key(a, cfg) != grammar_key(
        StructuredOutputsParams(json={"a": 2, "b": 1}, disable_any_whitespace=True), cfg
    )


def test_speculative_decoding_is_rejected() -> None:
    from types import SimpleNamespace

    from pagedllm import SamplingParams
    from pagedllm.engine.input_processor import InputProcessor

    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    proc = SimpleNamespace(speculative=True, tokenizer=object(), structured_outputs_config=None)
    with pytest.raises(ValueError, match=r"^structured_outputs: not supported together with speculative decoding"):
        InputProcessor.validate_structured_outputs(proc, sp)  # type: ignore[arg-type]
    proc.speculative = False
    InputProcessor.validate_structured_outputs(proc, sp)  # type: ignore[arg-type]
    proc.tokenizer = None
    with pytest.raises(ValueError, match=r"^structured_outputs: needs a tokenizer"):
        InputProcessor.validate_structured_outputs(proc, sp)  # type: ignore[arg-type]
