"""The access policy: token and htpasswd files, bearer checks, signed sessions, reloads."""

from __future__ import annotations

import os

import pytest
from conftest import TOKEN, bcrypt_line

from cosyvoice_lb.instance.access.auth import CLOSED, Policy, PolicyFile, digest, read_htpasswd, read_tokens


def policy(**users: str) -> Policy:
    return Policy(
        frozenset({digest(TOKEN)}),
        read_htpasswd("\n".join(bcrypt_line(u, p) for u, p in users.items()), "users"),
        b"s" * 32,
    )


def test_token_file_skips_comments_and_blank_lines():
    assert read_tokens(f"# ops team\n\n  {TOKEN}  \n# old: x\nsecond-token-abcdefghijk\n", "f") == [
        TOKEN,
        "second-token-abcdefghijk",
    ]


@pytest.mark.parametrize(
    "text,words",
    [
        ("short\n", "fewer than 16"),
        ("two words-in-one-line-xxxxx\n", "one word"),
        ("tab\tseparated-token-xxxxxxx\n", "one word"),
    ],
)
def test_bad_tokens_are_refused_with_the_line_and_the_fix(text, words):
    with pytest.raises(ValueError, match=words) as caught:
        read_tokens("# header\n" + text, "tokens.txt")
    assert "tokens.txt line 2" in str(caught.value)


def test_htpasswd_takes_bcrypt_only_and_says_how_to_fix_others():
    assert set(read_htpasswd(bcrypt_line("ann", "pw") + "\n# comment\n", "u")) == {"ann"}
    for weak in ("bob:$apr1$abcdefgh$0123456789abcdefghijkl", "bob:{SHA}W6ph5Mm5Pz8GgiULbPgzG37mj9g=", "bob:plain"):
        with pytest.raises(ValueError, match=r"htpasswd -B users bob"):
            read_htpasswd(weak, "users")
    with pytest.raises(ValueError, match="user:hash"):
        read_htpasswd("no-colon-here", "users")


def test_bearer_needs_the_scheme_and_a_known_token():
    p = policy()
    assert p.bearer_ok(f"Bearer {TOKEN}") and p.bearer_ok(f"bearer  {TOKEN} ")
    for header in ("", TOKEN, f"Basic {TOKEN}", "Bearer ", f"Bearer {TOKEN}x", "Bearer \ud800"):
        assert not p.bearer_ok(header)


def test_login_with_a_token_or_a_user_password():
    p = policy(ann="correct horse")
    assert p.login("", TOKEN) == "t:" + digest(TOKEN)
    assert p.login("anyone", TOKEN) is not None  # the token is the password, whatever the name
    assert (p.login("ann", "correct horse") or "").startswith("u:ann:")
    for user, password in (("ann", "wrong"), ("ann", ""), ("bob", "correct horse"), ("", "")):
        assert p.login(user, password) is None


def test_a_session_is_good_until_it_expires_and_only_with_its_signature():
    p = policy(ann="pw")
    cookie = p.session(p.login("ann", "pw") or "", now=1000.0, seconds=60)
    assert p.session_ok(cookie, 1059.0)
    assert not p.session_ok(cookie, 1061.0)
    body, _, sig = cookie.partition(".")
    assert not p.session_ok(body + "." + sig[:-2] + "AA", 1001.0)
    assert not p.session_ok(body, 1001.0) and not p.session_ok("", 1001.0) and not p.session_ok("x.y", 1001.0)
    other = Policy(p.tokens, p.users, b"another secret, another cluster")
    assert not other.session_ok(cookie, 1001.0)


def test_a_session_ends_when_its_token_or_password_is_withdrawn():
    p = policy(ann="pw")
    by_token = p.session(p.login("", TOKEN) or "", 0.0)
    by_user = p.session(p.login("ann", "pw") or "", 0.0)
    withdrawn = Policy(frozenset(), p.users, p.secret)
    assert not withdrawn.session_ok(by_token, 1.0) and withdrawn.session_ok(by_user, 1.0)
    changed = Policy(p.tokens, read_htpasswd(bcrypt_line("ann", "new"), "u"), p.secret)
    assert changed.session_ok(by_token, 1.0) and not changed.session_ok(by_user, 1.0)


def test_policy_json_round_trip_holds_digests_never_tokens():
    p = policy(ann="pw")
    text = p.to_json()
    assert TOKEN not in text and digest(TOKEN) in text
    assert Policy.from_json(text) == p


def test_policy_file_reloads_on_change_at_most_once_a_second_and_closes_when_unreadable(tmp_path):
    path = tmp_path / "access.json"
    path.write_text(policy().to_json())
    now = [0.0]
    watched = PolicyFile(str(path), clock=lambda: now[0], every=1.0)
    assert watched.current().token_ok(TOKEN)
    new = "another-token-0123456789abc"
    path.write_text(Policy(frozenset({digest(new)}), {}, b"s" * 32).to_json())
    os.utime(path, ns=(1, 1))  # (a change the stat sees, whatever the clock's resolution)
    now[0] = 0.5
    assert watched.current().token_ok(TOKEN)  # not looked at again yet
    now[0] = 1.5
    assert watched.current().token_ok(new) and not watched.current().token_ok(TOKEN)
    path.write_text("{not json")
    now[0] = 3.0
    assert watched.current() is CLOSED
    path.unlink()
    now[0] = 4.5
    assert watched.current() is CLOSED and not watched.current().bearer_ok(f"Bearer {new}")
