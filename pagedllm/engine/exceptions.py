"""Errors the engine front end raises to its callers about one request (the engine goes on)."""

from __future__ import annotations


class RequestFailedError(RuntimeError):
    """The request failed inside the engine (finish reason "error": e.g. a user logits processor raised
    on it); only this request ended, the engine keeps serving the others."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
