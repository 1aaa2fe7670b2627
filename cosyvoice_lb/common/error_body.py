"""The one shape of an error answer, for every route of an instance (and nginx's own).

It is OpenAI's (``{"error": {"message", "type", "param", "code"}}``), which the official
client reads, plus our ``status``. OpenAI's client retries 408, 409, 429 and 5xx twice by
default unless the answer says ``x-should-retry: false``: every answer a retry cannot
change says so, so no GPU work is repeated for a request that cannot succeed.

Instance side: standard library only.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

# Worth retrying: the client waits (Retry-After), and then another instance or a freed
# slot may serve it.
RETRYABLE = frozenset({408, 429, 502, 503})

TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    # (a message that quotes client input must still encode: lone surrogates are escaped)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code, "status": status}}


def error_headers(status: int) -> dict[str, str]:
    """``x-should-retry: false`` for what a retry cannot change."""
    return {} if status in RETRYABLE else {"x-should-retry": "false"}


def refusal(status: int, message: str, headers: dict[str, str] | None = None) -> list[MutableMapping[str, Any]]:
    """The ASGI messages of a refusal in the one shape, for middleware that answers before
    any route does."""
    body = json.dumps(error_body(status, message)).encode()
    fields = {
        **error_headers(status),
        **(headers or {}),
        "content-type": "application/json",
        "content-length": str(len(body)),
    }
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fields.items()],
    }
    return [start, {"type": "http.response.body", "body": body, "more_body": False}]
