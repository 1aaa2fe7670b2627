"""The jobs API: a long text in, a background job out, its audio fetched when it is done.

Routes (nginx sends ``/v1/audio/jobs`` here, on a unix socket in the private run dir):

- ``POST /v1/audio/jobs``: the body of ``POST /v1/audio/speech`` (``input``, ``voice``,
  ``response_format``, ``speed``, ``instructions``, ``model``, CosyVoice's ``seed`` ...),
  with an ``input`` of up to ``--max-job-chars``; checked as the instances check a speech
  request (the same parsing, the special tokens and wordless texts refused, the voice looked
  up in the saved voices) before anything is queued; 202 with the job.
- ``GET /v1/audio/jobs/{id}``: the job (status, progress in segments, the error).
- ``GET /v1/audio/jobs/{id}/content``: the audio once the job succeeded (HTTP Range works);
  409 before, with the status; 507 for a job the full disk failed.
- ``DELETE /v1/audio/jobs/{id}``: cancels a queued or running job, removes a finished one
  (and its audio).
- ``GET /v1/audio/jobs?limit=&after=``: the caller's jobs, newest first, a page at a time.
- ``GET /metrics``: the jobs' Prometheus metrics (:mod:`cosyvoice_lb.jobs.metrics`); nginx
  does not route it here, only the box's own users reach the socket.
- ``GET /admin/jobs`` and ``DELETE /admin/jobs/{id}`` (cancel): every owner's jobs, for the
  control panel. Like ``/metrics`` they are answered outside the gate, and nginx never
  routes them: the socket, in the private run dir, is the admin's proof.

A succeeded job whose audio ``--outputs-max-size`` removed (:mod:`cosyvoice_lb.jobs.budget`)
reads as ``expired``, with the reason; its content answers 410.

Every job has an owner, the caller the access policy names (``Policy.owner``): another
owner's job reads as missing (404). Without a policy every caller is the one shared owner.
Errors are the instances' one shape (:mod:`cosyvoice_lb.common.error_body`); a store that
fails answers 503 (507 when its disk is full) with what to do.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from cosyvoice_lb.common.error_body import error_body, error_headers
from cosyvoice_lb.instance.access.auth import OWNER_HEX, SHARED_OWNER, PolicyFile
from cosyvoice_lb.instance.access.gate import Gate
from cosyvoice_lb.instance.api.openai import speech_request, voice_target
from cosyvoice_lb.instance.audio.formats import CONTENT_TYPES
from cosyvoice_lb.instance.speech.validation import OPENAI_SPEEDS, BadRequest, check_seed, check_speed, check_text
from cosyvoice_lb.instance.speech.voices import Registry, VoiceNotFound
from cosyvoice_lb.jobs import model
from cosyvoice_lb.jobs.base import JobStore, StoreError, StoreFailure
from cosyvoice_lb.jobs.budget import expired_reason
from cosyvoice_lb.jobs.results import results_dir
from cosyvoice_lb.jobs.runner import segments_of

PREFIX = "/v1/audio/jobs"
# the status the API shows for a succeeded job whose audio was removed (never a stored one)
EXPIRED = "expired"
# A failed job's reason when the disk filled up: its content answers 507, as a full store does
DISK_FULL = "the disk is full"
# A JSON body's bytes per character of input at most (\uXXXX escapes), and room for the rest
BODY_BYTES_PER_CHAR, BODY_SLACK = 12, 64 * 1024
PARAMS = ("model", "voice", "response_format", "speed", "instructions", "seed", "mode", "prompt_text", "speaker")


@dataclass(frozen=True)
class Config:
    """What the API needs of the cluster's settings."""

    state_dir: Path
    max_chars: int = model.MAX_TEXT_CHARS  # --max-job-chars
    segment_chars: int = 200  # --segment-chars: a job's segments are counted the runner's way
    max_age: float | None = 7 * 86400.0  # --job-max-age: a finished job's expires_at
    voices_dir: str = ""  # --voices-dir (default: voices/ in the state dir)
    voice_map: dict[str, str] = field(default_factory=dict)  # --openai-voices
    speakers: tuple[str, ...] = ()  # built-in speakers the engine has (CosyVoice3: none)
    job_results: str = ""  # --job-results (default: jobs/results in the state dir)

    @property
    def voices(self) -> Path:
        return Path(self.voices_dir) if self.voices_dir else self.state_dir / "voices"

    @property
    def results(self) -> Path:
        return results_dir(self.state_dir, self.job_results)


def problem(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param=param),
        status_code=status,
        headers={**error_headers(status), **(headers or {})},
    )


def store_problem(exc: StoreError) -> JSONResponse:
    if exc.kind == StoreFailure.FULL:
        return problem(507, str(exc))
    return problem(503, str(exc), headers={"Retry-After": "5"})


def count_segments(text: str, segment_chars: int) -> int:
    """How many segments the runner makes of ``text`` (its own splitter)."""
    return len(segments_of(text, segment_chars))


def decode(body: bytes) -> Any:
    try:
        decoded = json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):
        raise BadRequest('the body is not valid JSON: POST {"input": "A long text ...", "voice": "alloy"}') from None
    if decoded is None:
        raise BadRequest('no body: POST {"input": "A long text ...", "voice": "alloy"}')
    if not isinstance(decoded, dict):
        raise BadRequest('the body must be a JSON object, e.g. {"input": "A long text ...", "voice": "alloy"}')
    return decoded


def job_request(body: dict[str, Any], config: Config) -> tuple[str, dict[str, Any]]:
    """The text and the job's params, checked as an instance checks a speech request (the
    text against ``--max-job-chars`` instead of one request's limit); BadRequest otherwise."""
    text = body.get("input")
    if isinstance(text, str) and len(text) > config.max_chars:
        raise BadRequest(
            f'"input" has {len(text)} characters, more than a job takes (--max-job-chars {config.max_chars}): '
            "split it into several jobs",
            status=413,
            param="input",
        )
    text = check_text(text, config.max_chars, "input")
    if body.get("stream_format") not in (None, "", "audio"):
        raise BadRequest('a job makes a file, it does not stream: drop "stream_format"', param="stream_format")
    # (the instance's own parsing, for every field but the text's length)
    _, fmt, _ = speech_request({**body, "input": "checked above"}, config.voice_map, list(config.speakers))
    speed = check_speed(body.get("speed", 1.0), *OPENAI_SPEEDS)
    seed = check_seed(body.get("seed"))
    check_voice(body.get("voice"), config)
    params = {k: body[k] for k in PARAMS if body.get(k) not in (None, "")}
    # one seed for every segment: the voice stays one voice from the first to the last
    params.update(response_format=fmt, speed=speed, seed=seed if seed is not None else secrets.randbelow(2**31))
    return text, params


def check_voice(voice: Any, config: Config) -> None:
    """A voice a segment can speak with: an OpenAI name, a built-in speaker or a saved voice."""
    target = voice_target(voice, config.voice_map)
    if not target or target in config.speakers:
        return
    registry = Registry(config.voices)
    if registry.find(target) is None:
        error = VoiceNotFound(target, [f"{v.name} ({v.id})" for v in registry.all()])
        raise BadRequest(str(error), status=404, param="voice")


class Jobs:
    """The routes' work, over one store; ``owner_of`` names a request's owner."""

    def __init__(
        self,
        store: JobStore,
        config: Config,
        owner_of: Callable[[Request], str],
        segments: Callable[[str, int], int] = count_segments,
        clock: Callable[[], float] = time.time,
    ):
        self.store, self.config, self.owner_of, self.segments, self.clock = store, config, owner_of, segments, clock

    async def call(self, work: Callable[[], Response]) -> Response:
        """Store calls block (a lock, a network): off the event loop."""
        try:
            return await asyncio.to_thread(work)
        except StoreError as exc:
            return store_problem(exc)
        except BadRequest as exc:
            return problem(exc.status, str(exc), param=exc.param)

    async def create(self, request: Request) -> Response:
        owner = self.owner_of(request)
        if not owner:
            return problem(401, "this service needs credentials: send 'Authorization: Bearer <API token>'")
        limit = self.config.max_chars * BODY_BYTES_PER_CHAR + BODY_SLACK
        if int(request.headers.get("content-length") or 0) > limit:
            return problem(413, f"the body is larger than a job of {self.config.max_chars} characters needs")
        body = await request.body()
        try:
            text, params = job_request(decode(body), self.config)
        except BadRequest as exc:
            return problem(exc.status, str(exc), param=exc.param)
        return await self.call(lambda: self._create(owner, text, params))

    def _create(self, owner: str, text: str, params: dict[str, Any]) -> Response:
        total = self.segments(text, self.config.segment_chars)
        if total < 1:  # (check_text let no such text through: a word is a segment)
            raise BadRequest('"input" has nothing to say in it', status=422, param="input")
        job = model.new_job(owner, text, total, self.clock(), params=params)
        self.store.create(job, text)
        return JSONResponse(
            model.public(job, self.config.max_age), status_code=202, headers={"Location": f"{PREFIX}/{job.id}"}
        )

    async def get(self, request: Request) -> Response:
        owner, job_id = self.owner_of(request), request.path_params["job_id"]
        return await self.call(lambda: self._found(job_id, owner, lambda job: JSONResponse(self.public(job))))

    def public(self, job: model.Job) -> dict[str, Any]:
        shown = model.public(job, self.config.max_age)
        reason = self.expired(job)
        if reason is not None:
            shown.update(status=EXPIRED, bytes=None, error={"message": reason, "type": "job_expired"})
        return shown

    def expired(self, job: model.Job) -> str | None:
        """Why a succeeded job's audio was removed to keep --outputs-max-size, or None."""
        if job.status != model.SUCCEEDED:
            return None
        return expired_reason(self.config.results / job.id)

    def _found(self, job_id: str, owner: str, answer: Callable[[model.Job], Response]) -> Response:
        job = self.store.get(job_id, owner) if owner and model.is_job_id(job_id) else None
        return answer(job) if job is not None else missing(job_id)

    async def content(self, request: Request) -> Response:
        owner, job_id = self.owner_of(request), request.path_params["job_id"]
        return await self.call(lambda: self._found(job_id, owner, self._content))

    def _content(self, job: model.Job) -> Response:
        if job.status == model.FAILED and (job.error or "").startswith(DISK_FULL):
            return problem(507, f"job {job.id} failed: {job.error}")
        reason = self.expired(job)
        if reason is not None:
            return problem(410, f"job {job.id} expired: {reason}")
        if job.status != model.SUCCEEDED:
            why = f": {job.error}" if job.error else ""
            progress = f" ({job.segments_done} of {job.segments_total} segments done)" if not job.finished else ""
            return problem(409, f"job {job.id} is {job.status}{progress}{why}; its audio comes once it succeeded")
        path = self.result_file(job)
        if path is None or not path.is_file():
            return problem(404, f"job {job.id}'s audio is gone (removed from the disk): make the job again")
        fmt = str(job.params.get("response_format") or "wav")
        media = CONTENT_TYPES.get(fmt, "application/octet-stream")
        name = f"{job.id}{path.suffix}"
        return FileResponse(path, media_type=media, filename=name, headers={"Cache-Control": "private, no-store"})

    def result_file(self, job: model.Job) -> Path | None:
        """The job's audio, inside the results dir only (a record never points elsewhere)."""
        if not job.result_path:
            return None
        path = Path(job.result_path)
        path = (path if path.is_absolute() else self.config.state_dir / path).resolve()
        root = self.config.results.resolve()
        return path if root in path.parents else None

    async def delete(self, request: Request) -> Response:
        owner, job_id = self.owner_of(request), request.path_params["job_id"]
        return await self.call(lambda: self._delete(job_id, owner))

    def _delete(self, job_id: str, owner: str) -> Response:
        done = self.store.cancel(job_id, owner, self.clock()) if owner and model.is_job_id(job_id) else None
        if done is None:
            return missing(job_id)
        if done.action == "cancelled":
            return JSONResponse(self.public(done.job))
        shutil.rmtree(self.config.results / done.job.id, ignore_errors=True)
        return JSONResponse({"id": done.job.id, "object": "audio.job.deleted", "deleted": True})

    async def list(self, request: Request) -> Response:
        owner = self.owner_of(request)
        try:
            limit, after = page_query(request)
        except BadRequest as exc:
            return problem(exc.status, str(exc), param=exc.param)
        return await self.call(lambda: self._list(owner, limit, after))

    def _list(self, owner: str, limit: int | None, after: str | None) -> Response:
        if not owner:
            return JSONResponse(model.public_page(model.Page([], False)))
        try:
            page = self.store.list(owner, limit, after)
        except model.UnknownCursor as exc:
            raise BadRequest(str(exc), param="after") from None
        shown = model.public_page(model.Page([], page.has_more), self.config.max_age)
        shown["data"] = [self.public(job) for job in page.data]
        shown.update(first_id=page.data[0].id if page.data else None, last_id=page.data[-1].id if page.data else None)
        return JSONResponse(shown)


def missing(job_id: str) -> JSONResponse:
    shown = job_id if model.is_job_id(job_id) else "of that id"
    return problem(404, f"no job {shown}: list yours with GET {PREFIX}")


def page_query(request: Request) -> tuple[int | None, str | None]:
    unknown = sorted(set(request.query_params) - {"limit", "after"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s) {', '.join(unknown)}: {PREFIX} takes limit and after")
    raw = request.query_params.get("limit")
    limit = None
    if raw is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= model.MAX_LIMIT:
            raise BadRequest(f"limit: a whole number from 1 to {model.MAX_LIMIT}, not {raw[:20]!r}", param="limit")
        limit = int(raw)
    return limit, request.query_params.get("after") or None


def owner_by(policy: PolicyFile | None, clock: Callable[[], float] = time.time) -> Callable[[Request], str]:
    """A request's owner under the cluster's policy (one shared owner without one)."""
    if policy is None:
        return lambda request: SHARED_OWNER
    return lambda request: policy.current().owner(request.headers, clock())


def build_app(
    store: JobStore,
    config: Config,
    policy: PolicyFile | None = None,
    segments: Callable[[str, int], int] = count_segments,
    clock: Callable[[], float] = time.time,
    metrics: Callable[[], bytes] | None = None,
) -> ASGIApp:
    """The API over ``store``; behind the instances' gate when ``policy`` is given (the
    cluster needs credentials). ``metrics`` gives ``GET /metrics``'s body (Prometheus' text)."""
    jobs = Jobs(store, config, owner_by(policy, clock), segments, clock)
    routes = [
        Route(PREFIX, jobs.create, methods=["POST"]),
        Route(PREFIX, jobs.list, methods=["GET"]),
        Route(PREFIX + "/{job_id}", jobs.get, methods=["GET"]),
        Route(PREFIX + "/{job_id}", jobs.delete, methods=["DELETE"]),
        Route(PREFIX + "/{job_id}/content", jobs.content, methods=["GET", "HEAD"]),
    ]
    api: ASGIApp = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    api = Gate(api, policy, clock) if policy is not None else api
    api = admin_beside(api, Admin(jobs, policy))
    if metrics is None:
        return api
    return metrics_beside(api, metrics)


ADMIN_PREFIX = "/admin/jobs"
ADMIN_LIMIT = 200  # the panel's list: the newest this many, every owner's together


def owner_kind(owner: str) -> str:
    """What the panel shows of an owner: ``token``, ``user`` or ``local``, never who."""
    return owner.partition(":")[0] if ":" in owner else owner


def known_owners(policy: PolicyFile | None) -> list[str]:
    """Every owner a job can have under ``policy``: one per API token and per UI user, and
    the shared owner (jobs made while the service asked no credentials)."""
    if policy is None:
        return [SHARED_OWNER]
    current = policy.current()
    owners = {"token:" + token[:OWNER_HEX] for token in current.tokens}
    owners.update("user:" + user for user in current.users)
    return sorted(owners) + [SHARED_OWNER]


class Admin:
    """The control panel's view of the jobs: every owner's, the owner shown by its kind.
    The stores list one owner's jobs at a time, so this asks each owner the policy knows
    (a job whose token was removed since is no longer listed here; it still runs or expires)."""

    def __init__(self, jobs: Jobs, policy: PolicyFile | None):
        self.jobs, self.policy = jobs, policy

    def everyone(self, limit: int = ADMIN_LIMIT) -> list[tuple[str, model.Job]]:
        found: list[tuple[str, model.Job]] = []
        for owner in known_owners(self.policy):
            found.extend((owner, job) for job in self.jobs.store.list(owner, model.MAX_LIMIT).data)
        found.sort(key=lambda pair: model.newest_first(pair[1]), reverse=True)
        return found[:limit]

    def _list(self) -> Response:
        shown = []
        for owner, job in self.everyone():
            entry = self.jobs.public(job)
            entry["owner"] = owner_kind(owner)
            shown.append(entry)
        return JSONResponse({"object": "list", "data": shown}, headers={"Cache-Control": "no-store"})

    def _cancel(self, job_id: str) -> Response:
        owners = known_owners(self.policy) if model.is_job_id(job_id) else []
        held = next(((o, j) for o in owners if (j := self.jobs.store.get(job_id, o)) is not None), None)
        if held is None:
            return missing(job_id)
        owner, job = held
        if job.finished:  # (the store's cancel of a finished job removes it: not the panel's to do)
            return problem(409, f"job {job.id} is {job.status} already: only a queued or running job is cancelled")
        done = self.jobs.store.cancel(job.id, owner, self.jobs.clock())
        if done is None:
            return missing(job_id)
        return JSONResponse({**self.jobs.public(done.job), "owner": owner_kind(owner)})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        proxied = any(name == b"x-real-ip" for name, _ in scope.get("headers") or [])
        if proxied:  # (nginx sets it on everything it passes: whatever the path, not through it)
            answer: Response = problem(403, f"{ADMIN_PREFIX} is the control panel's, on the jobs socket only")
        elif path == ADMIN_PREFIX and method in ("GET", "HEAD"):
            answer = await self.jobs.call(self._list)
        elif path.startswith(ADMIN_PREFIX + "/") and method == "DELETE":
            job_id = path[len(ADMIN_PREFIX) + 1 :]
            answer = await self.jobs.call(lambda: self._cancel(job_id))
        else:
            answer = problem(405, f"{method} is not taken here: GET {ADMIN_PREFIX}, DELETE {ADMIN_PREFIX}/{{id}}")
        await answer(scope, receive, send)


def admin_beside(api: ASGIApp, admin: Admin) -> ASGIApp:
    """``/admin/jobs`` answered by ``admin`` (outside the gate: nginx never routes it to the
    socket), everything else by ``api``."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
            await admin(scope, receive, send)
            return
        await api(scope, receive, send)

    return app


def metrics_beside(api: ASGIApp, metrics: Callable[[], bytes]) -> ASGIApp:
    """``GET /metrics`` answered here (outside the gate: nginx never routes it to the
    socket), everything else by ``api``."""
    from prometheus_client import CONTENT_TYPE_LATEST

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") == "/metrics" and scope.get("method") in ("GET", "HEAD"):
            body = await asyncio.to_thread(metrics)
            answer = Response(body, media_type=CONTENT_TYPE_LATEST, headers={"Cache-Control": "no-store"})
            await answer(scope, receive, send)
            return
        await api(scope, receive, send)

    return app


async def not_found(request: Request, exc: Exception) -> Response:
    return problem(404, f"no such route: the jobs API is {PREFIX} and {PREFIX}/{{id}}[/content]")


async def not_allowed(request: Request, exc: Exception) -> Response:
    return problem(405, f"{request.method} is not taken here: POST or GET {PREFIX}, GET or DELETE {PREFIX}/{{id}}")
