"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from pagedllm.engine.mp_client import EngineDeadError
from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_base import (
    OpenAIServing,
    OpenAIServingError,
    SSEStream,
    engine_dead_error,
    merge_async_iterators,
    sse,
    sse_error,
)
from pagedllm.inputs import TokensPrompt
from pagedllm.logger import init_logger
from pagedllm.outputs import RequestOutput

logger = init_logger(__name__)


class OpenAIServingCompletion(OpenAIServing):
    async def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt; `prompt` may be a string, strings, ids, or lists of ids."""
        p = req.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif not p:
            raise OpenAIServingError("prompt: must not be an empty list", 400, "prompt")
        elif isinstance(p[0], int):
            items = [p]  # type: ignore[list-item]
        else:
            items = list(p)  # type: ignore[arg-type]
        if len(items) > 256:
            raise OpenAIServingError(f"prompt: at most 256 prompts per request, got {len(items)}", 400, "prompt")
        out: list[tuple[str | None, list[int]]] = []
        for item in items:
            if isinstance(item, str):
                self.precheck_text_len(item)
                out.append((item, await self.engine.encode_text(item, req.add_special_tokens)))
            else:
                out.append((None, list(item)))
        return out

    async def create_completion(
        self, req: CompletionRequest, request_id: str | None = None
    ) -> CompletionResponse | SSEStream:
        """A response, or (stream=True) an SSE text iterator. Raises OpenAIServingError before anything
        is queued when the request is invalid."""
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise OpenAIServingError("suffix: not supported", 400, "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIServingError("best_of: not supported (must be unset or equal to n)", 400, "best_of")
        if req.stream_options is not None and not req.stream:
            raise OpenAIServingError("stream_options: only allowed when stream=true", 400, "stream_options")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise OpenAIServingError(f"max_tokens: must be at least 1, got {req.max_tokens}", 400, "max_tokens")
        prompts = await self._prompts(req)
        params = []
        for _, ids in prompts:
            max_tokens = self.check_prompt_len(len(ids), req.max_tokens)
            params.append(self.build_sampling_params(req, max_tokens, bool(req.stream), req.logprobs))
        base_id = request_id or req.request_id or f"cmpl-{random_uuid()}"
        created = int(time.time())
        engine = self.engine
        streams = []
        queued: list[str] = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
                rid = f"{base_id}-{i}"
                q = await engine.add_request(rid, TokensPrompt(prompt_token_ids=ids, prompt=text or ""),
                                             sp, priority=req.priority)
                queued.append(rid)
                streams.append(engine.stream_outputs(rid, q))
        except ValueError as e:
            engine.abort(queued)
            raise OpenAIServingError.from_value_error(e) from None
        except EngineDeadError as e:
            engine.abort(queued)
            raise engine_dead_error(e) from None
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        if req.stream:
            return SSEStream(self._stream(req, base_id, created, model, prompts, streams, num_prompt_tokens), queued)
        return await self._full(req, base_id, created, model, prompts, streams, num_prompt_tokens)

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        return self.engine.get_tokenizer().decode(ids)

    async def _full(self, req: CompletionRequest, rid: str, created: int, model: str,
                    prompts: list[tuple[str | None, list[int]]], streams: list[AsyncIterator[RequestOutput]],
                    num_prompt_tokens: int) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, res in merge_async_iterators(*streams):
                finals[i] = res
        except EngineDeadError as e:
            raise engine_dead_error(e) from None
        choices: list[CompletionResponseChoice] = []
        completion_tokens = 0
        for i, res in enumerate(finals):
            assert res is not None
            prefix = self._echo_text(*prompts[i]) if req.echo else ""
            for out in res.outputs:
                completion_tokens += len(out.token_ids)
                choices.append(CompletionResponseChoice(
                    index=i * req.n + out.index, text=prefix + out.text,
                    logprobs=self.completion_logprobs(out, len(prefix)),
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=self.usage(num_prompt_tokens, completion_tokens))

    async def _stream(self, req: CompletionRequest, rid: str, created: int, model: str,
                      prompts: list[tuple[str | None, list[int]]], streams: list[AsyncIterator[RequestOutput]],
                      num_prompt_tokens: int) -> AsyncGenerator[str, None]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(include_usage and opts and opts.continuous_usage_stats)
        n = req.n
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        completion_tokens = 0
        try:
            async for i, res in merge_async_iterators(*streams):
                for out in res.outputs:
                    idx = i * n + out.index
                    text = out.text
                    if req.echo and idx not in echoed:
                        echoed.add(idx)
                        text = self._echo_text(*prompts[i]) + text
                    completion_tokens += len(out.token_ids)
                    logprobs = self.completion_logprobs(out, offsets.get(idx, 0) + len(text) - len(out.text))
                    offsets[idx] = offsets.get(idx, 0) + len(text)
                    chunk = CompletionStreamResponse(
                        id=rid, created=created, model=model,
                        choices=[CompletionResponseStreamChoice(
                            index=idx, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason)],
                    )
                    if continuous:
                        chunk.usage = self.usage(num_prompt_tokens, completion_tokens)
                    yield sse(chunk.model_dump_json())
            if include_usage:
                final = CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                 usage=self.usage(num_prompt_tokens, completion_tokens))
                yield sse(final.model_dump_json())
        except EngineDeadError as e:
            yield sse_error(engine_dead_error(e))
        except Exception as e:
            logger.exception("completion stream %s failed", rid)
            yield sse_error(OpenAIServingError(f"{type(e).__name__}: {e}", 500))
        yield sse("[DONE]")
