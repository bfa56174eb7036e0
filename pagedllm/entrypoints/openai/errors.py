"""The OpenAI-style errors of the API server: `OpenAIServingError` (rendered as `{"error": {...}}` with its HTTP
status) and the errors of a failed request, a dead engine and a plain error body."""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from pagedllm.engine.exceptions import RequestFailedError, RequestTimeoutError
from pagedllm.engine.mp_client import EngineDeadError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_PARAM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIServingError(Exception):
    """Raised by handlers; rendered as `{"error": {...}}` with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", ""))

    @classmethod
    def from_value_error(cls, e: Exception) -> OpenAIServingError:
        """Engine ValueErrors read "field: message"; the field becomes the error's `param`."""
        msg = str(e)
        m = _PARAM_RE.match(msg)
        return cls(msg, 400, m.group(1) if m else None)

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.err_type, param=self.param, code=self.status)
        )


def request_error(e: Exception) -> OpenAIServingError:
    """The HTTP error for an exception that ended one request (a timeout: 408; anything else: 500)."""
    if isinstance(e, RequestTimeoutError):
        return OpenAIServingError(str(e), 408, "request_timeout")
    if isinstance(e, RequestFailedError):
        return OpenAIServingError(str(e), 500)
    return OpenAIServingError(f"{type(e).__name__}: {e}", 500)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return OpenAIServingError(message, status, param).to_response().model_dump()


def engine_dead_error(e: EngineDeadError | None = None) -> OpenAIServingError:
    return OpenAIServingError(str(e or EngineDeadError()), 503)
