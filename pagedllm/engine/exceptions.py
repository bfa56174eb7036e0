"""Errors the engine front end raises to its callers about one request (the engine goes on)."""

from __future__ import annotations


class RequestFailedError(RuntimeError):
    """The request failed inside the engine (finish reason "error": e.g. a user logits processor raised
    on it); only this request ended, the engine keeps serving the others."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id


class RequestTimeoutError(RuntimeError):
    """The request ran longer than the front end's per-request time limit and was aborted."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"request_timeout: request {request_id} ran longer than {timeout_s:g} s and was aborted")
        self.request_id = request_id
