"""Prompt types accepted by `LLM.generate` (vLLM's TextPrompt / TokensPrompt)."""

from __future__ import annotations

from typing import Any, TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]
    """{"image": a PIL image or a list of them} (vision-language models; `pagedllm/multimodal/`)."""
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]
