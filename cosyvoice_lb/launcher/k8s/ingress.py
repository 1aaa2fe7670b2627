"""The two ingress-nginx Ingresses `k8s render` writes: ``/`` (the UI, sticky by cookie) and
``/v1`` (the API, balanced request by request), on --ingress-host, and with --tls-secret
served over TLS with plain HTTP redirected to it. Pure builders, as in
:mod:`cosyvoice_lb.launcher.k8s.objects`.

Behind the controller, the pod's nginx sees the controller's pods as its clients; it takes
the client's address from their X-Forwarded-For (the pod's --trusted-proxies, by default
--pod-cidr: see :func:`cosyvoice_lb.launcher.k8s.pod.pod_settings`).
"""

from __future__ import annotations

from typing import Any

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.launcher.k8s.objects import Deployment, _meta

PREFIX = "nginx.ingress.kubernetes.io/"


def tls_problem(deployment: Deployment) -> str:
    """Why the TLS options cannot work ("" when they can): a certificate is for a host."""
    if deployment.tls_secret and not deployment.host:
        return (
            f"--tls-secret {deployment.tls_secret} needs --ingress-host: a certificate names the host it serves "
            "(give --ingress-host, e.g. tts.example.org, the host the Secret's certificate is for)"
        )
    return ""


def ingress_annotations(settings: Settings, deployment: Deployment) -> dict[str, str]:
    """The ingress-nginx annotations both Ingresses share: --max-body, an hour to stream, and
    with --tls-secret plain HTTP redirected to HTTPS (forced: also where the controller does
    not know TLS is served, e.g. behind a load balancer ending it)."""
    found = {
        PREFIX + "proxy-body-size": settings.max_body.replace("iB", ""),
        PREFIX + "proxy-read-timeout": "3600",
        PREFIX + "proxy-send-timeout": "3600",
    }
    if deployment.tls_secret:
        found.update({PREFIX + "ssl-redirect": "true", PREFIX + "force-ssl-redirect": "true"})
    return found


def ingress(deployment: Deployment, which: str, path: str, annotations: dict[str, str]) -> dict[str, Any]:
    """An ingress-nginx Ingress named ``<name>-<which>`` sending ``path`` to the Service, on
    --ingress-host when one is given, else on every host; with --tls-secret, over TLS with the
    Secret's certificate for that host."""
    rule: dict[str, Any] = {
        "http": {
            "paths": [
                {
                    "path": path,
                    "pathType": "Prefix",
                    "backend": {"service": {"name": deployment.name, "port": {"name": "http"}}},
                }
            ]
        }
    }
    if deployment.host:
        rule["host"] = deployment.host
    spec: dict[str, Any] = {"ingressClassName": "nginx", "rules": [rule]}
    if deployment.tls_secret:
        spec["tls"] = [{"hosts": [deployment.host], "secretName": deployment.tls_secret}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": _meta(deployment, f"{deployment.name}-{which}", annotations=annotations),
        "spec": spec,
    }


def ui_ingress(settings: Settings, deployment: Deployment) -> dict[str, Any]:
    """The UI's Ingress (``/``): Gradio's protocol takes several requests per call, so a
    browser sticks to one pod by cookie (sent over HTTPS only, with --tls-secret)."""
    sticky = {
        PREFIX + "affinity": "cookie",
        PREFIX + "session-cookie-name": "cvlb_pod",
        PREFIX + "session-cookie-samesite": "Lax",
    }
    if deployment.tls_secret:
        sticky[PREFIX + "session-cookie-secure"] = "true"
    return ingress(deployment, "ui", "/", {**ingress_annotations(settings, deployment), **sticky})


def api_ingress(settings: Settings, deployment: Deployment) -> dict[str, Any]:
    """The API's Ingress (``/v1``): balanced request by request (EWMA), no stickiness."""
    annotations = {**ingress_annotations(settings, deployment), PREFIX + "load-balance": "ewma"}
    return ingress(deployment, "api", "/v1", annotations)
