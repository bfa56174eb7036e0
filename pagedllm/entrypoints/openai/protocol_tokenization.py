"""Request and response bodies of POST /tokenize and /detokenize (vLLM's extensions), strict like the other
requests (`protocol.py`'s `OpenAIRequestModel`). Apart from the generation routes' bodies as the pooling routes'
are (`protocol_pooling.py`)."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionMessageParam,
    ChatCompletionToolsParam,
    OpenAIBaseModel,
    OpenAIRequestModel,
    TokenId,
)


class TokenizeCompletionRequest(OpenAIRequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIRequestModel):
    model: str | None = None
    messages: list[ChatCompletionMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
