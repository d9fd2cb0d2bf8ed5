"""Error shapes of the OpenAI and Anthropic APIs, and the status each kind of failure gets.

One `ApiError(kind, message, param, code)` describes a failure independent of the API; each
API renders it in its own shape:

- OpenAI:    `{"error": {"message", "type", "param", "code"}}`
- Anthropic: `{"type": "error", "error": {"type", "message"}}`

| kind              | OpenAI status / type               | Anthropic status / type      |
| ----------------- | ---------------------------------- | ---------------------------- |
| invalid_request   | 400 invalid_request_error          | 400 invalid_request_error    |
| authentication    | 401 invalid_request_error          | 401 authentication_error     |
|                   |     (code invalid_api_key)         |                              |
| not_found         | 404 invalid_request_error          | 404 not_found_error          |
| method_not_allowed| 405 invalid_request_error          | 405 invalid_request_error    |
| request_timeout   | 408 invalid_request_error          | 408 timeout_error            |
| request_too_large | 413 invalid_request_error          | 413 request_too_large        |
| unsupported_media | 415 invalid_request_error          | 415 invalid_request_error    |
| headers_too_large | 431 invalid_request_error          | 431 invalid_request_error    |
| overloaded        | 429 rate_limit_error               | 529 overloaded_error         |
| unavailable       | 503 service_unavailable_error      | 503 overloaded_error         |
| internal          | 500 server_error                   | 500 api_error                |
"""

from __future__ import annotations

import enum
from typing import Any

import attrs


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TIMEOUT = "request_timeout"  # the body did not arrive in time
    REQUEST_TOO_LARGE = "request_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # a body that is not application/json
    HEADERS_TOO_LARGE = "headers_too_large"
    OVERLOADED = "overloaded"  # the pending queue is full
    UNAVAILABLE = "unavailable"  # queue timeout, or the engine is unhealthy
    INTERNAL = "internal"


_OPENAI = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.AUTHENTICATION: (401, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.REQUEST_TIMEOUT: (408, "invalid_request_error"),
    ErrorKind.REQUEST_TOO_LARGE: (413, "invalid_request_error"),
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: (415, "invalid_request_error"),
    ErrorKind.HEADERS_TOO_LARGE: (431, "invalid_request_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}

_ANTHROPIC = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.AUTHENTICATION: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.REQUEST_TIMEOUT: (408, "timeout_error"),
    ErrorKind.REQUEST_TOO_LARGE: (413, "request_too_large"),
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: (415, "invalid_request_error"),
    ErrorKind.HEADERS_TOO_LARGE: (431, "invalid_request_error"),
    ErrorKind.OVERLOADED: (529, "overloaded_error"),
    ErrorKind.UNAVAILABLE: (503, "overloaded_error"),
    ErrorKind.INTERNAL: (500, "api_error"),
}

_DEFAULT_CODES = {
    ErrorKind.AUTHENTICATION: "invalid_api_key",
    ErrorKind.NOT_FOUND: "not_found",
    ErrorKind.REQUEST_TIMEOUT: "request_timeout",
    ErrorKind.REQUEST_TOO_LARGE: "request_too_large",
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: "unsupported_media_type",
    ErrorKind.HEADERS_TOO_LARGE: "headers_too_large",
    ErrorKind.OVERLOADED: "overloaded",
    ErrorKind.UNAVAILABLE: "service_unavailable",
}


_KIND_OF_STATUS = {
    401: ErrorKind.AUTHENTICATION, 404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED,
    408: ErrorKind.REQUEST_TIMEOUT, 413: ErrorKind.REQUEST_TOO_LARGE, 415: ErrorKind.UNSUPPORTED_MEDIA_TYPE,
    431: ErrorKind.HEADERS_TOO_LARGE,
}  # fmt: skip


def kind_of_status(status: int) -> ErrorKind:
    """The kind of a framework's HTTP error status (other 4xx are invalid requests)."""
    if status in _KIND_OF_STATUS:
        return _KIND_OF_STATUS[status]
    return ErrorKind.INVALID_REQUEST if status < 500 else ErrorKind.INTERNAL


@attrs.frozen
class ApiError(Exception):
    """A failure to report to the client, in whichever API shape the route speaks."""

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def openai(self) -> tuple[int, dict[str, Any]]:
        """(status, body) in the OpenAI shape."""
        status, type_ = _OPENAI[self.kind]
        body = {"message": self.message, "type": type_, "param": self.param,
                "code": self.code or _DEFAULT_CODES.get(self.kind)}  # fmt: skip
        return status, {"error": body}

    def anthropic(self) -> tuple[int, dict[str, Any]]:
        """(status, body) in the Anthropic shape."""
        status, type_ = _ANTHROPIC[self.kind]
        return status, {"type": "error", "error": {"type": type_, "message": self.message}}
