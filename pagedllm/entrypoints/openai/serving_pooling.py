"""The pooling routes of `pagedllm serve` (vLLM's): `/v1/embeddings`, `/score` + `/v1/score`, `/rerank` +
`/v1/rerank` + `/v2/rerank`, `/classify`, `/pooling`. On a generative model they answer 400 naming the
task; on a pooling model the generation routes do (`add_pooling_routes` installs both)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import OpenAIServingError, error_body
from pagedllm.entrypoints.openai.protocol import UsageInfo
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.inputs import PromptType, TokensPrompt
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling.llm_api import pair_token_ids, score_pairs
from pagedllm.pooling_params import PoolingParams

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _inputs(inp: Any, param: str = "input") -> list[PromptType]:
    """String, list of strings, token ids or list of token-id lists -> prompts; 400 when empty."""
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise OpenAIServingError(f"{param}: the input list is empty", 400, param)
    if all(isinstance(x, int) for x in inp):
        return [TokensPrompt(prompt_token_ids=list(inp))]
    out: list[PromptType] = []
    for x in inp:
        if isinstance(x, list):
            if not x:
                raise OpenAIServingError(f"{param}: an input is empty", 400, param)
            out.append(TokensPrompt(prompt_token_ids=x))
        else:
            out.append(x)
    return out


def _encode_vector(v: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(v.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
    return v.tolist()


class OpenAIServingPooling(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        super().__init__(engine, served_model_names)
        mc = engine.model_config
        self.tasks: tuple[str, ...] = mc.pooling.tasks if mc.runner_type == "pooling" else ()

    def check_task(self, task: str) -> None:
        if task not in self.tasks:
            what = f"a pooling model for the tasks {', '.join(self.tasks)}" if self.tasks else "a generative model"
            raise OpenAIServingError(f"task: this model is {what}; it does not support the task {task!r}", 400, "task")

    async def run(
        self, prompts: list[PromptType], params: list[PoolingParams], priority: int
    ) -> list[PoolingRequestOutput]:
        """All requests validated and queued first (a 400 queues none), then awaited together."""
        base = uuid.uuid4().hex
        queues = []
        try:
            for i, (p, pp) in enumerate(zip(prompts, params)):
                if isinstance(p, str):
                    self.precheck_text_len(p, "input")
                queues.append((f"{base}-{i}", await self.engine.add_request(f"{base}-{i}", p, pp, None, priority)))  # type: ignore[arg-type]
        except ValueError as e:
            self.engine.abort([rid for rid, _ in queues])
            raise OpenAIServingError.from_value_error(e) from None

        async def one(rid: str, q: Any) -> PoolingRequestOutput:
            last = None
            async for out in self.engine.stream_outputs(rid, q):
                last = out
            if not isinstance(last, PoolingRequestOutput):
                raise OpenAIServingError("the request was aborted", 500)
            return last

        return list(await asyncio.gather(*(one(rid, q) for rid, q in queues)))

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int = 0) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens, completion_tokens=None)

    async def embeddings(self, req: EmbeddingRequest) -> EmbeddingResponse:
        model = self.check_model(req.model)
        self.check_task("embed")
        pp = PoolingParams(
            task="embed",
            dimensions=req.dimensions,
            normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        prompts = _inputs(req.input)
        outs = await self.run(prompts, [pp] * len(prompts), req.priority)
        data = [
            EmbeddingResponseData(index=i, embedding=_encode_vector(o.outputs.data, req.encoding_format))
            for i, o in enumerate(outs)
        ]
        return EmbeddingResponse(model=model, data=data, usage=self.usage(sum(len(o.prompt_token_ids) for o in outs)))

    async def _cross_scores(
        self, pairs: list[tuple[str, str]], truncate: int | None, use_activation: bool | None, priority: int
    ) -> tuple[list[float], int]:
        """Scores of text pairs: a cross-encoder's one output, or the cosine of two embeddings."""
        if "score" in self.tasks:
            tok = self.engine.get_tokenizer()
            prompts: list[PromptType] = [
                TokensPrompt(prompt_token_ids=pair_token_ids(tok, a, b, truncate, self.max_model_len)) for a, b in pairs
            ]
            pp = PoolingParams(task="score", use_activation=use_activation)
            outs = await self.run(prompts, [pp] * len(prompts), priority)
            return [float(o.outputs.data.reshape(-1)[0]) for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        self.check_task("embed")
        texts: list[PromptType] = [*(a for a, _ in pairs), *(b for _, b in pairs)]
        pp = PoolingParams(task="embed", truncate_prompt_tokens=truncate)
        outs = await self.run(texts, [pp] * len(texts), priority)
        n = len(pairs)
        scores = [
            float(F.cosine_similarity(outs[i].outputs.data[None], outs[n + i].outputs.data[None])[0]) for i in range(n)
        ]
        return scores, sum(len(o.prompt_token_ids) for o in outs)

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        model = self.check_model(req.model)
        if "score" not in self.tasks:
            self.check_task("embed")
        try:
            pairs = score_pairs(req.text_1, req.text_2)
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, "text_1") from None
        scores, ntok = await self._cross_scores(pairs, req.truncate_prompt_tokens, req.use_activation, req.priority)
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(model=model, data=data, usage=self.usage(ntok))

    async def rerank(self, req: RerankRequest) -> RerankResponse:
        model = self.check_model(req.model)
        if "score" not in self.tasks:
            self.check_task("embed")
        if not req.documents:
            raise OpenAIServingError("documents: the list is empty", 400, "documents")
        if req.top_n is not None and req.top_n < 0:
            raise OpenAIServingError("top_n: must be >= 0", 400, "top_n")
        pairs = [(req.query, d) for d in req.documents]
        scores, ntok = await self._cross_scores(pairs, req.truncate_prompt_tokens, req.use_activation, req.priority)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            )
            for i in order
        ]
        return RerankResponse(model=model, usage=RerankUsage(total_tokens=ntok), results=results)

    async def classify(self, req: ClassificationRequest) -> ClassificationResponse:
        model = self.check_model(req.model)
        self.check_task("classify")
        pp = PoolingParams(
            task="classify", use_activation=req.use_activation, truncate_prompt_tokens=req.truncate_prompt_tokens
        )
        prompts = _inputs(req.input)
        outs = await self.run(prompts, [pp] * len(prompts), req.priority)
        id2label = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(probs))
            label = id2label.get(best, id2label.get(str(best))) if id2label else None
            data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
        return ClassificationResponse(
            model=model, data=data, usage=self.usage(sum(len(o.prompt_token_ids) for o in outs))
        )

    async def pooling(self, req: PoolingRequest) -> PoolingResponse:
        model = self.check_model(req.model)
        task = req.task or ("encode" if "encode" in self.tasks else "embed")
        self.check_task(task)
        pp = PoolingParams(
            task=task,
            dimensions=req.dimensions,
            normalize=req.normalize,
            use_activation=req.use_activation,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        prompts = _inputs(req.input)
        outs = await self.run(prompts, [pp] * len(prompts), req.priority)
        data = [
            PoolingResponseData(
                index=i,
                data=_encode_vector(o.outputs.data.reshape(-1), "base64")
                if req.encoding_format == "base64"
                else o.outputs.data.tolist(),
            )
            for i, o in enumerate(outs)
        ]
        return PoolingResponse(model=model, data=data, usage=self.usage(sum(len(o.prompt_token_ids) for o in outs)))


def add_pooling_routes(
    app: FastAPI, engine: AsyncLLM, served_model_names: list[str], error_responses: dict[int | str, dict[str, Any]]
) -> None:
    serving = OpenAIServingPooling(engine, served_model_names)
    if serving.tasks:

        @app.middleware("http")
        async def _no_generation(request: Request, call_next: Any) -> Any:  # a pooling model does not generate
            if request.method == "POST" and request.url.path in GENERATION_PATHS:
                tasks = ", ".join(serving.tasks)
                msg = f"task: this model is a pooling model (tasks: {tasks}); it does not support the task 'generate'"
                return JSONResponse(error_body(msg, 400, "task"), status_code=400)
            return await call_next(request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=error_responses)
    async def create_embedding(body: EmbeddingRequest) -> EmbeddingResponse:
        return await serving.embeddings(body)

    for path in ("/score", "/v1/score"):
        app.post(path, response_model=ScoreResponse, responses=error_responses)(serving.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, response_model=RerankResponse, responses=error_responses)(serving.rerank)
    app.post("/classify", response_model=ClassificationResponse, responses=error_responses)(serving.classify)
    app.post("/pooling", response_model=PoolingResponse, responses=error_responses)(serving.pooling)


def model_tasks(engine: AsyncLLM) -> dict[str, Any]:
    """What `/v1/models` reports of the model's task: "generate", or the pooling model's first task and all
    of them (extra fields of the model card)."""
    mc = engine.model_config
    if mc.runner_type != "pooling":
        return {"task": "generate", "supported_tasks": ["generate"]}
    tasks = [t for t in mc.pooling.tasks if t != "encode"]
    return {"task": tasks[0], "supported_tasks": list(mc.pooling.tasks)}
