"""One segment of a job over HTTP: an ordinary ``POST /v1/audio/speech`` through the balancer.

The body is the job's request (its voice, speed, instructions, model, CosyVoice's mode,
prompt text and speaker) with the segment as ``input``, the job's one seed, and
``response_format`` wav (the runner joins segments as samples and encodes the result once).
The request goes through nginx like any client's, so it lands on the least busy instance and
meets admission, the queue bound, hang detection and the poison ledger there.

What comes back is wav bytes, or a :class:`SegmentError` that says whether a retry can change
it (``retryable``):

- retryable: nothing answered (refused, reset, an answer cut off mid-way), 502 (no instance
  answered, or bad audio: an instance whose synthesis failed its audio check), 503 (every
  instance busy or not ready), 429, and a 200 whose body is not audio; unless the answer says
  ``X-Should-Retry: false``.
- not: the input (400, 404, 413, 422 and a poison request's 422), the credentials (401, 403),
  a segment past the request timeout (504, or no answer within ``timeout``: sent again it may
  hang another instance), anything else.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import requests
import soundfile
from urllib3.exceptions import ReadTimeoutError

from cosyvoice_lb.instance.speech.admission import BACKGROUND_HEADER

# The job's params that a segment's request repeats (the rest are the runner's to set)
FIELDS = ("model", "voice", "instructions", "speed", "mode", "prompt_text", "speaker")
RETRY_STATUSES = frozenset({429, 502, 503})
CONNECT_TIMEOUT = 5.0
DEFAULT_TIMEOUT = 600.0  # one segment's answer, at most (the cluster's --request-timeout bounds it first)
NO_ANSWER = 0  # SegmentError.status when no HTTP answer came
MAX_BYTES = 256 * 1024 * 1024  # one segment's audio: minutes of wav at most
CHUNK = 64 * 1024


class SegmentError(Exception):
    """A segment got no audio: ``status`` (0: no answer), what happened, whether to retry."""

    def __init__(self, status: int, message: str, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after


def body_of(params: Mapping[str, Any], text: str, seed: int | None) -> dict[str, Any]:
    """The segment's JSON body."""
    body = {k: params[k] for k in FIELDS if params.get(k) not in (None, "")}
    body.update(input=text, response_format="wav")
    if seed is not None:
        body["seed"] = seed
    return body


def message_of(status: int, content: bytes) -> str:
    """The answer's error message (the instances' and nginx's shape), else its status."""
    try:
        return str(json.loads(content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = " ".join(content.decode("utf-8", "replace").split())[:200]
        return f"HTTP {status} from the balancer" + (f": {text}" if text else "")


def retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        value = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if 0 <= value <= 3600 else None


def audio_problem(data: bytes) -> str:
    """Why ``data`` is not a segment's audio (empty, not a sound file, no samples), or ""."""
    if not data:
        return "an empty body"
    try:
        info = soundfile.info(io.BytesIO(data))
    except RuntimeError as exc:
        return f"not a sound file ({exc})"
    return "" if info.frames > 0 else "a sound file without samples"


def read_body(response: requests.Response, deadline: float) -> bytes:
    """The whole body, by ``deadline`` (time.monotonic()) and at most ``MAX_BYTES``."""
    data = bytearray()
    for chunk in response.iter_content(CHUNK):
        data += chunk
        if len(data) > MAX_BYTES:
            raise SegmentError(
                response.status_code, f"the answer is larger than {MAX_BYTES} bytes: lower --segment-chars", False
            )
        if time.monotonic() > deadline:
            raise TimeoutError
    return bytes(data)


def judge(status: int, headers: Mapping[str, str], content: bytes) -> bytes:
    """The audio of a 200, or the SegmentError the answer is."""
    if status == 200:
        problem = audio_problem(content)
        if problem:
            raise SegmentError(502, f"the balancer answered 200 with {problem}", retryable=True)
        return content
    allowed = headers.get("x-should-retry", "").lower() != "false"
    retryable = status in RETRY_STATUSES and allowed
    raise SegmentError(status, message_of(status, content), retryable, retry_after(headers) if retryable else None)


class Sender:
    """``send(params, text, seed) -> wav bytes`` against the balancer at ``url``.

    ``headers``: the runner's credentials (``Authorization``), sent with every segment, with
    the mark of background work (``BACKGROUND_HEADER``: interactive requests go first).
    ``timeout``: seconds one segment's answer may take. One HTTP session per thread (the
    runner sends from several), none reading proxies from the environment: the balancer is
    on this box."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the balancer's URL: http://HOST:PORT, not {url!r}")
        self.url = url.rstrip("/") + "/v1/audio/speech"
        # Background work: every instance serves interactive requests before a segment
        self.headers = {**(headers or {}), BACKGROUND_HEADER: "1"}
        self.timeout = timeout
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = False
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def __call__(self, params: Mapping[str, Any], text: str, seed: int | None) -> bytes:
        deadline = time.monotonic() + self.timeout
        try:
            with self._session().post(
                self.url,
                json=body_of(params, text, seed),
                headers=self.headers,
                timeout=(min(CONNECT_TIMEOUT, self.timeout), self.timeout),
                stream=True,
            ) as response:
                content = read_body(response, deadline)
        except requests.ConnectTimeout as exc:
            raise SegmentError(NO_ANSWER, f"the balancer {self.url} did not answer ({exc})", True) from None
        except (requests.Timeout, TimeoutError):
            raise self.too_slow() from None
        except requests.RequestException as exc:  # refused, reset, cut off mid-way
            if any(isinstance(arg, ReadTimeoutError) for arg in exc.args):  # (a body that stopped coming)
                raise self.too_slow() from None
            raise SegmentError(NO_ANSWER, f"the balancer {self.url} did not answer ({exc})", True) from None
        return judge(response.status_code, response.headers, content)

    def too_slow(self) -> SegmentError:
        return SegmentError(
            504,
            f"no whole answer within {self.timeout:g} s: the segment may hang the model; lower --segment-chars "
            "or raise --request-timeout",
            retryable=False,
        )

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()
