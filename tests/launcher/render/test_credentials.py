"""Exposure and credentials: what each mode requires, the policy file `up` writes, the
generated token, and the refusals that say how to fix a secrets file."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest
from conftest import TOKEN, bcrypt_line

from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.instance.access.auth import Policy, digest
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.render.credentials import jobs_token, open_warning, write_policy
from cosyvoice_lb.launcher.state.layout import Layout


def private(path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize(
    "kwargs,listen,exposed,required",
    [
        ({}, "127.0.0.1", False, False),
        ({"public": True}, "0.0.0.0", True, True),
        ({"public": True, "no_auth": True}, "0.0.0.0", True, False),
        ({"host": "0.0.0.0"}, "0.0.0.0", True, True),  # an explicit address others reach: as --public
        ({"host": "192.168.1.5"}, "192.168.1.5", True, True),
        ({"host": "::"}, "::", True, True),
        ({"host": "127.0.0.2"}, "127.0.0.2", False, False),
        ({"host": "::1"}, "::1", False, False),
        ({"api_token_file": "/x"}, "127.0.0.1", False, True),  # asked for: also on loopback
        ({"ui_auth": "/x"}, "127.0.0.1", False, True),
    ],
)
def test_exposure_and_whether_credentials_are_required(kwargs, listen, exposed, required):
    s = Settings(**kwargs)
    assert (s.listen_host, s.exposed, s.auth_required) == (listen, exposed, required)
    assert bool(open_warning(s)) == (exposed and not required)


def test_contradictions_are_refused(tmp_path):
    tokens = private(tmp_path / "t", TOKEN + "\n")
    assert any("contradict" in p for p in setting_errors(Settings(public=True, host="127.0.0.1")))
    assert any(
        "drop --no-auth" in p for p in setting_errors(Settings(public=True, no_auth=True, api_token_file=tokens))
    )
    assert any("--max-body" in p for p in setting_errors(Settings(max_body="5MiB", max_upload="10MiB")))
    assert not setting_errors(Settings(public=True, api_token_file=tokens))


@pytest.mark.parametrize("value", ["10", "10r/h", "0r/s", "r/s", "ten r/s", "10r/s;"])
def test_a_rate_that_nginx_cannot_take_is_refused(value):
    assert any("--rate-limit" in p and "10r/s" in p for p in setting_errors(Settings(rate_limit=value)))


def test_secrets_files_must_be_private_and_present(tmp_path):
    loose = tmp_path / "tokens"
    loose.write_text(TOKEN + "\n")
    loose.chmod(0o644)
    found = setting_errors(Settings(api_token_file=str(loose)))
    assert any("readable by others (mode 0644)" in p and f"chmod 600 {loose}" in p for p in found)
    assert any("No such file" in p for p in setting_errors(Settings(ui_auth=str(tmp_path / "none"))))
    assert any("is not a file" in p for p in setting_errors(Settings(api_token_file=str(tmp_path))))


def layout(tmp_path) -> Layout:
    (tmp_path / "state/run").mkdir(parents=True)
    return Layout(tmp_path / "state")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_public_without_tokens_generates_one_once_and_keeps_it(tmp_path):
    lay = layout(tmp_path)
    access = write_policy(Settings(public=True), lay)
    assert access.required and access.generated == lay.api_token
    token = lay.api_token.read_text().splitlines()[-1]
    assert mode(lay.api_token) == 0o600 and mode(lay.access_policy) == 0o600
    policy = Policy.from_json(lay.access_policy.read_text())
    assert policy.tokens == {digest(token), digest(jobs_token(lay))} and token not in lay.access_policy.read_text()
    write_policy(Settings(public=True), lay)
    assert lay.api_token.read_text().splitlines()[-1] == token
    assert Policy.from_json(lay.access_policy.read_text()).secret == policy.secret  # sessions survive an `up`


def test_a_token_file_replaces_the_generated_token_and_is_reread(tmp_path):
    lay = layout(tmp_path)
    tokens = tmp_path / "tokens"
    private(tokens, f"# team\n{TOKEN}\n")
    settings = Settings(public=True, api_token_file=str(tokens))
    assert write_policy(settings, lay).generated is None and not lay.api_token.exists()
    private(tokens, f"{TOKEN}\nsecond-token-0123456789\n")
    write_policy(settings, lay)
    assert Policy.from_json(lay.access_policy.read_text()).tokens == {
        digest(TOKEN),
        digest("second-token-0123456789"),
        digest(jobs_token(lay)),
    }


def test_ui_users_go_into_the_policy(tmp_path):
    lay = layout(tmp_path)
    users = private(tmp_path / "users", bcrypt_line("ann", "pw") + "\n")
    access = write_policy(Settings(ui_auth=users), lay)
    assert access.users == 1 and access.generated == lay.api_token  # the API needs a token then too
    assert Policy.from_json(lay.access_policy.read_text()).login("ann", "pw")


@pytest.mark.parametrize(
    "text,words",
    [
        ("# nothing\n", "holds no token"),
        ("short\n", "fewer than 16"),
    ],
)
def test_a_bad_token_file_is_a_clear_error(tmp_path, text, words):
    tokens = private(tmp_path / "tokens", text)
    with pytest.raises(ClusterError, match=words):
        write_policy(Settings(api_token_file=tokens), layout(tmp_path))


def test_back_to_loopback_removes_the_policy(tmp_path):
    lay = layout(tmp_path)
    write_policy(Settings(public=True), lay)
    access = write_policy(dataclasses.replace(Settings(), public=False), lay)
    assert not access.required and not lay.access_policy.exists()


def test_up_says_who_may_get_in_in_each_mode(tmp_path):
    from cosyvoice_lb.launcher.cli import access_lines

    lay = Layout(tmp_path)
    url = "http://127.0.0.1:8080"
    assert access_lines(Settings(), lay, url) == ["  credentials: none needed (only this box can reach it)"]
    (warning,) = access_lines(Settings(public=True, no_auth=True), lay, url)
    assert warning.startswith("WARNING: --no-auth on 0.0.0.0:8080") and "anyone" in warning
    public = "\n".join(access_lines(Settings(public=True), lay, url))
    assert f"generated into {lay.api_token}" in public and "$(tail -n1" in public and f"{url}/login" in public
    tokens = private(tmp_path / "tokens", TOKEN + "\n")
    given = "\n".join(access_lines(Settings(public=True, api_token_file=tokens), lay, url))
    assert f"the API tokens in {tokens}" in given and TOKEN not in given and "generated" not in given
