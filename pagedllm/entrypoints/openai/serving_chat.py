"""POST /v1/chat/completions."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pagedllm.engine.exceptions import RequestFailedError, RequestTimeoutError
from pagedllm.engine.mp_client import EngineDeadError
from pagedllm.entrypoints.chat_utils import apply_chat_template, normalize_conversation
from pagedllm.entrypoints.openai.chat_parsing import ChatOutputParsing, ChoiceStream, RequestParsing
from pagedllm.entrypoints.openai.chunk_json import chunk_head, content_chunk_json
from pagedllm.entrypoints.openai.errors import OpenAIServingError, engine_dead_error, request_error
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    messages_as_dicts,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.entrypoints.openai.streaming import SSEStream, merge_async_iterators, sse, sse_error
from pagedllm.entrypoints.template_sandbox import TemplateSandbox
from pagedllm.inputs import TokensPrompt
from pagedllm.logger import init_logger
from pagedllm.multimodal.chat import has_images, load_images, split_image_parts
from pagedllm.multimodal.media import MediaConnector
from pagedllm.outputs import RequestOutput

logger = init_logger(__name__)

LARGE_CONVERSATION_CHARS = 4096


class OpenAIServingChat(OpenAIServing):
    template_sandbox: TemplateSandbox | None = None
    """Set (by the server's `--trust-request-chat-template`) to accept templates sent in requests; they
    then render in this sandbox process. None: such requests get a 400, as vLLM."""
    parsing: ChatOutputParsing | None = None
    """Tool calling and reasoning output (the server's --tool-call-parser, --enable-auto-tool-choice,
    --reasoning-parser); None: named / required tool choice only, no reasoning split."""

    def output_parsing(self) -> ChatOutputParsing:
        if self.parsing is None:
            self.parsing = ChatOutputParsing(self.engine.get_tokenizer())
        return self.parsing

    def request_chat_template(self, template: str | None) -> str | None:
        """A request may send template text, never a path: the server must not read files for clients."""
        if template is None:
            return self.chat_template
        if self.template_sandbox is None:
            raise OpenAIServingError(
                "chat_template: a chat template was passed with the request, but the server was not started "
                "with --trust-request-chat-template; refused the request's untrusted chat template",
                400,
                "chat_template",
            )
        if os.path.exists(template) or ("{" not in template and "\n" not in template):
            raise OpenAIServingError(
                "chat_template: must be Jinja template text (file paths are only accepted "
                "by the server's --chat-template)",
                400,
                "chat_template",
            )
        return template

    async def chat_images(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
        """The messages with their image parts as the model's placeholder text, and the images (loaded off
        the event loop: a download or a decode must not stall other requests)."""
        ip = self.engine.input_processor
        mm = await self.engine.run_in_worker(lambda: ip.mm_processor)
        if mm is None:
            archs = ", ".join(self.engine.model_config.architectures)
            raise OpenAIServingError(
                f"messages: image content parts need a vision-language model; the served model ({archs}) is text-only",
                400,
                "messages",
            )
        mc = self.engine.config.multimodal_config
        connector = MediaConnector(mc.allowed_local_media_path, mc.allowed_media_domains)
        try:
            placeholder = await self.engine.run_in_worker(mm.prompt_placeholder)
            messages, sources = split_image_parts(messages, placeholder)
            images = await self.engine.run_in_worker(load_images, sources, connector)
        except ValueError as e:
            err = OpenAIServingError.from_value_error(e)
            err.param = err.param or "messages"
            raise err from None
        return messages, images

    async def render_messages(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """Chat template -> (prompt text, token ids). Large conversations render off the event loop."""
        tok = self.engine.get_tokenizer()
        template = self.request_chat_template(chat_template)
        kwargs: dict[str, Any] = {
            "conversation": messages,
            "chat_template": template,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs,
            "tools": tools,
        }

        def render() -> str:
            return apply_chat_template(tok, **kwargs)

        try:
            normalize_conversation(messages)  # cheap validation first: clear 400s for bad roles/content
            size = sum(len(str(m.get("content") or "")) for m in messages)
            if chat_template is not None and self.template_sandbox is not None:
                text = await self.template_sandbox.render(**kwargs)  # the client's code: isolated
            elif size <= LARGE_CONVERSATION_CHARS:
                text = render()
            else:
                text = await self.engine.run_in_worker(render)
        except ValueError as e:
            err = OpenAIServingError.from_value_error(e)
            if err.param is None:
                err.param = "messages"
            raise err from None
        self.precheck_text_len(text, "messages")
        ids = await self.engine.encode_text(text, add_special_tokens)
        return text, ids

    async def create_chat_completion(
        self, req: ChatCompletionRequest, request_id: str | None = None
    ) -> ChatCompletionResponse | SSEStream:
        model = self.check_model(req.model)
        if not req.messages:
            raise OpenAIServingError("messages: must contain at least one message", 400, "messages")
        if req.stream_options is not None and not req.stream:
            raise OpenAIServingError("stream_options: only allowed when stream=true", 400, "stream_options")
        extra = req.model_extra or {}
        # Unknown fields are ignored, but these completions-only ones would silently change the result.
        if extra.get("best_of") is not None:
            raise OpenAIServingError(
                "best_of: not supported in chat completions (a /v1/completions parameter)", 400, "best_of"
            )
        for legacy in ("functions", "function_call"):
            if extra.get(legacy) is not None:
                raise OpenAIServingError(
                    f"{legacy}: the deprecated function-calling parameters are not supported (use tools)", 400, legacy
                )
        if extra.get("use_beam_search"):
            raise OpenAIServingError(
                "use_beam_search: not supported in chat completions (use /v1/completions)", 400, "use_beam_search"
            )
        parsing = self.output_parsing()
        rp = parsing.prepare(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise OpenAIServingError(f"{name}: must be at least 1, got {max_tokens}", 400, name)
        messages = messages_as_dicts(req.messages)
        images = None
        if has_images(messages):
            messages, images = await self.chat_images(messages)
        text, ids = await self.render_messages(
            messages,
            req.chat_template,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            req.add_special_tokens,
            rp.tools,
        )
        prompt: Any = TokensPrompt(prompt_token_ids=ids, prompt=text)
        if images is not None:
            mm_prompt = {
                "prompt": text,
                "multi_modal_data": {"image": images},
                "mm_processor_kwargs": {"add_special_tokens": req.add_special_tokens},
            }
            try:
                text, ids, features = await self.engine.run_in_worker(
                    self.engine.input_processor.process_multimodal, mm_prompt
                )
            except ValueError as e:
                raise OpenAIServingError.from_value_error(e) from None
            prompt = {"prompt": text, "prompt_token_ids": ids, "mm_features": features}
        max_tokens = self.check_prompt_len(len(ids), max_tokens, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sp = self.build_sampling_params(
            req, max_tokens, bool(req.stream), logprobs, structured_outputs=rp.structured_outputs
        )
        rid = request_id or req.request_id or f"chatcmpl-{random_uuid()}"
        try:
            q = await self.engine.add_request(
                rid,
                prompt,
                sp,
                priority=req.priority,
                lora_request=self.lora_for(req.model),
            )
        except ValueError as e:
            raise OpenAIServingError.from_value_error(e) from None
        except EngineDeadError as e:
            raise engine_dead_error(e) from None
        stream = self.engine.stream_outputs(rid, q)
        created = int(time.time())
        echo = ""
        if req.echo and messages[-1].get("role") == "assistant":
            echo = str(normalize_conversation(messages[-1:])[0]["content"])
        if req.stream:
            return SSEStream(self._stream(req, rp, rid, created, model, stream, ids, echo), [rid])
        return await self._full(req, rp, rid, created, model, stream, ids, echo)

    async def _full(
        self,
        req: ChatCompletionRequest,
        rp: RequestParsing,
        rid: str,
        created: int,
        model: str,
        stream: AsyncIterator[RequestOutput],
        prompt_ids: list[int],
        echo: str,
    ) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async for _, res in merge_async_iterators(stream):
                final = res
        except EngineDeadError as e:
            raise engine_dead_error(e) from None
        assert final is not None
        parsing = self.output_parsing()
        choices = []
        for out in sorted(final.outputs, key=lambda o: o.index):
            if parsing.active(rp):
                message = parsing.message(req, rp, out.text, prompt_ids)
                if echo:
                    message.content = echo + (message.content or "")
            else:
                message = ChatMessage(role="assistant", content=echo + out.text)
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=message,
                    logprobs=self.chat_logprobs(out, req.top_logprobs or 0),
                    finish_reason="tool_calls" if message.tool_calls else out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
        num_prompt_tokens = len(prompt_ids)
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        return ChatCompletionResponse(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=self.usage(num_prompt_tokens, completion_tokens),
        )

    async def _stream(
        self,
        req: ChatCompletionRequest,
        rp: RequestParsing,
        rid: str,
        created: int,
        model: str,
        stream: AsyncIterator[RequestOutput],
        prompt_ids: list[int],
        echo: str,
    ) -> AsyncGenerator[str, None]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(include_usage and opts and opts.continuous_usage_stats)
        completion_tokens = 0
        num_prompt_tokens = len(prompt_ids)
        parsing = self.output_parsing()
        streams: dict[int, ChoiceStream] = {}
        head = chunk_head("chat.completion.chunk", rid, created, model)

        def chunk(choices: list[ChatCompletionResponseStreamChoice]) -> str:
            c = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=choices)
            if continuous:
                c.usage = self.usage(num_prompt_tokens, completion_tokens)
            return sse(c.model_dump_json())

        try:
            # As OpenAI and vLLM: a first chunk per choice carrying the role (and echoed text, if any).
            for i in range(req.n):
                yield chunk(
                    [ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=echo))]
                )
            async for _, res in merge_async_iterators(stream):
                for out in res.outputs:
                    completion_tokens += len(out.token_ids)
                    finish_reason = out.finish_reason
                    lps = self.chat_logprobs(out, req.top_logprobs or 0)
                    if parsing.active(rp):
                        cs = streams.get(out.index) or streams.setdefault(
                            out.index, parsing.stream(req, rp, prompt_ids)
                        )
                        delta = cs.feed(out.text, out.token_ids, finish_reason is not None)
                        if delta is None and finish_reason is None and lps is None:
                            continue  # nothing to send yet (e.g. a possible start of a tag held back)
                        if cs.tools_called and finish_reason is not None:
                            finish_reason = "tool_calls"
                    elif lps is None and not continuous:  # the common chunk, built without pydantic
                        yield sse(content_chunk_json(head, out.index, out.text, finish_reason, out.stop_reason))
                        continue
                    else:
                        delta = DeltaMessage(content=out.text)
                    yield chunk(
                        [
                            ChatCompletionResponseStreamChoice(
                                index=out.index,
                                delta=delta or DeltaMessage(),
                                logprobs=lps,
                                finish_reason=finish_reason,
                                stop_reason=out.stop_reason,
                            )
                        ]
                    )
            if include_usage:
                final = ChatCompletionStreamResponse(
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
                logger.exception("chat stream %s failed", rid)
            yield sse_error(request_error(e))
        yield sse("[DONE]")
