"""What `up` says it changes on a running cluster, and the safe order for access changes."""

from __future__ import annotations

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.cluster.changes import described, guard_step

GENERATED = "/state/api-token"


def test_nothing_changed_says_nothing():
    assert described(Settings(), Settings()) == []


def test_a_plain_up_after_public_says_nginx_moves_back_and_credentials_go():
    lines = described(Settings(public=True), Settings())
    assert lines[0] == "nginx moves from 0.0.0.0:8080 to 127.0.0.1:8080 (reachable: this box only)"
    assert "credentials: no longer required (anyone on this box)" in lines


def test_going_public_says_where_and_that_credentials_are_required():
    lines = described(Settings(), Settings(public=True))
    assert lines == [
        "nginx moves from 127.0.0.1:8080 to 0.0.0.0:8080 (reachable: other machines too)",
        "credentials: now required",
    ]


def test_public_without_credentials_is_a_warning():
    lines = described(Settings(), Settings(public=True, no_auth=True))
    assert any(line.startswith("WARNING: open to anyone") for line in lines)


def test_other_settings_are_said_by_flag():
    assert described(Settings(), Settings(surge=1, probe_interval=0.5)) == [
        "--probe-interval: 1.0 -> 0.5",
        "--surge: 0 -> 1",
    ]


def test_one_step_when_the_listener_or_the_credentials_stay():
    assert guard_step(Settings(), Settings(api_token_file="/t"), GENERATED) is None  # credentials only
    assert guard_step(Settings(api_token_file="/t"), Settings(api_token_file="/t", public=True), GENERATED) is None
    assert guard_step(Settings(public=True, no_auth=True), Settings(), GENERATED) is None  # nothing to keep


def test_going_public_puts_credentials_in_force_on_the_old_listener_first():
    step = guard_step(Settings(), Settings(public=True), GENERATED)
    assert step is not None
    assert (step.listen_host, step.port, step.exposed) == ("127.0.0.1", 8080, False)
    assert step.auth_required and step.api_token_file == GENERATED


def test_going_back_to_loopback_moves_nginx_first_with_the_old_credentials():
    step = guard_step(Settings(public=True, api_token_file="/t"), Settings(), GENERATED)
    assert step is not None
    assert (step.listen_host, step.exposed) == ("127.0.0.1", False)
    assert step.auth_required and step.api_token_file == "/t"
    users = guard_step(Settings(public=True, ui_auth="/u"), Settings(), GENERATED)
    assert users is not None and users.ui_auth == "/u" and users.api_token_file == "" and users.auth_required
