"""Where everything of one cluster lives inside its state dir: path arithmetic only.

Every adapter (supervision, nginx, the health loop, the launcher) takes its paths from
here; nothing here reads or writes a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    """Where everything of one cluster lives inside its state dir (path arithmetic only)."""

    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def nginx_dir(self) -> Path:
        return self.root / "nginx"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def cluster_json(self) -> Path:
        return self.run / "cluster.json"

    @property
    def health_json(self) -> Path:
        return self.run / "health.json"

    @property
    def supervisord_conf(self) -> Path:
        return self.run / "supervisord.conf"

    @property
    def socket(self) -> Path:
        return self.run / "supervisor.sock"

    @property
    def supervisord_pid(self) -> Path:
        return self.run / "supervisord.pid"

    @property
    def nginx_conf(self) -> Path:
        return self.nginx_dir / "nginx.conf"

    @property
    def upstreams_conf(self) -> Path:
        return self.nginx_dir / "upstreams.conf"

    @property
    def nginx_pid(self) -> Path:
        return self.run / "nginx.pid"

    @property
    def nginx_tmp(self) -> Path:
        return self.nginx_dir / "tmp"

    @property
    def gradio_tmp(self) -> Path:
        return self.run / "gradio"

    def nginx_temp(self, kind: str) -> Path:
        return self.nginx_tmp / kind

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def instance_lib(self) -> Path:
        """The staged copy of app.py and the instance modules."""
        return self.run / "lib"

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    @property
    def voices(self) -> Path:
        """Saved voices (unless --voices-dir): kept across down/up."""
        return self.root / "voices"

    @property
    def segment_key(self) -> Path:
        """The key instances send with long texts' segments (0600), and nginx's map of it."""
        return self.run / "segment-key"

    @property
    def segment_key_conf(self) -> Path:
        return self.run / "segment-key.conf"

    @property
    def ledger(self) -> Path:
        """Marks of the syntheses running in every instance (poison requests, see ``poison``)."""
        return self.run / "ledger"

    @property
    def access_policy(self) -> Path:
        """Token digests, UI users and the session secret every instance reads (0600)."""
        return self.run / "access.json"

    @property
    def api_token(self) -> Path:
        """The API token `up` generates when the service is public and none was given (0600)."""
        return self.root / "api-token"

    @property
    def admin_token(self) -> Path:
        """The control panel's token `up` generates when no --admin-token-file is given (0600)."""
        return self.root / "admin-token"

    @property
    def admin_policy(self) -> Path:
        """The control panel's token digests and session secret (0600)."""
        return self.run / "admin.json"

    @property
    def metrics_policy(self) -> Path:
        """The digest of the scrape token, which reads the cluster's /metrics only (0600)."""
        return self.run / "metrics.json"

    @property
    def admin_socket(self) -> Path:
        """The control panel and the cluster's /metrics listen here; nginx is their only way in."""
        return self.run / "admin.sock"

    @property
    def monitoring(self) -> Path:
        """Prometheus scrape config, its file-SD targets, alert rules, the Grafana dashboard."""
        return self.root / "monitoring"

    @property
    def prometheus_yml(self) -> Path:
        return self.monitoring / "prometheus.yml"

    @property
    def scrape_targets(self) -> Path:
        """File service discovery: the instances' /metrics, rewritten at every render."""
        return self.monitoring / "targets.json"

    @property
    def alert_rules(self) -> Path:
        return self.monitoring / "alerts.yml"

    @property
    def alertmanager_yml(self) -> Path:
        """The config of the cluster's Alertmanager (--alertmanager): its receivers, no secret."""
        return self.monitoring / "alertmanager.yml"

    @property
    def alertmanager_data(self) -> Path:
        """Alertmanager's storage: silences and the notifications it sent."""
        return self.root / "alertmanager"

    @property
    def grafana_dashboard(self) -> Path:
        return self.monitoring / "grafana-dashboard.json"

    @property
    def scrape_token(self) -> Path:
        """The token Prometheus sends for the cluster's /metrics: it reads metrics, nothing else (0600)."""
        return self.monitoring / "scrape-token"

    def drained(self, name: str) -> Path:
        """An instance drained by hand: out of rotation, its process kept, until undrained."""
        return self.run / f"{name}.drained"

    @property
    def footprint_json(self) -> Path:
        return self.run / "footprint.json"

    def starts(self, name: str) -> Path:
        """A line per start of the instance (it appends one itself): restarts, crash loops."""
        return self.run / f"{name}.starts"

    def drain_request(self, name: str) -> Path:
        """The launcher asks the health loop for a drained stop of an instance with this file
        (see ``markers``)."""
        return self.run / f"{name}.restart"

    @property
    def routing_board(self) -> Path:
        """Where instances publish their load and the health loop the rotation (``board``)."""
        return self.run / "routing.board"

    @property
    def overflow_socket(self) -> Path:
        """nginx's last resort for a request every instance declined (``routing``)."""
        return self.run / "overflow.sock"

    @property
    def rollout(self) -> Path:
        """A surge roll-out under way (the launcher's): the health loop lets that many more
        instances into rotation, and scales nothing meanwhile."""
        return self.run / "rollout.json"

    @property
    def canary_json(self) -> Path:
        """A model roll-out under comparison (``canary``): its slots, settings and traffic."""
        return self.run / "canary.json"

    def mps_pipe(self, gpu: int | None) -> Path:
        """The CUDA MPS pipe dir of one GPU: its control daemon and the instances on it meet here."""
        return self.run / f"mps-gpu{gpu}"

    def mps_log(self, gpu: int | None) -> Path:
        return self.logs / f"mps-gpu{gpu}"

    def nginx_args(self) -> list[str]:
        """How nginx is pointed at this cluster's prefix, config and error log."""
        return ["-p", str(self.nginx_dir), "-c", str(self.nginx_conf), "-e", str(self.log("nginx-error"))]

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))


def layout_for(settings_or_dir: object) -> Layout:
    """The layout of a state dir, given as a path or as the settings that name it."""
    state_dir = getattr(settings_or_dir, "state_dir", settings_or_dir)
    return Layout(Path(str(state_dir)).expanduser().resolve())
