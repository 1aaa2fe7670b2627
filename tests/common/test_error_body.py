"""The one error shape (OpenAI's) and which answers tell a client a retry cannot help."""

from __future__ import annotations

import pytest

from cosyvoice_lb.common.error_body import error_body, error_headers


@pytest.mark.parametrize(
    "status,kind,retry",
    [
        (400, "invalid_request_error", False),
        (401, "authentication_error", False),
        (404, "not_found_error", False),
        (409, "conflict_error", False),
        (413, "invalid_request_error", False),
        (422, "invalid_request_error", False),
        (429, "rate_limit_error", True),
        (500, "server_error", False),
        (502, "server_error", True),
        (503, "overloaded_error", True),
        (504, "server_error", False),
        (507, "server_error", False),
    ],
)
def test_every_status_has_a_type_and_only_what_may_pass_is_retried(status, kind, retry):
    body = error_body(status, "what to do", param="input", code="x")
    assert body == {"error": {"message": "what to do", "type": kind, "param": "input", "code": "x", "status": status}}
    assert error_headers(status) == ({} if retry else {"x-should-retry": "false"})


def test_a_message_quoting_a_lone_surrogate_still_encodes():
    message = error_body(400, "bad \ud800 here")["error"]["message"]
    assert message.encode("utf-8") == b"bad \\ud800 here"
