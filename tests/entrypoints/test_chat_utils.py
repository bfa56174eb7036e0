"""apply_chat_template / load_chat_template with the SmolLM2 tokenizer's own template."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from pagedllm.entrypoints.chat_utils import apply_chat_template, load_chat_template

SIMPLE_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}{{ suffix | default('') }}"
)


def test_default_template(smollm2_tokenizer: Any) -> None:
    text = apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_no_generation_prompt_and_system(smollm2_tokenizer: Any) -> None:
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = apply_chat_template(smollm2_tokenizer, conv, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_text_parts_joined_and_input_not_mutated(smollm2_tokenizer: Any) -> None:
    conv = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    before = copy.deepcopy(conv)
    text = apply_chat_template(smollm2_tokenizer, conv)
    assert "<|im_start|>user\none\ntwo<|im_end|>" in text
    assert conv == before


def test_continue_final_message(smollm2_tokenizer: Any) -> None:
    conv = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = apply_chat_template(smollm2_tokenizer, conv, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2,")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        apply_chat_template(smollm2_tokenizer, conv, add_generation_prompt=True, continue_final_message=True)


def test_none_content(smollm2_tokenizer: Any) -> None:
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]
    text = apply_chat_template(smollm2_tokenizer, conv, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n<|im_end|>\n")


@pytest.mark.parametrize(
    ("conv", "field"),
    [
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], r"messages\[0\]"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"content\[0\]\.type"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\]\.text"),
    ],
)
def test_validation(smollm2_tokenizer: Any, conv: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        apply_chat_template(smollm2_tokenizer, conv)


def test_custom_template_string_file_and_kwargs(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    conv = [{"role": "user", "content": "hi"}]
    text = apply_chat_template(smollm2_tokenizer, conv, chat_template=SIMPLE_TEMPLATE)
    assert text == "[user]hi\n[assistant]"
    path = tmp_path / "t.jinja"
    path.write_text(SIMPLE_TEMPLATE)
    assert load_chat_template(str(path)) == SIMPLE_TEMPLATE
    text = apply_chat_template(smollm2_tokenizer, conv, chat_template=str(path), chat_template_kwargs={"suffix": "!"})
    assert text == "[user]hi\n[assistant]!"


def test_reserved_kwargs_rejected(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        apply_chat_template(
            smollm2_tokenizer, [{"role": "user", "content": "x"}], chat_template_kwargs={"tokenize": True}
        )


def test_load_chat_template_missing_file() -> None:
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template("/no/such/template.jinja")
    assert load_chat_template("{{ x }}") == "{{ x }}"


def test_no_template_at_all() -> None:
    class NoTemplateTokenizer:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(NoTemplateTokenizer(), [{"role": "user", "content": "x"}])  # type: ignore[arg-type]


def test_template_render_error_is_value_error(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="chat_template"):
        apply_chat_template(
            smollm2_tokenizer,
            [{"role": "user", "content": "x"}],
            chat_template="{{ raise_exception('nope') }}",
        )


HERMES_TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"


def test_tool_call_arguments_reach_templates_as_objects(smollm2_tokenizer: Any) -> None:
    """OpenAI clients send tool-call arguments as JSON text; templates get the object (as vLLM), the
    caller's messages are left as they were, and arguments that are not JSON are a ValueError naming them."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conv = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    before = copy.deepcopy(conv)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city"}}]
    text = apply_chat_template(smollm2_tokenizer, conv, chat_template=str(HERMES_TEMPLATE), tools=tools)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "Weather of a city" in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert conv == before
    bad = copy.deepcopy(conv)
    for args in ("{city: Paris", "[" * 100_000):  # not JSON; nested too deep for the json module
        bad[1]["tool_calls"][0]["function"]["arguments"] = args
        with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
            apply_chat_template(smollm2_tokenizer, bad, chat_template=str(HERMES_TEMPLATE), tools=tools)


def test_llm_chat_with_tools(smollm2_llm: Any) -> None:
    """`LLM.chat(..., tools=...)` renders the tool definitions into the prompt."""
    tools = [{"type": "function", "function": {"name": "lookup_capital", "description": "Capital of a country"}}]
    prompts = smollm2_llm._chat_prompts(
        [{"role": "user", "content": "Capital of France?"}], chat_template=str(HERMES_TEMPLATE), tools=tools
    )
    assert "lookup_capital" in prompts[0]["prompt"] and "Capital of a country" in prompts[0]["prompt"]
