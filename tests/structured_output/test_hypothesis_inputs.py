"""Hypothesis over the structured-output input paths (issue 14, acceptance 2): any JSON value as a schema,
any text as a regex or an EBNF grammar, any choice list, any `response_format` / `structured_outputs` /
`guided_*` body, either validates or fails with a ValueError / ValidationError naming the field (a 400),
never another exception (a 500) and never a crash of the process."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

pytest.importorskip("xgrammar")

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from pagedllm.entrypoints.openai.structured_outputs import check, structured_outputs_from_request  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import validate  # noqa: E402

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYWORDS = st.sampled_from(
    ["type", "properties", "items", "required", "enum", "const", "minimum", "maximum", "minItems", "maxItems",
     "minLength", "maxLength", "pattern", "additionalProperties", "anyOf", "oneOf", "allOf", "$ref", "$defs",
     "format", "prefixItems", "not", "multipleOf", "exclusiveMinimum"]
)  # fmt: skip
TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "nope"])
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12) | TYPES
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYWORDS | st.text(max_size=8), inner, max_size=5),
    max_leaves=25,
)
schemas = st.dictionaries(KEYWORDS, json_values, max_size=6)


def _params_or_value_error(**kw: Any) -> StructuredOutputsParams | None:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError:
        return None


def _validate(**kw: Any) -> None:
    params = _params_or_value_error(**kw)
    if params is None:
        return
    try:
        validate(params)
    except ValueError as e:
        assert str(e).startswith("structured_outputs."), e


@SETTINGS
@given(schema=schemas | json_values)
def test_any_json_schema_validates_or_raises_value_error(schema: Any) -> None:
    _validate(json=schema)


@SETTINGS
@given(regex=st.text(max_size=40) | st.from_regex(r"[\[\](){}*+?|^$\\.a-z0-9-]{0,30}", fullmatch=True))
def test_any_regex_validates_or_raises_value_error(regex: str) -> None:
    _validate(regex=regex)


@SETTINGS
@given(grammar=st.text(max_size=60) | st.from_regex(r'root ::= [a-z" |()*+?:=\[\]-]{0,40}', fullmatch=True))
def test_any_grammar_validates_or_raises_value_error(grammar: str) -> None:
    _validate(grammar=grammar)


@SETTINGS
@given(choice=st.lists(st.text(max_size=10), max_size=5))
def test_any_choice_validates_or_raises_value_error(choice: list[str]) -> None:
    _validate(choice=choice)


@SETTINGS
@given(
    rf=st.dictionaries(
        st.sampled_from(["type", "json_schema", "schema", "name", "strict"]),
        json_values | st.fixed_dictionaries({"name": st.text(max_size=5), "schema": schemas}),
        max_size=3,
    ),
    guided=st.dictionaries(
        st.sampled_from(["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"]),
        json_values,
        max_size=2,
    ),
)
def test_any_request_body_validates_or_raises(rf: dict[str, Any], guided: dict[str, Any]) -> None:
    """The request models then the body-to-params mapping: a model or ValidationError, then params or a
    ValueError naming the field."""
    for model, body in (
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "response_format": rf, **guided}),
        (CompletionRequest, {"prompt": "hi", "response_format": rf, **guided}),
    ):
        try:
            req = model.model_validate(body)
        except ValidationError:
            continue
        try:
            params, source = structured_outputs_from_request(req)
            if params is not None:
                check(params, source)
        except ValueError as e:  # a StructuredOutputsRequestError: the server's 400 naming `param`
            assert getattr(e, "param", None), e
