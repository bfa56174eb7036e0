"""The OpenAI-compatible HTTP server's app: factory, routes, error handlers, auth and body-size middleware.
Running it (engine first, then bind) is `server_main.py`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

import pagedllm
from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import RequestFailedError, RequestTimeoutError
from pagedllm.engine.mp_client import EngineDeadError
from pagedllm.entrypoints.openai.chat_parsing import ChatOutputParsing
from pagedllm.entrypoints.openai.control_routes import add_control_routes
from pagedllm.entrypoints.openai.errors import OpenAIServingError, engine_dead_error, error_body, request_error
from pagedllm.entrypoints.openai.middleware import (
    DEFAULT_BODY_TIMEOUT_S,
    PUBLIC_PATHS,
    AuthMiddleware,
    BodySizeLimitMiddleware,
    CatchAllMiddleware,
    unwrap_limit_error,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from pagedllm.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_base import DEFAULT_MAX_N
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels
from pagedllm.entrypoints.openai.serving_pooling import add_pooling_routes, model_tasks
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.streaming import SSEStream
from pagedllm.entrypoints.template_sandbox import TemplateSandbox
from pagedllm.entrypoints.web import mount_web_ui
from pagedllm.logger import init_logger
from pagedllm.metrics.prometheus import PrometheusStatLogger

logger = init_logger(__name__)

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""Request bodies above this get a 413 (8 MiB: a full context of text fits many times over)."""

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    408: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    500: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The response; with stream=true, server-sent events of the chunk objects, then [DONE]",
        # One event's shape (OpenAPI 3.2's `itemSchema`; validators read it per event): `data` is a chunk
        # object's JSON text, then "[DONE]".
        "content": {
            "text/event-stream": {
                "itemSchema": {
                    "type": "object",
                    "properties": {
                        "data": {"type": "string"},
                        "event": {"type": "string"},
                        "id": {"type": "string"},
                        "retry": {"type": "integer"},
                    },
                    "required": ["data"],
                }
            }
        },
    },
    **ERROR_RESPONSES,
}


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client's disconnect whatever the ASGI spec version (Starlette only
    listens below 2.4 and otherwise notices a gone client at the next write, which may be many tokens
    away). On disconnect the body iterator is cancelled and closed, which aborts the engine request; the
    `on_close` callback then aborts whatever the iterator never got to start."""

    def __init__(self, stream: SSEStream, on_close: Callable[[list[str]], None]) -> None:
        super().__init__(
            stream.iterator,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._request_ids = stream.request_ids
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                if not task.done():
                    task.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    pass
            self._on_close(self._request_ids)


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, coro: Awaitable[T]) -> T | None:
    """Await `coro` unless the client disconnects first; then cancel it (aborting its engine requests)
    and return None. The body has already been read, so the next ASGI message is the disconnect."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (handler, watcher):
            if not task.done():
                task.cancel()
    if handler.done() and not handler.cancelled():
        return handler.result()
    await asyncio.gather(handler, return_exceptions=True)
    return None


# ---- app ---------------------------------------------------------------------------------------
def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request", None
    by_field: dict[str, list[str]] = {}
    param: str | None = None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"Invalid JSON in request body: {ctx.get('error', err.get('msg'))}", None
        # Union members add the member type to the location ("prompt.list[int]", "TokenizeChatRequest"):
        # keep the field path only.
        loc = [x for x in loc if not x.startswith(("list[", "str", "int", "function-")) and x != "list"]
        loc = [x for x in loc if not x[:1].isupper()]
        field = ".".join(loc)
        msg = str(err.get("msg"))
        ctx_error = (err.get("ctx") or {}).get("error")
        if err.get("type") == "value_error" and not loc and ctx_error is not None:
            # A whole-body check (protocol.check_json_value) already names its field: "prompt: ...".
            msg = str(ctx_error)
            field, _, msg = msg.partition(": ")
            loc = [field.split(".")[0]]
        if param is None and loc:
            param = loc[0]
        msgs = by_field.setdefault(field or "body", [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{f}: {' or '.join(m)}" for f, m in list(by_field.items())[:5]]
    return "; ".join(parts), param


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    *,
    api_keys: list[str] | None = None,
    chat_template: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    prometheus: PrometheusStatLogger | None = None,
    log_requests: bool = True,
    web_ui: bool = True,
    trust_request_chat_template: bool = False,
    max_n: int = DEFAULT_MAX_N,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    lora_modules: list[LoRAModulePath] | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> FastAPI:
    app = FastAPI(title="pagedllm OpenAI-compatible API", version=pagedllm.__version__)
    completion = OpenAIServingCompletion(engine, served_model_names, chat_template)
    chat = OpenAIServingChat(engine, served_model_names, chat_template)
    chat.parsing = ChatOutputParsing(
        engine.get_tokenizer(), reasoning_parser, tool_call_parser, enable_auto_tool_choice
    )
    tokenization = OpenAIServingTokenization(engine, served_model_names, chat_template)
    if trust_request_chat_template:
        sandbox = TemplateSandbox(engine.get_tokenizer())
        chat.template_sandbox = tokenization.template_sandbox = sandbox
        app.state.template_sandbox = sandbox
    completion.max_n = chat.max_n = max_n
    served_models = OpenAIServingModels(engine, served_model_names)  # the base model and its LoRA adapters
    served_models.load_static(lora_modules or [])
    completion.models = chat.models = tokenization.models = served_models
    app.state.engine = engine
    add_control_routes(app, engine)  # /sleep, /wake_up, /is_sleeping, /start_profile, ... (dev mode / config)

    @app.exception_handler(OpenAIServingError)
    async def _openai_error(_: Request, exc: OpenAIServingError) -> JSONResponse:
        return JSONResponse(exc.to_response().model_dump(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return JSONResponse(error_body(msg, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cause = exc.__cause__
        limit = unwrap_limit_error(exc)
        if limit is not None:
            return JSONResponse(error_body(limit[1], limit[0]), status_code=limit[0])
        if isinstance(cause, UnicodeDecodeError):
            return JSONResponse(error_body(f"Request body is not valid UTF-8: {cause}", 400), status_code=400)
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return JSONResponse(error_body(detail, exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestFailedError)
    @app.exception_handler(RequestTimeoutError)
    async def _failed(_: Request, exc: Exception) -> JSONResponse:
        err = request_error(exc)
        return JSONResponse(err.to_response().model_dump(), status_code=err.status)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(engine_dead_error(exc).to_response().model_dump(), status_code=503)

    def respond(result: Any) -> Response:
        if isinstance(result, SSEStream):
            return DisconnectAwareStreamingResponse(result, engine.abort)
        return JSONResponse(result.model_dump())

    def log_request(kind: str, req: Any) -> None:
        if log_requests:
            logger.info(
                "Received %s request: model=%s stream=%s n=%s max_tokens=%s",
                kind,
                req.model,
                bool(req.stream),
                req.n,
                getattr(req, "max_completion_tokens", None) or req.max_tokens,
            )

    empty_200: dict[int | str, dict[str, Any]] = {
        200: {"description": "Healthy (empty body)", "content": {}},
        503: {"model": ErrorResponse},
    }

    @app.get("/health", response_class=Response, responses=empty_200)
    async def health() -> Response:
        if not engine.errored and not engine.engine_core.is_alive():
            engine.engine_core._on_process_exit()  # do not wait for the sentinel callback's turn
        if engine.errored:
            return JSONResponse(error_body(str(engine.dead_error), 503), status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response, responses=empty_200)
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedllm.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        body = prometheus.render() if prometheus is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=served_models.model_cards(**model_tasks(engine)))

    if envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING:

        async def _json_body(raw_request: Request) -> dict[str, Any]:
            try:
                body = await raw_request.json()
            except ValueError:
                raise OpenAIServingError("The request body is not valid JSON.", 400) from None
            if not isinstance(body, dict):
                raise OpenAIServingError("The request body must be a JSON object.", 400)
            return body

        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
        async def load_lora_adapter(raw_request: Request) -> Response:
            body = await _json_body(raw_request)
            msg = await served_models.load_lora_adapter(
                body.get("lora_name"), body.get("lora_path"), body.get("base_model_name")
            )
            return PlainTextResponse(msg)

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
        async def unload_lora_adapter(raw_request: Request) -> Response:
            body = await _json_body(raw_request)
            return PlainTextResponse(served_models.unload_lora_adapter(body.get("lora_name")))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_RESPONSES)
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        log_request("completion", body)
        result = await run_until_disconnect(raw_request, completion.create_completion(body))
        return respond(result) if result is not None else Response(status_code=499)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        log_request("chat completion", body)
        result = await run_until_disconnect(raw_request, chat.create_chat_completion(body))
        return respond(result) if result is not None else Response(status_code=499)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    add_pooling_routes(app, engine, served_model_names, ERROR_RESPONSES)  # /v1/embeddings, /score, /rerank, ...
    public = PUBLIC_PATHS | (mount_web_ui(app, engine, prometheus) if web_ui else frozenset())
    app.add_middleware(CatchAllMiddleware)  # type: ignore[arg-type]
    if api_keys:
        app.add_middleware(AuthMiddleware, api_keys=api_keys, public_paths=public)  # type: ignore[arg-type]
    # Added last = outermost: oversized bodies are refused before anything else reads them.
    app.add_middleware(
        BodySizeLimitMiddleware,  # type: ignore[arg-type]
        max_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
    )
    return app
