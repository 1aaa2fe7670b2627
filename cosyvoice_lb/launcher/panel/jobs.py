"""The control panel's jobs: every owner's long-form jobs, read from the jobs process's own
socket (``run/jobs.sock``, its ``/admin/jobs`` routes, which nginx never routes), and a
cancel. The panel shows an owner's kind only (``token``, ``user``, ``local``), never who.

Standard library only: one HTTP/1.1 request over the unix socket per call.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

ADMIN_JOBS = "/admin/jobs"
TIMEOUT = 5.0
# What the panel passes on of each job (the jobs process already leaves out owners and paths)
SHOWN = ("id", "status", "progress", "created_at", "started_at", "finished_at", "owner", "error", "bytes")


class JobsUnavailable(RuntimeError):
    """The jobs process did not answer (not running, starting, or no socket yet)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def call(path: Path, method: str, target: str, timeout: float = TIMEOUT) -> tuple[int, Any]:
    """(status, decoded JSON body) of one request to the jobs socket; JobsUnavailable when
    nothing answers there."""
    connection = _UnixConnection(str(path), timeout)
    try:
        connection.request(method, target, headers={"Accept": "application/json"})
        answer = connection.getresponse()
        body = answer.read()
    except (OSError, http.client.HTTPException) as exc:
        raise JobsUnavailable(
            f"the jobs process does not answer on {path.name} ({type(exc).__name__}): is it running? "
            "its log is logs/jobs.log"
        ) from None
    finally:
        connection.close()
    try:
        return answer.status, json.loads(body) if body else None
    except ValueError:
        return answer.status, None


def shown(job: dict[str, Any]) -> dict[str, Any]:
    """One job as the panel lists it."""
    entry = {name: job.get(name) for name in SHOWN}
    entry["error"] = (job.get("error") or {}).get("message")
    return entry


def list_jobs(path: Path, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
    status, body = call(path, "GET", ADMIN_JOBS, timeout)
    if status != 200 or not isinstance(body, dict):
        raise JobsUnavailable(message_of(body, status))
    return [shown(job) for job in body.get("data") or []]


def cancel_job(path: Path, job_id: str, timeout: float = TIMEOUT) -> tuple[int, Any]:
    """(status, body) of a cancel: 200 and the job, 404, or 409 for a finished job."""
    if not job_id.replace("_", "").replace("-", "").isalnum() or len(job_id) > 80:
        return 404, {"error": {"message": "no job of that id"}}
    status, body = call(path, "DELETE", f"{ADMIN_JOBS}/{job_id}", timeout)
    return status, (shown(body) if status == 200 and isinstance(body, dict) else body)


def message_of(body: Any, status: int) -> str:
    try:
        return str(body["error"]["message"])
    except (KeyError, TypeError):
        return f"the jobs process answered HTTP {status}"


# The panel's jobs page (/admin/jobs): the list, refreshed every 2 s, and a cancel per job.
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cosyvoice-lb jobs</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font-family: system-ui, sans-serif; margin: 1rem 1.5rem; color: #101828; }
 table { border-collapse: collapse; width: 100%; font-size: .9rem; }
 th, td { text-align: left; padding: .35rem .5rem; border-bottom: 1px solid #e4e7ec; white-space: nowrap; }
 th { color: #667085; } .err { color: #b42318; white-space: normal; } #note { color: #b42318; }
 .bar { display: inline-block; width: 6rem; height: .55rem; background: #e4e7ec; border-radius: 3px;
        vertical-align: middle; margin-right: .4rem; overflow: hidden; }
 .bar i { display: block; height: 100%; background: #2e90fa; }
</style></head><body>
<h1>Long-form jobs</h1><p><a href="/admin">control panel</a> · <span id="note"></span></p>
<table id="jobs"><thead><tr><th>id</th><th>status</th><th>progress</th><th>created</th><th>owner</th>
<th></th><th></th></tr></thead><tbody></tbody></table>
<script>
function cell(row, text, cls) { const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }
async function cancelJob(id) {
  if (!confirm(`Cancel ${id}?`)) return;
  const answer = await fetch(`/admin/api/jobs/${encodeURIComponent(id)}/cancel`,
                             {method: "POST", headers: {"X-Cvlb-Admin": "1"}, credentials: "same-origin"});
  if (!answer.ok) { const b = await answer.json().catch(() => ({})); alert((b.error && b.error.message) || answer.status); }
  refresh();
}
async function refresh() {
  const answer = await fetch("/admin/api/jobs", {credentials: "same-origin"});
  const body = await answer.json().catch(() => ({}));
  document.getElementById("note").textContent = answer.ok ? "" : ((body.error && body.error.message) || answer.status);
  if (!answer.ok) return;
  const rows = document.getElementById("jobs").tBodies[0];
  rows.replaceChildren();
  for (const job of body.data) {
    const row = rows.insertRow();
    cell(row, job.id); cell(row, job.status);
    const p = job.progress || {done: 0, total: 0}, share = p.total ? Math.round(100 * p.done / p.total) : 0;
    const td = cell(row, ` ${p.done}/${p.total}`), bar = document.createElement("span"), fill = document.createElement("i");
    bar.className = "bar"; fill.style.width = `${share}%`; bar.append(fill); td.prepend(bar);
    cell(row, new Date(job.created_at * 1000).toISOString().replace("T", " ").slice(0, 19));
    cell(row, job.owner); cell(row, job.error || "", "err");
    const actions = row.insertCell();
    if (job.status === "queued" || job.status === "running") {
      const button = document.createElement("button"); button.textContent = "cancel";
      button.onclick = () => cancelJob(job.id); actions.append(button);
    }
  }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
