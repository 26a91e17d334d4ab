"""Error codes that travel in `error` events, and the exception that carries them."""

from __future__ import annotations

ERROR_CODES = {
    "bad_request": "the message is malformed or a field is invalid",
    "too_large": "the message or a field is over its size limit",
    "unsupported_version": "the protocol version is not one this worker speaks",
    "duplicate_id": "a request with this id is already running",
    "prompt_too_long": "the prompt does not fit the model's context",
    "timeout": "the request's deadline passed before it finished",
    "retry_limit": "the request was abandoned by too many workers",
    "shutting_down": "the worker stopped before the request could run",
    "internal": "the worker failed while running the request",
    "reply_denied": "the worker could not write the reply address (dead letters only)",
}


class ProtocolError(ValueError):
    """A message that breaks the protocol; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str, *, request_id: str | None = None, reply: object | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.reply = reply
