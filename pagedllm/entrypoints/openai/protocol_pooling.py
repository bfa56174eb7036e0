"""Request and response bodies of the pooling routes (vLLM's shapes): /v1/embeddings, /score, /rerank
(Jina / Cohere), /classify and /pooling. Requests are strict like the generation ones."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import Int64, OpenAIBaseModel, OpenAIRequestModel, UsageInfo

PoolingInput = str | list[str] | list[int] | list[list[int]]


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class EmbeddingRequest(OpenAIRequestModel):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: Int64 = 0


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class ScoreRequest(OpenAIRequestModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    priority: Int64 = 0


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(OpenAIRequestModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    return_documents: bool = True
    priority: Int64 = 0


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationRequest(OpenAIRequestModel):
    model: str | None = None
    input: PoolingInput
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    user: str | None = None
    priority: Int64 = 0


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class PoolingRequest(OpenAIRequestModel):
    model: str | None = None
    input: PoolingInput
    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    user: str | None = None
    priority: Int64 = 0


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Any


class PoolingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo
