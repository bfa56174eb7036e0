"""The streamed chunks built without pydantic (`chunk_json.py`) are the same JSON values as the pydantic models'
`model_dump_json()`, for awkward texts, ids and model names."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from pagedllm.entrypoints.openai.chunk_json import chunk_head, content_chunk_json, text_chunk_json  # noqa: E402
from pagedllm.entrypoints.openai.protocol import (  # noqa: E402
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
)

TEXTS = [
    "",
    " hello",
    'quote " and \\ backslash',
    "line\nbreak\ttab\r",
    "\x00\x1f\x7f",
    "é ü 中文 🙂",
    "\u2028\u2029",
    "</script>",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [(None, None), ("stop", None), ("stop", "###"), ("stop", 7), ("length", None)])
def test_text_chunk_json_equals_pydantic(text: str, finish: tuple[str | None, int | str | None]) -> None:
    rid, created, model = 'cmpl-"x"\\', 1_700_000_000, "smol/ü"
    ref = CompletionStreamResponse(
        id=rid,
        created=created,
        model=model,
        choices=[CompletionResponseStreamChoice(index=3, text=text, finish_reason=finish[0], stop_reason=finish[1])],
    ).model_dump_json()
    got = text_chunk_json(chunk_head("text_completion", rid, created, model), 3, text, finish[0], finish[1])
    assert json.loads(got) == json.loads(ref)
    chat_ref = ChatCompletionStreamResponse(
        id=rid,
        created=created,
        model=model,
        choices=[
            ChatCompletionResponseStreamChoice(
                index=1, delta=DeltaMessage(content=text), finish_reason=finish[0], stop_reason=finish[1]
            )
        ],
    ).model_dump_json()
    chat = content_chunk_json(chunk_head("chat.completion.chunk", rid, created, model), 1, text, *finish)
    assert json.loads(chat) == json.loads(chat_ref)
