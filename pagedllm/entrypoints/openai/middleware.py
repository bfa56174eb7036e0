"""Pure-ASGI middleware of the server (BaseHTTPMiddleware would break streaming and disconnect
detection) and the HTTP protocol class that bounds how long a client may take to send its request.

- `AuthMiddleware`: the API key on every route but `/health`, `/ping`, `/version`, `/metrics`.
- `BodySizeLimitMiddleware`: 413 for bodies over the limit, 408 for a body that stops arriving (a
  Content-Length larger than what is sent) before the handler ever sees it.
- `CatchAllMiddleware`: an unexpected exception becomes a 500 with an OpenAI error body on a connection
  that stays usable (Starlette's own handler re-raises, and uvicorn then drops the keep-alive
  connection without a word).
- `TimeoutH11Protocol`: uvicorn's h11 protocol with a deadline for the request head (uvicorn has none:
  a client sending half a header line, or nothing at all, held a connection forever).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
from collections.abc import Sequence
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import error_body
from pagedllm.logger import init_logger

logger = init_logger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


async def send_json(send: Send, status: int, body: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data})


class AuthMiddleware:
    """`Authorization: Bearer <key>` on every route but the public ones; keys compared in constant time."""

    def __init__(self, app: ASGIApp, api_keys: list[str], public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.keys = [f"Bearer {k}".encode() for k in api_keys]
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        ok = False
        for key in self.keys:  # no early exit: the time taken does not depend on which key matched
            ok |= hmac.compare_digest(given, key)
        if not ok:
            await send_json(
                send,
                401,
                error_body("Unauthorized: a valid API key is required (header 'Authorization: Bearer <key>')", 401),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class _StartTracker:
    """`send`, noting whether the response has started (an error response can only replace it before)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`: checked on Content-Length up front, and counted while reading
    (chunked uploads), so a huge body is never buffered whole. 408 when the rest of a body does not
    arrive within `body_timeout_s` (only while the body is incomplete: after it, `receive` is the
    disconnect listener of streaming responses and waits as long as the response lasts)."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    def _message(self) -> str:
        return f"Request body too large: the limit is {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await send_json(send, 413, error_body(self._message(), 413))
                    return
        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                raise BodyTimeout(f"Request body not received within {self.body_timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self._message())
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        tracking_send = _StartTracker(send)
        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not tracking_send.started:
                await send_json(send, 413, error_body(self._message(), 413))
        except BodyTimeout as e:
            if not tracking_send.started:
                await send_json(send, 408, error_body(str(e), 408), [(b"connection", b"close")])


def unwrap_limit_error(exc: BaseException) -> tuple[int, str] | None:
    """(status, message) when `exc` (or what it wraps: Starlette re-raises body errors as HTTP 400)
    is a body-size or body-time limit."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, BodyTooLarge):
            return 413, str(e)
        if isinstance(e, BodyTimeout):
            return 408, str(e)
    return None


class CatchAllMiddleware:
    """A 500 with an OpenAI error body for any exception that escapes the app before the response
    started, without closing the connection; logged with its traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracking_send = _StartTracker(send)
        try:
            await self.app(scope, receive, tracking_send)
        except (BodyTooLarge, BodyTimeout):
            raise
        except Exception as e:
            if tracking_send.started:
                raise
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            await send_json(send, 500, error_body(f"Internal server error: {type(e).__name__}: {e}", 500))


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on a client connection. asyncio sets it only on sockets made with proto IPPROTO_TCP, and the
    listening socket that several API-server processes share (`socket.create_server(reuse_port=True)`) has proto
    0: its connections kept Nagle's algorithm, which held a stream's first small SSE chunks until the client's
    delayed ACK (~40 ms; the S1 / S2 TTFT tail with --api-server-count 2, benchmarks/NOTES.md session 18)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the connection is already gone
            pass


class TimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection whose request head (request line and headers) is not
    complete `header_timeout_s` after its first byte (or after the connection opened) is closed. The
    idle time between requests stays uvicorn's `--timeout-keep-alive`."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        set_nodelay(transport)
        super().connection_made(transport)
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # a head in progress: its deadline runs from its first byte
        else:
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_head_timer()  # idle between requests: uvicorn's keep-alive timeout applies

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing a connection whose request head took over %g s", self.header_timeout_s)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)
