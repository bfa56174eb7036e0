"""Streamed chunks built as text around msgspec-encoded strings, for the common case (one choice, no
logprobs, no usage): the same JSON value as the pydantic models' `model_dump_json()`
(`tests/entrypoints/openai/test_chunk_json.py`) at about a seventh of the cost. A streamed token's chunk is
built hundreds of thousands of times a minute where the API server, not the model, sets the pace (NOTES
"Online serving")."""

from __future__ import annotations

import msgspec

_enc = msgspec.json.encode


def _j(value: object) -> str:
    return _enc(value).decode()


def chunk_head(obj: str, rid: str, created: int, model: str) -> str:
    """The constant start of one stream's chunks (`obj`: "text_completion" or "chat.completion.chunk"), up to
    the choice's index."""
    return f'{{"id":{_j(rid)},"object":"{obj}","created":{created},"model":{_j(model)},"choices":[{{"index":'


def _tail(finish_reason: str | None, stop_reason: int | str | None) -> str:
    return f'"logprobs":null,"finish_reason":{_j(finish_reason)},"stop_reason":{_j(stop_reason)}}}],"usage":null}}'


def text_chunk_json(head: str, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
    """A `CompletionStreamResponse` chunk."""
    return f'{head}{index},"text":{_j(text)},{_tail(finish_reason, stop_reason)}'


def content_chunk_json(
    head: str, index: int, content: str, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A `ChatCompletionStreamResponse` chunk whose delta is `DeltaMessage(content=content)`."""
    delta = f'{{"role":null,"content":{_j(content)},"reasoning_content":null,"reasoning":null,"tool_calls":[]}}'
    return f'{head}{index},"delta":{delta},{_tail(finish_reason, stop_reason)}'
