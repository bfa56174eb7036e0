"""Request models reject what used to be coerced or crash later (issue 14, findings 3, 4, 9), and
request-supplied chat templates render in a sandbox with time and size limits (finding 1)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai.protocol import (
    MAX_JSON_DEPTH,
    ChatCompletionRequest,
    CompletionRequest,
    messages_as_dicts,
)
from pagedllm.entrypoints.openai.protocol_tokenization import TokenizeCompletionRequest
from pagedllm.entrypoints.template_sandbox import TemplateLimitError, TemplateSandbox


def parse(model: type, raw: str) -> Any:
    """As FastAPI does: the standard json module (which accepts NaN and lone surrogates), then validation."""
    return model.model_validate(json.loads(raw))


@pytest.mark.parametrize(
    "raw,field",
    [
        ('{"prompt": "x", "n": true}', "n"),
        ('{"prompt": "x", "max_tokens": "16"}', "max_tokens"),
        ('{"prompt": [[false]]}', "prompt"),
        ('{"prompt": "x", "seed": 18446744073709551616}', "seed"),
        ('{"prompt": "x", "seed": -9223372036854775809}', "seed"),
        ('{"prompt": "x", "priority": 1180591620717411303424}', "priority"),
        ('{"prompt": "x", "stop_token_ids": [100000000000000000000]}', "stop_token_ids"),
        ('{"prompt": [-1]}', "prompt"),
        ('{"prompt": "x", "temperature": NaN}', "temperature"),
        ('{"prompt": "x", "top_p": Infinity}', "top_p"),
        ('{"prompt": "x", "frequency_penalty": -Infinity}', "frequency_penalty"),
    ],
)
def test_completion_request_is_strict(raw: str, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse(CompletionRequest, raw)
    assert field in str(info.value)


def test_valid_values_still_pass() -> None:
    req = parse(CompletionRequest, '{"prompt": [1, 2], "seed": -1, "temperature": 1, "priority": -5}')
    assert req.temperature == 1.0 and req.seed == -1 and req.prompt == [1, 2]
    assert parse(CompletionRequest, '{"prompt": "x", "seed": 9223372036854775807}').seed == 2**63 - 1


@pytest.mark.parametrize(
    "raw", ['{"prompt": "a\\ud800b"}', '{"prompt": "x", "u\\udfff": 1}', '{"prompt": "x", "user": "\\udc00"}']
)
def test_lone_surrogates_rejected(raw: str) -> None:
    with pytest.raises(ValidationError, match="lone surrogate"):
        parse(CompletionRequest, raw)
    with pytest.raises(ValidationError, match="lone surrogate"):
        parse(TokenizeCompletionRequest, raw)


def test_depth_limit() -> None:
    ok = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    parse(CompletionRequest, f'{{"prompt": "x", "extra": {ok}}}')
    deep = "[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5)
    with pytest.raises(ValidationError, match="nested deeper"):
        parse(CompletionRequest, f'{{"prompt": "x", "extra": {deep}}}')


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
def test_depth_limit_counts_scalars_in_lists(levels: int) -> None:
    """Numbers inside the innermost list sit one level deeper than it (checked without a call per number)."""
    value = "[" * levels + "1, 2.5, true, null" + "]" * levels
    if levels + 1 <= MAX_JSON_DEPTH:
        parse(CompletionRequest, f'{{"prompt": "x", "extra": {value}}}')
    else:
        with pytest.raises(ValidationError, match="nested deeper"):
            parse(CompletionRequest, f'{{"prompt": "x", "extra": {value}}}')


def test_chat_messages_are_typed() -> None:
    req = parse(
        ChatCompletionRequest,
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}], "reasoning_content": "r"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                ]
            }
        ),
    )
    assert messages_as_dicts(req.messages) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}], "reasoning_content": "r"},
        {"role": "assistant", "tool_calls": [{"id": "1"}]},
    ]
    for bad in (
        '{"messages": ["hi"]}',
        '{"messages": [{"role": "wizard"}]}',
        '{"messages": [{"role": "user", "content": 5}]}',
    ):
        with pytest.raises(ValidationError):
            parse(ChatCompletionRequest, bad)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    )
)
def test_any_json_value_validates_or_raises_validation_error(value: Any) -> None:
    """Whatever JSON-like value a client sends as a field, parsing ends in a model or a ValidationError
    (a 400), never another exception (a 500)."""
    for field in ("prompt", "messages", "stop", "logit_bias", "temperature", "n", "seed"):
        model = ChatCompletionRequest if field == "messages" else CompletionRequest
        body = {field: value} if field in ("prompt", "messages") else {"prompt": "x", field: value}
        try:
            model.model_validate(body)
        except ValidationError:
            pass


# ---- the template sandbox ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox(smollm2_tokenizer: Any):  # noqa: ANN201
    box = TemplateSandbox(smollm2_tokenizer, timeout_s=2.0, max_output_chars=10_000)
    yield box
    box.close()


def test_sandbox_renders_like_apply_chat_template(sandbox: TemplateSandbox, smollm2_tokenizer: Any) -> None:
    conv = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ bos_token }}"
    kwargs = {"conversation": conv, "chat_template": template, "add_generation_prompt": False}
    assert sandbox.render_blocking(**kwargs) == apply_chat_template(smollm2_tokenizer, **kwargs)


@pytest.mark.parametrize(
    "template,message",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
        ("{{ 'x' * 500000000 }}", "longer than|exceeds"),  # which limit comes first depends on the CPU
        ("{% for i in range(20) %}{{ 'x' * 1000 }}{% endfor %}", "exceeds 10000"),
        ("{{ raise_exception('nope') }}", "nope"),
        ("{{ ''.__class__.__mro__ }}", "chat_template"),
    ],
)
def test_sandbox_limits(sandbox: TemplateSandbox, template: str, message: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=message) as info:
        sandbox.render_blocking(conversation=[{"role": "user", "content": "hi"}], chat_template=template)
    assert str(info.value).startswith("chat_template")
    assert time.monotonic() - t0 < 15  # 2 s limit (+ the child's restart after a kill)
    assert (
        sandbox.render_blocking(
            conversation=[{"role": "user", "content": "ok"}], chat_template="{{ messages[0].content }}"
        )
        == "ok"
    )


# ---- the chat-template and tokenizer input paths, fuzzed ----------------------------------------------
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)  # any valid Unicode text


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), _TEXT | st.sampled_from(["{{ 7*7 }}", "{% x %}"])),
        min_size=1,
        max_size=4,
    )
)
def test_chat_template_renders_any_text_verbatim(smollm2_tokenizer: Any, turns: list[tuple[str, str]]) -> None:
    """Any message text renders through the model's template as data (never evaluated as Jinja, never
    an error other than ValueError)."""
    conv = [{"role": r, "content": c} for r, c in turns]
    try:
        text = apply_chat_template(smollm2_tokenizer, conv)
    except ValueError:
        return
    for _, content in turns:
        assert content.strip() in text


@settings(max_examples=100, deadline=None)
@given(_TEXT)
def test_tokenizer_round_trips_any_text(smollm2_tokenizer: Any, text: str) -> None:
    """The prompt path's tokenizer: token ids inside the vocabulary for any text; decoding gives the text
    back when it is made of assigned, visible characters (letters, marks, numbers, punctuation, symbols,
    spaces: the GGUF's byte-level vocabulary lacks some bytes that control, private-use and unassigned code
    points need)."""
    import unicodedata

    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= t < len(smollm2_tokenizer) for t in ids)
    if all(unicodedata.category(c)[0] in "LMNPSZ" for c in text):
        assert smollm2_tokenizer.decode(ids) == text
