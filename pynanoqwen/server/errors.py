"""The one error a request can end in, and its JSON: OpenAI's error object, on every endpoint.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}

`type` follows from the status as in OpenAI's API; `param` names the request field at fault (or
null); `code` is a short machine-readable reason (or null). llama.cpp's /infill clients read only
`error.message`, which this shape has too.
"""

from __future__ import annotations

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # with code invalid_api_key, as OpenAI answers a bad key
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "server_error",  # the model file cannot do what was asked (a chat template that does not compile)
    503: "unavailable_error",
}


class ApiError(Exception):
    """A request that cannot be served: its HTTP status and OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
