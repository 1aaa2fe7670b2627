"""Long-form jobs on Kubernetes. Every pod runs its own jobs process, with its store in its own
state dir: the pods share their jobs only when they share the store (--jobs-redis) and the
jobs' audio (--job-results, set here to a directory on the outputs volume every pod mounts).
The Redis URL may hold a password, so it reaches the pod from a Secret only: secret.yaml's
``jobs-redis`` key, or the Secret --jobs-redis-secret names. Pure: the option's reading, the
pod's two variables, and what `k8s render` says without a shared store.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import click

from cosyvoice_lb.common.settings import Settings, envvar
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.objects import JOBS_REDIS_KEY, OUTPUTS, Deployment, secret_name

# The jobs' audio with a shared store: on the outputs volume, beside the pods' dirs. A dot
# name: the outputs sweep takes every other directory there for a pod's (instance/audio/sweep.py).
SHARED_RESULTS = f"{OUTPUTS}/.jobs"
# A Secret's name is a DNS subdomain; a key letters, digits, '-', '_' and '.'.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_KEY = re.compile(r"[-._a-zA-Z0-9]+")
SECRET_EXAMPLE = f"e.g. --jobs-redis-secret redis-credentials:url (KEY defaults to {JOBS_REDIS_KEY})"

OPTION = click.option(
    "--jobs-redis-secret",
    default="",
    metavar="NAME[:KEY]",
    help=f"An existing Secret whose KEY (default {JOBS_REDIS_KEY}) holds the --jobs-redis URL: the pods read their "
    "jobs' store from it, and the URL is not written (nor needed here).",
)


def jobs_options(command: Callable) -> Callable:
    """`k8s render`'s --jobs-redis-secret."""
    return OPTION(command)


def parse_secret_ref(text: str) -> tuple[str, str]:
    """``NAME[:KEY]`` as (name, key); a ValueError with the fix for one Kubernetes would refuse."""
    name, colon, key = (part.strip() for part in text.partition(":"))
    if colon and not key:
        raise ValueError(f"--jobs-redis-secret {text!r} has an empty KEY after ':': give NAME[:KEY], {SECRET_EXAMPLE}")
    key = key or JOBS_REDIS_KEY
    if len(name) > 253 or not _NAME.fullmatch(name):
        raise ValueError(
            f"--jobs-redis-secret {text!r}: {name!r} is not a Secret's name (lower-case letters, digits, '-' "
            f"and '.', starting and ending with a letter or digit, at most 253); {SECRET_EXAMPLE}"
        )
    if len(key) > 253 or not _KEY.fullmatch(key):
        raise ValueError(
            f"--jobs-redis-secret {text!r}: {key!r} is not a Secret's key (letters, digits, '-', '_' and '.', "
            f"at most 253); {SECRET_EXAMPLE}"
        )
    return name, key


def jobs_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The Deployment's field of --jobs-redis-secret (taken out of ``values``); a ClusterError
    with the fix for a malformed one."""
    given = values.pop("jobs_redis_secret", "")
    try:
        return {"jobs_redis_secret": parse_secret_ref(given) if given else ()}
    except ValueError as exc:
        raise ClusterError(str(exc)) from None


def jobs_problem(settings: Settings, deployment: Deployment) -> str:
    """What is wrong with the jobs' options together ("" when nothing)."""
    if settings.jobs_redis and deployment.jobs_redis_secret:
        name, key = deployment.jobs_redis_secret
        return (
            f"--jobs-redis and --jobs-redis-secret {name}:{key} are both given: give one, the URL (written to "
            "secret.yaml) or the Secret that holds it (unset COSYVOICE_LB_JOBS_REDIS too)"
        )
    return ""


def redis_ref(settings: Settings, deployment: Deployment) -> tuple[str, str] | None:
    """The Secret and key the pods read the Redis URL from; None without a shared store."""
    if deployment.jobs_redis_secret:
        name, key = deployment.jobs_redis_secret
        return name, key
    if settings.jobs_redis:
        return secret_name(deployment), JOBS_REDIS_KEY
    return None


def written_url(settings: Settings, deployment: Deployment) -> str:
    """The URL secret.yaml holds ("" when none is, or the pods read it from another Secret)."""
    return "" if deployment.jobs_redis_secret else settings.jobs_redis


def jobs_env(settings: Settings, deployment: Deployment) -> list[dict[str, Any]]:
    """The pod's variables for a shared store: the URL from its Secret, the results on the
    shared volume; none without one."""
    ref = redis_ref(settings, deployment)
    if ref is None:
        return []
    name, key = ref
    return [
        {"name": envvar("jobs_redis"), "valueFrom": {"secretKeyRef": {"name": name, "key": key}}},
        {"name": envvar("job_results"), "value": SHARED_RESULTS},
    ]


def per_pod_warning(settings: Settings, deployment: Deployment) -> str:
    """What `k8s render` says when the pods share no jobs' store ("" when they do)."""
    if redis_ref(settings, deployment) is not None:
        return ""
    return (
        "warning: without --jobs-redis, long-form jobs (/v1/audio/jobs) live per pod: each pod keeps its own "
        "in its state dir, so a job is seen only by the pod that took it (asked through the Service, another "
        "pod answers 404) and goes with its pod. To share them, give the pods one Redis: --jobs-redis URL "
        "(best in COSYVOICE_LB_JOBS_REDIS; it is written to secret.yaml only), or --jobs-redis-secret "
        f"NAME[:KEY] for a Secret that holds it; their audio then goes to {SHARED_RESULTS} on the outputs volume."
    )
