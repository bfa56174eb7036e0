"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from pagedllm.beam_search import beam_search_async
from pagedllm.engine.exceptions import RequestFailedError, RequestTimeoutError
from pagedllm.engine.mp_client import EngineDeadError
from pagedllm.entrypoints.openai.chunk_json import chunk_head, text_chunk_json
from pagedllm.entrypoints.openai.errors import OpenAIServingError, engine_dead_error, request_error
from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.entrypoints.openai.streaming import SSEStream, merge_async_iterators, sse, sse_error
from pagedllm.inputs import TokensPrompt
from pagedllm.logger import init_logger
from pagedllm.logprobs import Logprob, PromptLogprobs
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams

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
        best_of = req.best_of if req.best_of is not None else req.n
        if best_of < req.n:
            raise OpenAIServingError(f"best_of: must be at least n={req.n}, got {best_of}", 400, "best_of")
        if best_of > req.n and req.stream and not req.use_beam_search:
            raise OpenAIServingError("best_of: cannot be combined with stream=true (as OpenAI)", 400, "best_of")
        if req.stream_options is not None and not req.stream:
            raise OpenAIServingError("stream_options: only allowed when stream=true", 400, "stream_options")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise OpenAIServingError(f"max_tokens: must be at least 1, got {req.max_tokens}", 400, "max_tokens")
        if req.use_beam_search:
            self._check_beam_search(req)
        prompts = await self._prompts(req)
        base_id = request_id or req.request_id or f"cmpl-{random_uuid()}"
        created = int(time.time())
        if req.use_beam_search:
            streams = self._beam_search_streams(req, base_id, prompts, best_of)
            num_prompt_tokens = sum(len(ids) for _, ids in prompts)
            if req.stream:
                return SSEStream(self._stream(req, base_id, created, model, prompts, streams, num_prompt_tokens))
            return await self._full(req, base_id, created, model, prompts, streams, num_prompt_tokens)
        # best_of > n ranks its samples by cumulative logprob, which the engine sums only for requests
        # asking for logprobs: ask for 0 (just the sampled token's); they are dropped unless requested.
        logprobs = req.logprobs if req.logprobs is not None or best_of == req.n else 0
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = []
        for _, ids in prompts:
            max_tokens = self.check_prompt_len(len(ids), req.max_tokens)
            params.append(
                self.build_sampling_params(
                    req, max_tokens, bool(req.stream), logprobs, n=best_of, prompt_logprobs=prompt_logprobs
                )
            )
        engine = self.engine
        streams = []
        queued: list[str] = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
                rid = f"{base_id}-{i}"
                q = await engine.add_request(
                    rid,
                    TokensPrompt(prompt_token_ids=ids, prompt=text or ""),
                    sp,
                    priority=req.priority,
                    lora_request=self.lora_for(req.model),
                )
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

    def _check_beam_search(self, req: CompletionRequest) -> None:
        """Beam search scores beams by logprob alone: sampling controls that would change the candidates
        are refused rather than silently ignored."""
        unsupported = {
            "stop": bool(req.stop),
            "stop_token_ids": bool(req.stop_token_ids),
            "logit_bias": bool(req.logit_bias),
            "min_tokens": req.min_tokens > 0,
            "presence_penalty": bool(req.presence_penalty),
            "frequency_penalty": bool(req.frequency_penalty),
            "repetition_penalty": req.repetition_penalty not in (None, 1.0),
            "echo": bool(req.echo and req.logprobs is not None),
        }
        for name, bad in unsupported.items():
            if bad:
                what = "echo with logprobs" if name == "echo" else name
                raise OpenAIServingError(f"{name}: {what} is not supported with use_beam_search", 400, name)
        constraint, source = self.structured_outputs(req)
        if constraint is not None:
            msg = f"{source}: structured outputs are not supported with use_beam_search"
            raise OpenAIServingError(msg, 400, source)
        if req.temperature is not None and req.temperature < 0:
            raise OpenAIServingError(f"temperature: must be non-negative, got {req.temperature}", 400, "temperature")

    def _beam_search_streams(
        self, req: CompletionRequest, base_id: str, prompts: list[tuple[str | None, list[int]]], width: int
    ) -> list[AsyncIterator[RequestOutput]]:
        """One single-item stream per prompt: its finished beam-search RequestOutput (`n` best beams of
        `width`). Closing a stream before its item cancels the search, which aborts its step requests."""
        if width > 16:
            raise OpenAIServingError(f"best_of: at most 16 beams per request, got {width}", 400, "best_of")
        limit = self.engine.model_config.max_logprobs
        if limit != -1 and 2 * width > limit:
            raise OpenAIServingError(
                f"best_of: beam search of width {width} needs {2 * width} logprobs per step, "
                f"more than the server's max_logprobs={limit}",
                400,
                "best_of",
            )
        if req.logprobs is not None and limit != -1 and req.logprobs > limit:
            raise OpenAIServingError(
                f"logprobs: requested {req.logprobs} logprobs, more than max_logprobs={limit}", 400, "logprobs"
            )
        engine = self.engine
        eos = engine.input_processor.eos_token_id
        streams: list[AsyncIterator[RequestOutput]] = []
        for i, (text, ids) in enumerate(prompts):
            max_tokens = self.check_prompt_len(len(ids), req.max_tokens)
            try:
                # Beam search is a deterministic search: temperature 0 unless asked (BeamSearchParams'
                # default; vLLM would take the sampling default, whose sampled token adds a random beam).
                params = BeamSearchParams(
                    beam_width=width,
                    max_tokens=max_tokens,
                    ignore_eos=req.ignore_eos,
                    temperature=req.temperature or 0.0,
                    length_penalty=req.length_penalty,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                )
            except ValueError as e:
                raise OpenAIServingError.from_value_error(e) from None
            streams.append(self._beam_search_one(f"{base_id}-{i}", text, ids, params, eos, req))
        return streams

    async def _beam_search_one(
        self,
        rid: str,
        text: str | None,
        ids: list[int],
        params: BeamSearchParams,
        eos: int | None,
        req: CompletionRequest,
    ) -> AsyncGenerator[RequestOutput, None]:
        try:
            res = await beam_search_async(
                self.engine,
                ids,
                params,
                rid,
                eos_token_id=eos,
                max_model_len=self.max_model_len,
                tokenizer=self.engine.get_tokenizer(),
                prompt_text=text,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as e:
            raise OpenAIServingError.from_value_error(e) from None
        res.outputs = [replace(o, logprobs=_trim_logprobs(o, req.logprobs)) for o in res.outputs[: req.n]]
        yield res

    def _select(self, req: CompletionRequest, outputs: list[CompletionOutput]) -> list[CompletionOutput]:
        """The choices of one prompt: all `n` outputs, or (best_of > n) the `n` samples with the highest
        cumulative logprob, best first, reindexed, without the logprobs the user did not ask for."""
        best_of = req.best_of if req.best_of is not None else req.n
        if req.use_beam_search or best_of == req.n:
            return sorted(outputs, key=lambda o: o.index)
        ranked = sorted(
            outputs,
            key=lambda o: o.cumulative_logprob if o.cumulative_logprob is not None else float("-inf"),
            reverse=True,
        )[: req.n]
        keep = req.logprobs is not None
        return [
            replace(
                o,
                index=k,
                logprobs=o.logprobs if keep else None,
                cumulative_logprob=o.cumulative_logprob if keep else None,
            )
            for k, o in enumerate(ranked)
        ]

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        return self.engine.get_tokenizer().decode(ids)

    async def _full(
        self,
        req: CompletionRequest,
        rid: str,
        created: int,
        model: str,
        prompts: list[tuple[str | None, list[int]]],
        streams: list[AsyncIterator[RequestOutput]],
        num_prompt_tokens: int,
    ) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, res in merge_async_iterators(*streams):
                finals[i] = res
        except EngineDeadError as e:
            raise engine_dead_error(e) from None
        choices: list[CompletionResponseChoice] = []
        completion_tokens = 0
        for i, res in enumerate(finals):  # type: ignore[assignment]
            assert res is not None
            prefix = self._echo_text(*prompts[i]) if req.echo else ""
            # Usage counts every generated token, the best_of samples not returned included (as OpenAI).
            completion_tokens += sum(len(out.token_ids) for out in res.outputs)
            plp = res.prompt_logprobs if req.echo else None
            for out in self._select(req, res.outputs):
                logprobs = (
                    self.completion_logprobs(out, 0, res.prompt_token_ids, plp)
                    if plp is not None
                    else self.completion_logprobs(out, len(prefix))
                )
                choices.append(
                    CompletionResponseChoice(
                        index=i * req.n + out.index,
                        text=prefix + out.text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=self.usage(num_prompt_tokens, completion_tokens),
        )

    async def _stream(
        self,
        req: CompletionRequest,
        rid: str,
        created: int,
        model: str,
        prompts: list[tuple[str | None, list[int]]],
        streams: list[AsyncIterator[RequestOutput]],
        num_prompt_tokens: int,
    ) -> AsyncGenerator[str, None]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(include_usage and opts and opts.continuous_usage_stats)
        n = req.n
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        # DELTA outputs carry prompt logprobs once per request: kept for every choice's first chunk.
        prompt_lps: dict[int, PromptLogprobs] = {}
        completion_tokens = 0
        head = chunk_head("text_completion", rid, created, model)
        try:
            async for i, res in merge_async_iterators(*streams):
                if req.echo and res.prompt_logprobs is not None:
                    prompt_lps.setdefault(i, res.prompt_logprobs)
                for out in res.outputs:
                    idx = i * n + out.index
                    text = out.text
                    first = req.echo and idx not in echoed
                    if first:
                        echoed.add(idx)
                        text = self._echo_text(*prompts[i]) + text
                    completion_tokens += len(out.token_ids)
                    if first and i in prompt_lps:
                        logprobs = self.completion_logprobs(out, 0, prompts[i][1], prompt_lps[i])
                        offsets[idx] = (
                            logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                            if logprobs is not None and logprobs.tokens
                            else len(text)
                        )
                    else:
                        logprobs = self.completion_logprobs(out, offsets.get(idx, 0) + len(text) - len(out.text))
                        offsets[idx] = offsets.get(idx, 0) + len(text)
                    if logprobs is None and not continuous:  # the common chunk, built without pydantic
                        yield sse(text_chunk_json(head, idx, text, out.finish_reason, out.stop_reason))
                        continue
                    chunk = CompletionStreamResponse(
                        id=rid,
                        created=created,
                        model=model,
                        choices=[
                            CompletionResponseStreamChoice(
                                index=idx,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=out.finish_reason,
                                stop_reason=out.stop_reason,
                            )
                        ],
                    )
                    if continuous:
                        chunk.usage = self.usage(num_prompt_tokens, completion_tokens)
                    yield sse(chunk.model_dump_json())
            if include_usage:
                final = CompletionStreamResponse(
                    id=rid,
                    created=created,
                    model=model,
                    choices=[],
                    usage=self.usage(num_prompt_tokens, completion_tokens),
                )
                yield sse(final.model_dump_json())
        except EngineDeadError as e:
            yield sse_error(engine_dead_error(e))
        except Exception as e:
            if not isinstance(e, (RequestFailedError, RequestTimeoutError)):
                logger.exception("completion stream %s failed", rid)
            yield sse_error(request_error(e))
        yield sse("[DONE]")


def _trim_logprobs(out: CompletionOutput, k: int | None) -> list[dict[int, Logprob]] | None:
    """A beam's per-step candidates (2 * beam_width of them) cut to what the user asked for: the chosen
    token and the top `k` (None: no logprobs)."""
    if k is None or out.logprobs is None:
        return None
    return [
        {t: lp for t, lp in pos.items() if t == tid or (lp.rank is not None and (k == -1 or lp.rank <= k))}
        for tid, pos in zip(out.token_ids, out.logprobs)
    ]
