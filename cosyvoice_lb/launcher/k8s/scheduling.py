"""Where the pods go: `k8s render`'s --node-selector, --toleration and --anti-affinity, read
(each refused with the fix when malformed) and turned into the pod spec's fields. Pure.

A toleration is written ``KEY[=VALUE][:EFFECT]``:

- ``nvidia.com/gpu:NoSchedule`` tolerates the taint ``nvidia.com/gpu`` with effect
  NoSchedule, whatever its value (operator Exists);
- ``dedicated=tts:NoSchedule`` tolerates only the value ``tts`` (operator Equal);
- without ``:EFFECT`` every effect of that taint is tolerated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cosyvoice_lb.launcher.k8s.monitoring import label_problem
from cosyvoice_lb.launcher.k8s.objects import Deployment, selector

EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
ANTI_AFFINITIES = ("preferred", "required")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
HOST = "kubernetes.io/hostname"
TOLERATION_SYNTAX = "KEY[=VALUE][:EFFECT], e.g. nvidia.com/gpu:NoSchedule or dedicated=tts:NoSchedule"


def parse_node_selector(given: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``--node-selector KEY=VALUE`` (repeatable) as (key, value) pairs in the order given; a
    ValueError with the fix for one that is not a Kubernetes label, or a key given twice."""
    found: dict[str, str] = {}
    for text in given:
        key, eq, value = (part.strip() for part in text.partition("="))
        example = "e.g. --node-selector nvidia.com/gpu.product=NVIDIA-A10"
        if not eq:
            raise ValueError(f"--node-selector {text!r} has no '=': give KEY=VALUE, {example}")
        problem = label_problem(key, value)
        if problem:
            raise ValueError(f"--node-selector {text!r}: {problem}; {example}")
        if found.get(key, value) != value:
            raise ValueError(f"--node-selector {key} is given twice ({found[key]!r} and {value!r}): give it once")
        found[key] = value
    return tuple(found.items())


def parse_toleration(text: str) -> dict[str, str]:
    """``KEY[=VALUE][:EFFECT]`` as a toleration object; a ValueError naming what is wrong."""
    spec, colon, effect = text.strip().partition(":")  # (neither a label's key nor its value holds ':')
    key, eq, value = (part.strip() for part in spec.partition("="))
    effect = effect.strip()
    if colon:
        matching = [e for e in EFFECTS if e.lower() == effect.lower()]
        if not matching:
            raise ValueError(
                f"--toleration {text!r}: the effect {effect!r} is none of {', '.join(EFFECTS)}; write {TOLERATION_SYNTAX}"
            )
        effect = matching[0]
    problem = label_problem(key, value) if key else "its key is empty"
    if not problem and eq and not value:
        problem = "it has '=' but no value (leave '=VALUE' out to tolerate every value)"
    if problem:
        raise ValueError(f"--toleration {text!r}: {problem}; write {TOLERATION_SYNTAX}")
    toleration = {"key": key, "operator": "Equal", "value": value} if eq else {"key": key, "operator": "Exists"}
    return {**toleration, "effect": effect} if effect else toleration


def parse_tolerations(given: Iterable[str]) -> tuple[dict[str, str], ...]:
    """Every ``--toleration``, in the order given, each once."""
    found: list[dict[str, str]] = []
    for text in given:
        toleration = parse_toleration(text)
        if toleration not in found:
            found.append(toleration)
    return tuple(found)


def affinity(deployment: Deployment) -> dict[str, Any]:
    """One pod per host: preferred (the scheduler may put two on one host when it must), or
    required (never two: a roll-out's extra pod then needs a host without one)."""
    term = {"topologyKey": HOST, "labelSelector": {"matchLabels": selector(deployment)}}
    if deployment.anti_affinity == "required":
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
        }
    }


def placement(deployment: Deployment) -> dict[str, Any]:
    """The pod spec's placement fields: the anti-affinity, and the node selector and the
    tolerations when any are given."""
    found: dict[str, Any] = {"affinity": affinity(deployment)}
    if deployment.node_selector:
        found["nodeSelector"] = dict(deployment.node_selector)
    if deployment.tolerations:
        found["tolerations"] = [dict(t) for t in deployment.tolerations]
    return found
