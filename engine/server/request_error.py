"""The one error a request is refused with: HTTP status, error type and the offending parameter."""
from __future__ import annotations

from engine.errors import BonsaiError


class RequestError(BonsaiError):
    """A request the server refuses: HTTP status, OpenAI error type and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code, self.headers = param, status, kind, code, headers or {}
