"""Who may use the service: API tokens, UI users and signed session cookies.

The launcher turns ``--api-token-file`` and ``--ui-auth`` into one policy file in the
private run dir (0600): token digests (SHA-256, never the tokens), the users' bcrypt
hashes, and the secret that signs session cookies. Every instance reads the same file,
so a session made by one instance is good on all of them, and re-reads it when it
changes, so new tokens work without a restart.

Instance side: standard library only (bcrypt is imported when a user logs in with a
password).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie

log = logging.getLogger("cosyvoice_lb.instance")

SESSION_COOKIE = "cvlb_session"
SESSION_SECONDS = 7 * 86400
MIN_TOKEN_CHARS = 16
BCRYPT = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")
# Owners (Policy.owner): a token's is named by this many hex digits of its digest
OWNER_HEX = 16
SHARED_OWNER = "local"  # everyone's, where no credentials are asked


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def read_tokens(text: str, source: str) -> list[str]:
    """Tokens from a token file: one per line, blank lines and ``#`` comments skipped."""
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if any(c.isspace() for c in token) or not token.isprintable():
            raise ValueError(f"{source} line {number}: a token is one word of printable characters")
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"{source} line {number}: the token has {len(token)} characters, fewer than "
                f"{MIN_TOKEN_CHARS}; make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        tokens.append(token)
    return tokens


def read_htpasswd(text: str, source: str) -> dict[str, str]:
    """Users from an htpasswd file (``user:hash`` lines); bcrypt hashes only."""
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        user, sep, hashed = line.strip().partition(":")
        if not sep or not user:
            raise ValueError(f"{source} line {number}: expected user:hash, as htpasswd writes")
        if not BCRYPT.match(hashed):
            raise ValueError(
                f"{source} line {number}: user {user}'s password is not a bcrypt hash (MD5, SHA-1 and "
                f"crypt hashes are too weak to accept): set it again with: htpasswd -B {source} {user}"
            )
        users[user] = hashed
    return users


def session_of(cookie_header: str) -> str:
    """The session cookie's value in a Cookie header ("" when absent or unreadable)."""
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(cookie_header)
    except CookieError:
        return ""
    morsel = jar.get(SESSION_COOKIE)
    return morsel.value if morsel else ""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Policy:
    """What one policy file allows. ``tokens``: SHA-256 hex digests; ``users``: bcrypt hashes."""

    tokens: frozenset[str] = frozenset()
    users: dict[str, str] = field(default_factory=dict)
    secret: bytes = b""

    def to_json(self) -> str:
        body = {"tokens": sorted(self.tokens), "users": self.users, "secret": self.secret.hex()}
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Policy:
        data = json.loads(text)
        secret = bytes.fromhex(data["secret"])
        if len(secret) < 16:
            raise ValueError("the session secret is too short")
        return cls(frozenset(data["tokens"]), dict(data["users"]), secret)

    def token_ok(self, token: str) -> bool:
        return bool(token) and digest(token) in self.tokens

    def bearer_ok(self, authorization: str) -> bool:
        scheme, _, token = authorization.strip().partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(token.strip())

    def login(self, user: str, password: str) -> str | None:
        """The credential key a login proves (a token, or a user's password), or None."""
        if self.token_ok(password):
            return "t:" + digest(password)
        if not password or not self.users:
            return None
        import bcrypt  # (only logins with a password need it)

        known = user in self.users
        # An unknown user costs a bcrypt check too: the answer's time does not tell who exists.
        hashed = self.users[user] if known else next(iter(self.users.values()))
        try:
            good = bcrypt.checkpw(password.encode("utf-8", "surrogatepass"), hashed.encode()) and known
        except ValueError:
            return None
        return "u:" + user + ":" + hashlib.sha256(hashed.encode()).hexdigest() if good else None

    def _still_valid(self, key: str) -> bool:
        kind, _, rest = key.partition(":")
        if kind == "t":
            return rest in self.tokens
        user, _, fingerprint = rest.rpartition(":")
        hashed = self.users.get(user)
        return hashed is not None and hmac.compare_digest(hashlib.sha256(hashed.encode()).hexdigest(), fingerprint)

    def session(self, key: str, now: float, seconds: float = SESSION_SECONDS) -> str:
        """A session cookie value for a login that proved ``key``."""
        body = _b64(json.dumps({"k": key, "e": int(now + seconds)}).encode())
        return body + "." + _b64(hmac.new(self.secret, body.encode(), hashlib.sha256).digest())

    def session_ok(self, cookie: str, now: float) -> bool:
        """A cookie this policy signed, not expired, whose token or password still stands."""
        return self.session_key(cookie, now) is not None

    def session_key(self, cookie: str, now: float) -> str | None:
        """The credential key a good session cookie carries (see :meth:`login`), or None."""
        body, _, signature = cookie.partition(".")
        if not body or not signature or not self.secret:
            return None
        expected = _b64(hmac.new(self.secret, body.encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected, signature):
            return None
        try:
            data = json.loads(_unb64(body))
            key = str(data["k"])
            return key if now < float(data["e"]) and self._still_valid(key) else None
        except (ValueError, KeyError, TypeError):
            return None

    def owner(self, headers: Mapping[str, str], now: float) -> str:
        """Whose request this is, for what it leaves behind (a long-form job): the bearer
        token's ``token:<16 hex of its digest>``, a session's ``user:<login>`` (or its token's
        ``token:…`` when the login was a token); "" when no credential holds. A service
        without a policy has one shared owner (``SHARED_OWNER``)."""
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and self.token_ok(token.strip()):
            return "token:" + digest(token.strip())[:OWNER_HEX]
        key = self.session_key(session_of(headers.get("cookie", "")), now) or ""
        kind, _, rest = key.partition(":")
        if kind == "t":
            return "token:" + rest[:OWNER_HEX]
        if kind == "u":
            return "user:" + rest.rpartition(":")[0]
        return ""


CLOSED = Policy()  # what an unreadable policy file allows: nothing


class PolicyFile:
    """The policy file as the instance sees it: re-read when it changes; a file that cannot
    be read or parsed allows nothing. By default it is looked at (one stat) on every request,
    so the moment `up` has written new tokens they hold."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic, every: float = 0.0):
        self.path, self.clock, self.every = path, clock, every
        self._policy, self._checked = CLOSED, float("-inf")
        self._seen: tuple[int, int, int] | None = None
        self._failing = ""
        self.current()

    def current(self) -> Policy:
        now = self.clock()
        if now - self._checked < self.every:
            return self._policy
        self._checked = now
        try:
            info = os.stat(self.path)
            seen = (info.st_mtime_ns, info.st_size, info.st_ino)
            if seen != self._seen:
                with open(self.path, encoding="utf-8") as handle:
                    self._policy = Policy.from_json(handle.read())
                self._seen, self._failing = seen, ""
                log.info(
                    "access policy loaded: %d token(s), %d user(s)", len(self._policy.tokens), len(self._policy.users)
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not self._failing:  # said once, not once a second
                log.error(
                    "access policy %s unreadable (%s): refusing every request that needs credentials", self.path, exc
                )
            self._policy, self._seen, self._failing = CLOSED, None, str(exc)
        return self._policy
