"""Prompt types accepted by `LLM.generate` (vLLM's TextPrompt / TokensPrompt)."""

from __future__ import annotations

from typing import TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]
