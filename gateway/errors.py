"""Errors a client sees, rendered in the shape of the API it called.

Handlers raise `ApiError` with an HTTP status as OpenAI would answer it; the Anthropic rendering
maps the same status onto Anthropic's error types (and a full queue, 429, onto 529 overloaded_error).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    504: "timeout_error",
}
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "overloaded_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_STATUS = {429: 529, 503: 529}  # Anthropic answers "overloaded" with its own status code

# What each protocol error code (protocol.ERROR_CODES) means for an HTTP client.
WORKER_ERROR_STATUS = {
    "bad_request": 400,
    "too_large": 413,
    "prompt_too_long": 400,
    "timeout": 504,
    "shutting_down": 503,
    "duplicate_id": 409,  # a client's X-Request-Id already running on another gateway
    "unavailable": 503,  # the gateway lost events (protocol.ERROR_CODES has no such code: see replies.py)
}

# The code metrics count an error without one of its own by (validation's 400s, aiohttp's 404/405/413).
STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
    429: "overloaded",
    500: "internal",
    503: "unavailable",
    504: "timeout",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @classmethod
    def from_worker(cls, code: str, message: str) -> ApiError:
        return cls(WORKER_ERROR_STATUS.get(code, 500), message, code=code)

    @property
    def label(self) -> str:
        """The error's code for metrics, from one vocabulary: its own code, else one its status implies."""
        return self.code or STATUS_CODES.get(self.status, "bad_request" if self.status < 500 else "internal")


def api_of(request: web.Request) -> str:
    """Which API's error shape a request expects: "anthropic" for /v1/messages*, else "openai"."""
    return "anthropic" if request.path.startswith("/v1/messages") else "openai"


def openai_error_body(error: ApiError) -> dict[str, Any]:
    default_type = "invalid_request_error" if error.status < 500 else "server_error"
    kind = OPENAI_TYPES.get(error.status, default_type)
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    default_type = "invalid_request_error" if error.status < 500 else "api_error"
    kind = ANTHROPIC_TYPES.get(error.status, default_type)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(api: str, error: ApiError) -> web.Response:
    if api == "anthropic" and error.code == "rate_limit_exceeded":  # a key's own limit, not an overloaded service
        status, body = 429, {"type": "error", "error": {"type": "rate_limit_error", "message": error.message}}
    elif api == "anthropic":
        status, body = ANTHROPIC_STATUS.get(error.status, error.status), anthropic_error_body(error)
    else:
        status, body = error.status, openai_error_body(error)
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)
