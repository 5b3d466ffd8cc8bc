"""The errors a request can meet, each with its HTTP status and OpenAI's error body.

OpenAI's clients (the ``openai`` SDK among them) read ``{"error": {"message", "type", "param",
"code"}}`` and retry 429 and 5xx answers after ``Retry-After`` seconds.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ServeError", "RequestError", "ModelNotFound", "Overloaded", "Unavailable", "GenerationFailed", "error_body"]


class ServeError(Exception):
    """An error answered with ``status``; ``param`` names the request field at fault."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.message, self.param, self.code, self.retry_after = message, param, code, retry_after

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)

    def headers(self) -> dict:
        return {} if self.retry_after is None else {"Retry-After": str(int(self.retry_after))}


class RequestError(ServeError):
    """400: a field is missing, of the wrong type, out of range or not supported."""

    status = 400
    kind = "invalid_request_error"


class ModelNotFound(ServeError):
    """404: the request names a model that cannot be loaded."""

    status = 404
    kind = "invalid_request_error"


class Overloaded(ServeError):
    """503 with ``Retry-After``: every slot of the admission queue is taken."""

    status = 503
    kind = "server_overloaded"


class Unavailable(ServeError):
    """503 with ``Retry-After``: the generation loop is restarting or has stopped."""

    status = 503
    kind = "server_unavailable"


class GenerationFailed(ServeError):
    """500: the generation loop failed while the request was in it (it is restarted)."""

    status = 500
    kind = "server_error"


def error_body(message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
