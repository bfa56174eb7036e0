"""Request and response bodies of the OpenAI-compatible API (pydantic v2), field for field as OpenAI's,
plus vLLM's extra sampling parameters. Unknown request fields are accepted and ignored (as vLLM).

Request bodies are strict: no coercion (`n: true`, `max_tokens: "16"` and `prompt: [[false]]` are 400s,
not 1, 16 and token 0), no NaN or infinity in any number, integers that go to the engine within int64
(the core's msgspec/torch types), text that is valid Unicode (a lone surrogate such as `"\ud800"` cannot
be encoded to UTF-8, so the tokenizer would fail on it) and JSON nested at most `MAX_JSON_DEPTH` deep.

The pooling routes' bodies are in `protocol_pooling.py`, those of /tokenize and /detokenize in
`protocol_tokenization.py`."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_JSON_DEPTH = 32
"""Deepest nesting of lists/objects accepted anywhere in a request body (chat messages with content
parts and tool schemas need well under 20)."""

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


def random_uuid() -> str:
    return uuid.uuid4().hex


_SCALARS = frozenset((int, float, bool, type(None)))
"""JSON values with nothing to check inside (their nesting is the list's plus one)."""


def check_json_value(value: Any, depth: int = 0, where: str = "body") -> None:
    """Raise ValueError for nesting deeper than MAX_JSON_DEPTH or strings that are not valid Unicode."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: invalid Unicode text (a lone surrogate {value[e.start]!r} at character {e.start})"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json_value(k, depth + 1, where)
            check_json_value(v, depth + 1, f"{where}.{k}" if depth == 0 else where)
    elif isinstance(value, list):
        deep = depth + 1 > MAX_JSON_DEPTH
        for v in value:
            if deep or type(v) not in _SCALARS:  # (a 512-token prompt's ids: 55 -> 6.5 us a request)
                check_json_value(v, depth + 1, where)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIRequestModel(OpenAIBaseModel):
    """Base of request bodies: strict types, finite numbers, valid Unicode, bounded nesting."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _check_raw(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for k, v in data.items():
                check_json_value(k, 1, "body")
                check_json_value(v, 1, str(k))
        return data


# ---- errors -----------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared ---------------------------------------------------------------------------------------
class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class StreamOptions(OpenAIRequestModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False
    """vLLM extension: usage in every chunk."""


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ChatCompletionContentPartText(OpenAIRequestModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIRequestModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ChatCompletionContentPartImage(OpenAIRequestModel):
    """An image part: a data URL, a file:// URL under --allowed-local-media-path, or an http(s) URL from
    --allowed-media-domains (vision-language models only)."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatCompletionMessageParam(OpenAIRequestModel):
    """One chat message. Other keys (e.g. `reasoning_content`) are passed to the chat template as given."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        str
        | list[Annotated[ChatCompletionContentPartText | ChatCompletionContentPartImage, Field(discriminator="type")]]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


def messages_as_dicts(messages: list[ChatCompletionMessageParam]) -> list[dict[str, Any]]:
    """The messages as plain dicts for the chat template (unset optional keys left out)."""
    return [m.model_dump(exclude_none=True) for m in messages]


class FunctionDefinition(OpenAIRequestModel):
    """A tool's function: its name and the JSON schema (an object) of its arguments."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIRequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIRequestModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIRequestModel):
    """`tool_choice` naming one function: the model must call it (arguments constrained to its schema)."""

    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class _SamplingRequest(OpenAIRequestModel):
    """Fields shared by completions and chat."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: Int64 = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extra parameters
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: Int64 = 0
    request_id: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    best_of: Int64 | None = None
    """Samples generated per prompt, of which the `n` with the highest cumulative logprob are returned
    (with use_beam_search: the beam width)."""
    echo: bool | None = False
    logprobs: Int64 | None = None
    max_tokens: Int64 | None = 16
    suffix: str | None = None
    # vLLM extra parameters
    add_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    """Beam search only: beams are ranked by cumulative logprob / length ** length_penalty."""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatCompletionMessageParam]
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    max_tokens: Int64 | None = Field(default=None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: Int64 | None = None
    response_format: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    """Default: "auto" when `tools` are given (which needs the server's --enable-auto-tool-choice), as vLLM."""
    parallel_tool_calls: bool | None = None
    """False: at most one tool call (`required`: the schema allows one; `auto`: the first is kept)."""
    # vLLM extra parameters
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_top_logprobs(self) -> ChatCompletionRequest:
        """As vLLM: -1 (all) or a count >= 0, and a non-zero one only with `logprobs: true`."""
        top = self.top_logprobs
        if top is not None:
            if top < -1:
                raise ValueError(f"top_logprobs: must be a positive value or -1, got {top}")
            if top != 0 and not self.logprobs:
                raise ValueError("top_logprobs: when using `top_logprobs`, `logprobs` must be set to true")
        return self


# ---- completion responses -------------------------------------------------------------------------
class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- chat responses -------------------------------------------------------------------------------
class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProb] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str
    """The arguments as JSON text."""


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{random_uuid()}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """One streamed piece of a tool call: the first carries `id`, `type` and `function.name`, the next ones
    fragments of `function.arguments` (concatenated by `index`)."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    """The model's reasoning (the server's --reasoning-parser), vLLM's field; `reasoning` holds the same."""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
