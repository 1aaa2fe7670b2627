"""Config rendering (cosyvoice_lb/launcher/render/cluster.py): supervisord.conf, nginx.conf, upstreams.conf, cluster.json.

Pure tests render on a short made-up state dir (nothing is written); the tests that load the
files into supervisor's own parser or ``nginx -t`` write them into a short dir under /tmp
(pytest's tmp_path can be too long for the 107-byte unix socket limit that render checks).
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import requests
from conftest import free_port_block, http_server, port_free
from supervisor.datatypes import RestartUnconditionally, dict_of_key_value_pairs
from supervisor.options import ServerOptions

from cosyvoice_lb.common.settings import Settings
from cosyvoice_lb.common.sizes import GiB, MiB
from cosyvoice_lb.launcher.plan.planner import Budget, Gpu, Inventory, Roles, VllmShare, plan
from cosyvoice_lb.launcher.render.cluster import (
    MAX_SOCKET_PATH,
    Programs,
    RenderError,
    check,
    instance_env,
    render,
    render_upstreams,
)
from cosyvoice_lb.launcher.render.credentials import write_segment_key
from cosyvoice_lb.launcher.state import record
from cosyvoice_lb.launcher.state.layout import Layout

NGINX = shutil.which("nginx") or shutil.which("/usr/sbin/nginx")
SHORT = Path("/tmp/cvlb-t")  # never created: pure renders only
PROGRAMS = Programs(app="/x/app.py", launcher_python=sys.executable, nginx="/usr/sbin/nginx", run_as_user="")
EXPECTED_FILES = {
    "run/supervisord.conf",
    "nginx/nginx.conf",
    "nginx/upstreams.conf",
    "run/cluster.json",
    "monitoring/prometheus.yml",
    "monitoring/targets.json",
    "monitoring/alerts.yml",
    "monitoring/grafana-dashboard.json",
}
NGINX_TEMPS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def gpu_plan(instances: int | None = 3, base_port: int = 7860):
    """Two 12 GiB cards, 5 GiB per instance: room for 2 + 2; three slots on gpu 0, 1, 0."""
    inventory = Inventory(
        gpus=(Gpu(0, 12 * GiB, 12 * GiB), Gpu(1, 12 * GiB, 12 * GiB)),
        cpu_cores=8,
        ram_total=64 * GiB,
        ram_available=64 * GiB,
    )
    return plan(inventory, Budget(5 * GiB, 512 * MiB), instances=instances, base_port=base_port)


def cpu_plan(instances: int = 2):
    inventory = Inventory(gpus=(), cpu_cores=4, ram_total=16 * GiB, ram_available=16 * GiB, source="none")
    return plan(inventory, Budget(5 * GiB, 512 * MiB), instances=instances)


PLANS = {"gpu": gpu_plan, "cpu": cpu_plan}


def rendered(
    root: Path = SHORT, settings: Settings | None = None, the_plan=None, programs: Programs = PROGRAMS
) -> dict[str, str]:
    return render(settings or Settings(), the_plan or gpu_plan(), Layout(root), programs)


def supervisor_sections(text: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=True)  # strict: duplicate sections/keys fail
    parser.read_string(text)
    return parser


# --- a small nginx config reader: directives, arguments (unquoted) and blocks ---------------

_TOKEN = re.compile(r"""\s+|#[^\n]*|"((?:\\.|[^"\\])*)"|'((?:\\.|[^'\\])*)'|([{};])|([^\s{};"']+)""")


@dataclass
class Directive:
    name: str
    args: list[str]
    block: list[Directive] | None = None

    def all(self, name: str, *args: str) -> list[Directive]:
        """Directives of this block called ``name`` whose arguments start with ``args``."""
        return [d for d in self.block or [] if d.name == name and d.args[: len(args)] == list(args)]

    def one(self, name: str, *args: str) -> Directive:
        found = self.all(name, *args)
        assert len(found) == 1, f"expected one {name} {args}, found {len(found)}"
        return found[0]

    def values(self, name: str) -> list[list[str]]:
        return [d.args for d in self.all(name)]


def parse_nginx(text: str) -> Directive:
    root = Directive("main", [], [])
    stack = [root]
    words: list[str] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        assert match, f"cannot tokenize nginx config at {text[pos : pos + 40]!r}"
        pos = match.end()
        double, single, punct, word = match.groups()
        if double is not None or single is not None:
            words.append(re.sub(r"\\(.)", r"\1", double if double is not None else single))
        elif word is not None:
            words.append(word)
        elif punct == ";":
            stack[-1].block.append(Directive(words[0], words[1:]))
            words = []
        elif punct == "{":
            directive = Directive(words[0], words[1:], [])
            stack[-1].block.append(directive)
            stack.append(directive)
            words = []
        elif punct == "}":
            assert not words, f"unterminated directive {words}"
            stack.pop()
    assert len(stack) == 1 and not words, "unbalanced braces"
    return root


def public_server(http: Directive) -> Directive:
    """The cluster's listener (not the last resort on its unix socket)."""
    found = [d for d in http.all("server") if not d.values("listen")[0][0].startswith("unix:")]
    assert len(found) == 1, f"expected one public server, found {len(found)}"
    return found[0]


def upstream_servers(upstreams: Directive, name: str) -> dict[int, list[str]]:
    """{port: server flags} of one upstream block's instances (not its last resort)."""
    servers = {}
    for args in upstreams.one("upstream", name).values("server"):
        if "backup" in args:
            continue
        host, port = args[0].rsplit(":", 1)
        assert host == "127.0.0.1"
        servers[int(port)] = args[1:]
    return servers


# --- files and supervisord.conf -------------------------------------------------------------


def test_render_returns_the_four_files_and_writes_nothing(tmp_path):
    files = rendered(tmp_path / "state")
    assert set(files) == EXPECTED_FILES
    assert all(isinstance(text, str) and text.endswith("\n") for text in files.values())
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_supervisord_conf_has_one_program_per_slot(kind):
    the_plan = PLANS[kind]()
    settings = Settings(python="/venv/bin/python", max_chars=321, drain_timeout=12.5, start_retries=7)
    conf = supervisor_sections(rendered(settings=settings, the_plan=the_plan)["run/supervisord.conf"])
    programs = sorted(s for s in conf.sections() if s.startswith("program:"))
    assert programs == sorted(
        [f"program:{s.name}" for s in the_plan.slots]
        + ["program:nginx", "program:health", "program:admin", "program:jobs"]
    )
    admin = shlex.split(conf["program:admin"]["command"])
    assert admin[1:] == ["-m", "cosyvoice_lb.launcher.panel.server", "--state-dir", str(SHORT)]
    # (stopped before the instances: a panel action never restarts one while the cluster goes down)
    assert int(conf["program:admin"]["priority"]) > int(conf[f"program:{the_plan.slots[0].name}"]["priority"])
    for slot in the_plan.slots:
        section = conf[f"program:{slot.name}"]
        argv = shlex.split(section["command"])
        assert argv[:2] == ["/venv/bin/python", "/x/app.py"]
        assert argv[argv.index("--port") + 1] == str(slot.port)
        assert argv[argv.index("--max-chars") + 1] == "321"
        assert argv[argv.index("--drain-timeout") + 1] == "12.5"
        assert argv[argv.index("--starts-file") + 1] == f"{SHORT}/run/{slot.name}.starts"
        env = dict_of_key_value_pairs(section["environment"])
        assert env["CUDA_VISIBLE_DEVICES"] == ("" if slot.gpu is None else str(slot.gpu))
        assert env["GRADIO_TEMP_DIR"] == f"{SHORT}/run/gradio/{slot.name}"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert section["autorestart"] == "true"
        # the launcher starts them (those that serve, the spares); the rest stay parked
        assert section["autostart"] == "false"
        assert section["startretries"] == "7"
        assert section["stopwaitsecs"] == "17"  # drain_timeout + 5
        assert section["stdout_logfile"] == f"{SHORT}/logs/{slot.name}.log"
        assert section["directory"] == str(SHORT)
    if kind == "gpu":
        cuda = [
            dict_of_key_value_pairs(conf[f"program:{s.name}"]["environment"])["CUDA_VISIBLE_DEVICES"]
            for s in the_plan.slots
        ]
        assert cuda == ["0", "1", "0"]


@pytest.mark.parametrize(
    "engine, flags",
    [
        (
            "simulated",
            ["--simulated-ms-per-char", "2.5", "--simulated-base-ms", "30.0", "--simulated-load-seconds", "20.0"],
        ),
        ("espeak", []),
    ],
)
def test_the_simulated_engine_gets_its_service_time_and_nothing_else_does(engine, flags):
    settings = Settings(
        engine=engine,
        simulated_ms_per_char=2.5,
        simulated_base_ms=30.0,
        simulated_load_seconds=20.0,
        request_timeout=42.0,
    )
    conf = supervisor_sections(rendered(settings=settings)["run/supervisord.conf"])
    argv = shlex.split(conf["program:instance-0"]["command"])
    assert argv[argv.index("--engine") + 1] == engine
    assert argv[argv.index("--request-timeout") + 1] == "42.0"
    simulated = [a for i, a in enumerate(argv) if a.startswith("--simulated") or argv[i - 1].startswith("--simulated")]
    assert simulated == flags


def test_supervisord_conf_nginx_and_health_programs():
    conf = supervisor_sections(rendered()["run/supervisord.conf"])
    assert shlex.split(conf["program:nginx"]["command"]) == [
        # (a stale socket of a killed nginx goes first: nginx cannot bind one that exists)
        "/bin/sh",
        "-c",
        'rm -f -- "$0" && exec "$@"',
        f"{SHORT}/run/overflow.sock",
        "/usr/sbin/nginx",
        "-p",
        f"{SHORT}/nginx",
        "-c",
        f"{SHORT}/nginx/nginx.conf",
        "-e",
        f"{SHORT}/logs/nginx-error.log",
    ]
    assert conf["program:nginx"]["stopsignal"] == "QUIT"  # graceful
    assert shlex.split(conf["program:health"]["command"]) == [
        sys.executable,
        "-m",
        "cosyvoice_lb.launcher.health.loop",
        "--state-dir",
        str(SHORT),
    ]
    for name in ("nginx", "health"):
        assert conf[f"program:{name}"]["autorestart"] == "true"
    assert conf["unix_http_server"]["file"] == f"{SHORT}/run/supervisor.sock"
    assert conf["unix_http_server"]["chmod"] == "0700"
    assert conf["supervisorctl"]["serverurl"] == f"unix://{SHORT}/run/supervisor.sock"
    assert conf["supervisord"]["pidfile"] == f"{SHORT}/run/supervisord.pid"


def test_priorities_stop_health_first_then_instances_then_nginx():
    # supervisord stops programs in descending priority order: the health loop must not
    # restart what is being stopped, and nginx stays until the instances have drained.
    conf = supervisor_sections(rendered()["run/supervisord.conf"])
    instances = {int(conf[s]["priority"]) for s in conf.sections() if s.startswith("program:instance-")}
    nginx, health = int(conf["program:nginx"]["priority"]), int(conf["program:health"]["priority"])
    assert health > max(instances) and min(instances) > nginx


@pytest.fixture
def state_dir(request):
    """A short real state dir under /tmp (``request.param``: a name prefix), with its subdirs."""
    root = Path(tempfile.mkdtemp(prefix=getattr(request, "param", "cvlb-"), dir="/tmp"))
    layout = Layout(root)
    for path in [layout.logs, layout.run, *(layout.nginx_temp(kind) for kind in NGINX_TEMPS)]:
        path.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


def load_in_supervisor(path: Path) -> ServerOptions:
    options = ServerOptions()
    options.configfile = str(path)
    options.process_config(do_usage=False)  # raises ValueError on a config supervisord refuses
    return options


@pytest.mark.parametrize(
    "state_dir",
    [
        "cvlb-",
        "cvlb sp-",
    ],
    indirect=True,
)
def test_supervisord_conf_loads_in_supervisor(state_dir):
    the_plan = gpu_plan()
    files = rendered(state_dir, the_plan=the_plan)
    write(state_dir, files)
    options = load_in_supervisor(Layout(state_dir).supervisord_conf)
    section = options.configroot.supervisord
    programs = {p.name: p for group in options.process_group_configs for p in group.process_configs}
    assert set(programs) == {s.name for s in the_plan.slots} | {"nginx", "health", "admin", "jobs"}
    for slot in the_plan.slots:
        program = programs[slot.name]
        assert program.environment["CUDA_VISIBLE_DEVICES"] == str(slot.gpu)
        assert program.autorestart is RestartUnconditionally
        assert program.stdout_logfile == str(state_dir / "logs" / f"{slot.name}.log")
        assert program.directory == str(state_dir)
        argv = shlex.split(program.command)
        assert argv[argv.index("--port") + 1] == str(slot.port)
        assert argv[argv.index("--starts-file") + 1] == str(state_dir / "run" / f"{slot.name}.starts")
    assert programs["health"].priority > programs["instance-0"].priority > programs["nginx"].priority
    assert shlex.split(programs["health"].command)[-1] == str(state_dir)
    (server,) = section.server_configs
    assert server["file"] == str(state_dir / "run" / "supervisor.sock")
    assert server["chmod"] == 0o700
    assert section.logfile == str(state_dir / "logs" / "supervisord.log")
    assert section.directory == str(state_dir)


def test_percent_in_the_state_dir_is_refused():
    # supervisord expands some paths twice, so no escape of '%' works everywhere.
    with pytest.raises(RenderError, match="contains '%'"):
        rendered(Path("/tmp/cv%lb"))


def test_percent_in_paths_is_escaped_for_supervisor():
    root = Path("/tmp/cvlb")
    programs = Programs(app="/x/100%/app.py", launcher_python="/py%/python", nginx="/ng%/nginx")
    text = rendered(root, settings=Settings(python="/venv%/python"), programs=programs)["run/supervisord.conf"]
    assert "%" not in text.replace("%%", "")  # every '%' doubled
    conf = supervisor_sections(text)
    unescape = lambda value: value.replace("%%", "%")  # noqa: E731 - what supervisor's expansion does
    argv = shlex.split(unescape(conf["program:instance-0"]["command"]))
    assert argv[:2] == ["/venv%/python", "/x/100%/app.py"]
    assert argv[argv.index("--starts-file") + 1] == "/tmp/cvlb/run/instance-0.starts"
    assert shlex.split(unescape(conf["program:health"]["command"]))[0] == "/py%/python"
    nginx = shlex.split(unescape(conf["program:nginx"]["command"]))
    # (a shell that clears the last resort's socket, then becomes nginx)
    assert nginx[:4] == ["/bin/sh", "-c", 'rm -f -- "$0" && exec "$@"', "/tmp/cvlb/run/overflow.sock"]
    assert nginx[4] == "/ng%/nginx"


# --- nginx.conf and upstreams.conf ----------------------------------------------------------


def test_nginx_conf_balancing_and_proxy_settings():
    settings = Settings(host="127.0.0.1", port=9090, retries=4, hang_timeout=60, probe_timeout=1.5)
    files = rendered(settings=settings)
    conf = parse_nginx(files["nginx/nginx.conf"])
    upstreams = parse_nginx(files["nginx/upstreams.conf"])
    http = conf.one("http")
    assert sorted(http.values("include")) == [[f"{SHORT}/nginx/upstreams.conf"], [f"{SHORT}/run/segment-key.conf"]]

    api, ui = upstreams.one("upstream", "cvlb_api"), upstreams.one("upstream", "cvlb_ui")
    assert api.values("least_conn") == [[]]
    assert ui.values("hash") == [["$cvlb_route_key", "consistent"]]
    assert http.one("map", "$cookie_cvlb_route", "$cvlb_route_key")  # the key comes from the cookie

    server = public_server(http)
    assert server.values("listen") == [["127.0.0.1:9090", "reuseport"]]  # (a restarted master binds beside orphans)
    headers = server.values("proxy_set_header")
    for header in (
        ["Upgrade", "$http_upgrade"],
        ["Connection", "$connection_upgrade"],
        ["X-Forwarded-Host", "$http_host"],
        ["X-Forwarded-Proto", "$cvlb_forwarded_proto"],
        ["X-Forwarded-For", "$proxy_add_x_forwarded_for"],
        ["Host", "$cvlb_host"],
    ):
        assert header in headers
    # (an HTTP/1.0 request without Host still sends the instance one: HTTP/1.1 needs it)
    host = http.one("map", "$http_host", "$cvlb_host")
    assert host.values("") == [["$server_addr:$server_port"]] and host.values("default") == [["$http_host"]]
    assert server.values("proxy_http_version") == [["1.1"]]
    assert server.values("proxy_next_upstream_tries") == [["4"]]

    v1 = server.one("location", "/v1/")
    assert v1.values("proxy_pass") == [["http://$cvlb_api_pool"]]
    # a long text's segments (known by the segment key) are balanced among themselves, and
    # only they reach an instance with the segment headers
    pool = http.one("map", "$cvlb_segment_ok", "$cvlb_api_pool")
    assert pool.values("default") == [["cvlb_api"]] and pool.values("1") == [["cvlb_segments"]]
    passed = http.one("map", "$cvlb_segment_ok", "$cvlb_segment")
    assert passed.values("default") == [[""]] and passed.values("1") == [["$http_x_cvlb_segment"]]
    assert ["X-Cvlb-Segment", "$cvlb_segment"] in headers and ["X-Cvlb-Segment-Key", ""] in headers
    assert upstreams.one("upstream", "cvlb_segments").values("least_conn") == [[]]
    assert v1.values("proxy_buffering") == [["off"]]
    # --request-timeout 90: the instance answers 504 itself; nginx's read timeout is the backstop,
    # and no retry starts once the request's time is spent
    assert v1.values("proxy_read_timeout") == [["95s"]]
    assert v1.values("proxy_next_upstream_timeout") == [["90s"]]
    assert v1.values("keepalive_timeout") == [["0"]]  # no idle connection for a reload to cut
    assert ["X-Request-Start", "$msec"] in headers  # server level: the locations inherit every header
    assert all(not loc.values("proxy_set_header") for loc in server.all("location"))
    ui_location = server.one("location", "/")
    assert ui_location.values("proxy_pass") == [["http://cvlb_ui"]]
    assert ui_location.values("proxy_buffering") == [["off"]]
    assert ["Set-Cookie", "$cvlb_set_cookie"] in ui_location.values("add_header")
    ping = server.one("location", "=", "/ping")
    assert ping.values("proxy_pass") == [["http://cvlb_instances$cvlb_ping_uri"]]
    assert ping.values("proxy_read_timeout") == [["1000ms"]]  # min(probe timeout, 1 s): quick for monitors


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_every_slot_is_a_server_with_passive_failure_marking_off(kind):
    the_plan = PLANS[kind]()
    upstreams = parse_nginx(rendered(the_plan=the_plan)["nginx/upstreams.conf"])
    for name in ("cvlb_api", "cvlb_ui", "cvlb_segments"):
        servers = upstream_servers(upstreams, name)
        assert list(servers) == [s.port for s in the_plan.slots]
        assert all(flags == ["max_fails=0"] for flags in servers.values())


@pytest.mark.parametrize(
    "out",
    [set(), {"instance-1"}, {"instance-0", "instance-2"}, {"instance-0", "instance-1", "instance-2"}, {"instance-9"}],
)
def test_render_upstreams_marks_exactly_the_out_of_rotation_servers_down(out):
    slots = gpu_plan().slots
    upstreams = parse_nginx(render_upstreams(slots, frozenset(out)))
    port_of = {s.name: s.port for s in slots}
    for name in ("cvlb_api", "cvlb_ui", "cvlb_segments"):
        servers = upstream_servers(upstreams, name)
        assert {port for port, flags in servers.items() if "down" in flags} == {port_of[n] for n in out if n in port_of}
        assert all("max_fails=0" in flags for flags in servers.values())


def test_render_upstreams_default_is_all_in_rotation():
    assert " down" not in render_upstreams(gpu_plan().slots)
    overflow = str(Layout(SHORT).overflow_socket)  # (--routing work, the default)
    assert render_upstreams(gpu_plan().slots, overflow=overflow) == rendered()["nginx/upstreams.conf"]


def test_paths_with_spaces_are_quoted_in_nginx_conf():
    root = Path('/tmp/cv lb "x"')
    text = rendered(root)["nginx/nginx.conf"]
    assert 'include "/tmp/cv lb \\"x\\"/nginx/upstreams.conf";' in text
    http = parse_nginx(text).one("http")
    assert sorted(http.values("include")) == [[f"{root}/nginx/upstreams.conf"], [f"{root}/run/segment-key.conf"]]
    assert http.one("proxy_temp_path").args == [f"{root}/nginx/tmp/proxy"]
    assert http.one("access_log").args == [f"{root}/logs/nginx-access.log", "cvlb"]
    assert parse_nginx(text).one("pid").args == [f"{root}/run/nginx.pid"]


def test_plain_paths_are_not_quoted_in_nginx_conf():
    assert f"include {SHORT}/nginx/upstreams.conf;" in rendered()["nginx/nginx.conf"]


@pytest.mark.parametrize("user", ["", "cvlb"])
def test_nginx_user_only_when_given(user):
    programs = Programs(app="/x/app.py", launcher_python=sys.executable, nginx="/usr/sbin/nginx", run_as_user=user)
    conf = parse_nginx(rendered(programs=programs)["nginx/nginx.conf"])
    assert conf.values("user") == ([[user]] if user else [])
    assert conf.values("worker_processes") == [["2"]]


# --- check(): settings that cannot work -----------------------------------------------------


def long_root(socket_length: int) -> Path:
    """A root whose socket path (root + '/run/supervisor.sock') is ``socket_length`` bytes."""
    return Path("/" + "a" * (socket_length - len("/run/supervisor.sock") - 1))


def test_socket_path_limit_boundary():
    assert len(str(Layout(long_root(MAX_SOCKET_PATH)).socket)) == MAX_SOCKET_PATH == 107
    check(Settings(), Layout(long_root(107)))  # fits exactly
    with pytest.raises(RenderError, match="too long for a unix socket \\(108 > 107"):
        check(Settings(), Layout(long_root(108)))


def test_socket_path_limit_counts_bytes():
    root = Path("/" + "é" * 86)  # socket path: 107 characters, 193 bytes
    try:
        check(Settings(), Layout(root))
    except RenderError:
        return  # refused: right
    import socket

    with socket.socket(socket.AF_UNIX) as sock:  # accepted: then the kernel must take the path
        sock.bind(str(Layout(root).socket))


@pytest.mark.parametrize(
    "root, settings, match",
    [
        (Path("relative/state"), Settings(), "state dir must be an absolute path"),
        (Path("."), Settings(), "state dir must be an absolute path"),
        (long_root(108), Settings(), "use a shorter --state-dir"),
        (SHORT, Settings(port=0), "--port 0 is not a TCP port"),
        (SHORT, Settings(port=65536), "--port 65536 is not a TCP port"),
        (SHORT, Settings(probe_interval=0), "--probe-interval must be above 0"),
        (SHORT, Settings(probe_timeout=0), "--probe-timeout must be above 0"),
        (SHORT, Settings(hang_timeout=0), "--hang-timeout must be above 0"),
        (SHORT, Settings(hang_timeout=-5), "--hang-timeout must be above 0"),
        (SHORT, Settings(startup_timeout=0), "--startup-timeout must be above 0"),
        (SHORT, Settings(drain_timeout=-1), "--drain-timeout cannot be negative"),
        (SHORT, Settings(start_retries=-1), "--start-retries must be at least 0"),
        (SHORT, Settings(fail_threshold=0), "--fail-threshold must be at least 1"),
        (SHORT, Settings(recover_threshold=0), "--recover-threshold must be at least 1"),
        (SHORT, Settings(retries=0), "--retries must be at least 1"),
        (SHORT, Settings(max_chars=0), "--max-chars must be at least 1"),
    ],
)
def test_check_refuses_settings_that_cannot_work(root, settings, match):
    with pytest.raises(RenderError, match=match):
        check(settings, Layout(root))
    with pytest.raises(RenderError, match=match):  # render checks first
        render(settings, gpu_plan(), Layout(root), PROGRAMS)


@pytest.mark.parametrize("port", [7860, 7861, 7862])
def test_public_port_colliding_with_an_instance_port_is_refused(port):
    with pytest.raises(RenderError, match=f"public port {port} collides with an instance port \\(7860..7862\\)"):
        rendered(settings=Settings(port=port))


@pytest.mark.parametrize("port", [7859, 7863, 8080])
def test_public_port_next_to_the_instance_ports_is_fine(port):
    assert set(rendered(settings=Settings(port=port))) == EXPECTED_FILES


def test_render_error_is_a_value_error():
    assert issubclass(RenderError, ValueError)


# --- cluster.json ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_cluster_json_round_trips_settings_and_slots(kind):
    the_plan = PLANS[kind]()
    settings = Settings(
        port=9000,
        host="127.0.0.1",
        gpus="12GiB,12GiB",
        reserve="2GiB",
        max_instances=3,
        force=True,
        fail_threshold=5,
        recover_threshold=4,
        hang_timeout=60.5,
        probe_timeout=0.75,
        state_dir="/srv/cvlb",
        python="/venv/bin/python",
    )
    text = rendered(settings=settings, the_plan=the_plan)["run/cluster.json"]
    found = record.parse(text)
    assert (found.settings, found.slots, found.version) == (settings, the_plan.slots, record.VERSION)
    data = json.loads(text)
    assert data["plan"]["mode"] == the_plan.mode
    assert [s["port"] for s in data["plan"]["slots"]] == [s.port for s in the_plan.slots]
    # nothing that changes between two renders of the same cluster (free memory, notes)
    assert set(data["plan"]) == {"mode", "slots", "pool"}
    assert found.roles == the_plan.roles
    assert data["settings"]["port"] == 9000


def test_read_cluster_json_ignores_unknown_settings():
    text = rendered()["run/cluster.json"]
    data = json.loads(text)
    data["settings"]["from_a_newer_version"] = 1
    found = record.parse(json.dumps(data))
    assert found.settings == Settings() and found.slots == gpu_plan().slots


def test_a_record_of_0_1_reads_as_version_0_and_one_before_pools_serves_every_slot():
    data = json.loads(rendered()["run/cluster.json"])
    del data["version"]
    old = record.parse(json.dumps(data))
    assert old.version == 0 and old.roles == gpu_plan().roles
    del data["plan"]["pool"]
    assert record.parse(json.dumps(data)).roles == Roles(serving=len(gpu_plan().slots))


def test_the_record_keeps_each_slots_concurrency_and_vllm_share():
    # (what a re-render from the record, e.g. a roll-out's, gives each instance)
    cards = Inventory(gpus=(Gpu(0, 80 * GiB, 80 * GiB),), cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB)
    the_plan = plan(cards, Budget(5 * GiB, 512 * MiB, concurrency=4, vllm=VllmShare(given=0.25)))
    text = record.dump(Settings(engine="cosyvoice3", model_dir="/m", load_vllm=True), the_plan)
    assert record.parse(text).slots == the_plan.slots
    assert {(s.concurrency, s.vllm_memory) for s in the_plan.slots} == {(4, 0.25)}
    data = json.loads(text)
    for slot in data["plan"]["slots"]:  # a record written before concurrency was planned
        del slot["concurrency"], slot["vllm_memory"]
    assert {(s.concurrency, s.vllm_memory) for s in record.parse(json.dumps(data)).slots} == {(1, 0.0)}


# --- the real nginx accepts what we render --------------------------------------------------


def nginx_test(root: Path) -> subprocess.CompletedProcess:
    layout = Layout(root)
    return subprocess.run(
        [NGINX, "-t", "-p", str(layout.nginx_dir), "-c", str(layout.nginx_conf), "-e", str(layout.log("nginx-error"))],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed")
@pytest.mark.parametrize("state_dir", ["cvlb-", "cvlb sp-"], indirect=True)
@pytest.mark.parametrize("kind", sorted(PLANS))
def test_nginx_accepts_the_rendered_config(state_dir, kind):
    the_plan = PLANS[kind]()
    write(state_dir, rendered(state_dir, the_plan=the_plan))
    write_segment_key(Layout(state_dir))  # (written beside the configs: it holds a secret)
    done = nginx_test(state_dir)
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr

    # The health loop may take every instance out of rotation: nginx must still load it.
    everyone = frozenset(s.name for s in the_plan.slots)
    overflow = str(Layout(state_dir).overflow_socket)
    Layout(state_dir).upstreams_conf.write_text(render_upstreams(the_plan.slots, everyone, overflow))
    assert Layout(state_dir).upstreams_conf.read_text().count(" down;") == 4 * len(the_plan.slots)
    done = nginx_test(state_dir)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed")
def test_nginx_test_catches_a_broken_config(state_dir):
    # The check above can fail: a broken upstreams.conf is refused.
    write(state_dir, rendered(state_dir))
    Layout(state_dir).upstreams_conf.write_text("upstream cvlb_api {\n")
    assert nginx_test(state_dir).returncode != 0


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed")
def test_ipv6_host_renders_a_listen_nginx_accepts(state_dir):
    try:
        files = rendered(state_dir, settings=Settings(host="::"))
    except RenderError:
        return  # refused up front: acceptable too
    write(state_dir, files)
    write_segment_key(Layout(state_dir))
    done = nginx_test(state_dir)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("hang, request_timeout, warned", [(60.0, 90.0, False), (90.0, 90.0, True), (30.0, 3.0, True)])
def test_a_hang_timeout_not_below_the_request_timeout_is_warned_about(hang, request_timeout, warned):
    from cosyvoice_lb.launcher.render.cluster import warnings

    found = warnings(Settings(hang_timeout=hang, request_timeout=request_timeout))
    assert bool(found) is warned
    if warned:
        assert "a 504 at the bound instead of a retry" in found[0]


def test_a_fractional_request_timeout_is_rounded_up_not_to_zero():
    conf = parse_nginx(rendered(settings=Settings(request_timeout=0.5))["nginx/nginx.conf"])
    v1 = public_server(conf.one("http")).one("location", "/v1/")
    assert v1.values("proxy_next_upstream_timeout") == [["1s"]]  # 0s would mean no bound at all
    assert v1.values("proxy_read_timeout") == [["6s"]]


# --- exposure, credentials and limits -------------------------------------------------------

SECURITY = [
    ["X-Content-Type-Options", "nosniff", "always"],
    ["X-Frame-Options", "SAMEORIGIN", "always"],
    ["Referrer-Policy", "same-origin", "always"],
]


def nginx_server(settings: Settings) -> tuple[Directive, Directive]:
    http = parse_nginx(rendered(settings=settings)["nginx/nginx.conf"]).one("http")
    return http, public_server(http)


@pytest.mark.parametrize(
    "settings,listen",
    [
        (Settings(), "127.0.0.1:8080"),
        (Settings(public=True), "0.0.0.0:8080"),
        (Settings(host="::"), "[::]:8080"),
    ],
)
def test_nginx_listens_on_loopback_unless_public(settings, listen):
    assert nginx_server(settings)[1].values("listen") == [[listen, "reuseport"]]


def test_security_headers_reach_every_answer_even_in_locations_with_headers_of_their_own():
    _, server = nginx_server(Settings(rate_limit="10r/s", public=True))
    for block in [server] + [loc for loc in server.all("location") if loc.values("add_header")]:
        for header in SECURITY:
            assert header in block.values("add_header"), (block.args, header)


def test_public_ping_gets_the_brief_answer_and_loopback_the_details():
    http, server = nginx_server(Settings(public=True))
    ping_map = http.one("map", "$remote_addr", "$cvlb_ping_uri")
    assert ping_map.values("127.0.0.1") == [["/ping"]] and ping_map.values("::1") == [["/ping"]]
    assert ping_map.values("default") == [["/ping/brief"]]


def test_no_rate_limit_unless_asked():
    http, server = nginx_server(Settings())
    # (only the logins' zone: password guessing at the panel's /admin/login)
    assert http.values("limit_req_zone") == [
        ["$binary_remote_addr", "zone=cvlb_login:1m", "rate=10r/m"],
        ["$binary_remote_addr", "zone=cvlb_admin:1m", "rate=20r/s"],
    ]
    assert not server.one("location", "/v1/").values("limit_req")


@pytest.mark.parametrize("auth", [False, True])
def test_rate_limit_on_what_synthesizes_with_json_429(auth):
    http, server = nginx_server(Settings(rate_limit="10r/s", rate_burst=5, public=auth))
    # a long text's segments (known by the segment key) are not counted again: an empty key
    (segments,) = http.all("map", "$cvlb_segment_ok", "$cvlb_client")
    assert segments.values("1") == [[""]]
    if auth:  # per token: the token alone is the key, so "bearer  T" and "Bearer T" share a bucket
        (key,) = http.all("map", "$http_authorization", "$cvlb_token_or_address")
        assert key.values("default") == [["$binary_remote_addr"]]
        assert segments.values("default") == [["$cvlb_token_or_address"]]
        # (read raw: this file's parser drops backslashes in quotes, as nginx does only for \" \\ \t \r \n)
        (line,) = [
            x
            for x in rendered(settings=Settings(rate_limit="10r/s", public=True))["nginx/nginx.conf"].splitlines()
            if "~*^bearer" in x
        ]
        pattern = line.strip().split('"')[1][2:].replace("?<token>", "?P<token>")
        assert re.fullmatch(pattern, "BEARER   " + "t" * 20, re.I)["token"] == "t" * 20
        assert not re.fullmatch(pattern, "Bearer short", re.I)
        assert ["$cvlb_client", "zone=cvlb_rate:10m", "rate=10r/s"] in http.values("limit_req_zone")
    else:  # no tokens: a made-up Authorization header must not buy a fresh bucket
        assert not http.all("map", "$http_authorization")
        assert segments.values("default") == [["$binary_remote_addr"]]
        assert ["$cvlb_client", "zone=cvlb_rate:10m", "rate=10r/s"] in http.values("limit_req_zone")
    assert http.values("limit_req_status") == [["429"]]
    gradio = server.one("location", "~", "^/gradio_api/(queue/join|call/|run/|api/)")
    for location in (server.one("location", "/v1/"), gradio):
        assert location.values("limit_req") == [["zone=cvlb_rate", "burst=5", "nodelay"]]
    for route in ("queue/join", "call/generate", "run/predict", "api/generate"):
        assert re.match(gradio.args[1], "/gradio_api/" + route)
    # (/v1/ has error_pages of its own, which replace the server's: 429 must be among them)
    assert ["429", "=", "@rate_limited"] in server.one("location", "/v1/").values("error_page")
    assert ["429", "=", "@rate_limited"] in server.values("error_page")
    # every location with error_pages of its own repeats all of nginx's refusals
    refusals = server.values("error_page")
    assert {r[0] for r in refusals} >= {"400", "405", "413", "414", "429", "494", "501", "505"}
    for location in (("/v1/",), ("=", "/ping"), ("=", "/nginx_status")):
        assert all(r in server.one("location", *location).values("error_page") for r in refusals), location
    assert not server.one("location", "/").values("limit_req")  # the page and its assets are not counted
    answer = server.one("location", "@rate_limited")
    assert ["Retry-After", "1", "always"] in answer.values("add_header")
    assert answer.values("return")[0][0] == "429" and "10r/s" in answer.values("return")[0][1]


def test_logins_are_slowed_only_when_there_is_a_login():
    http, server = nginx_server(Settings(public=True))
    assert server.one("location", "=", "/login").values("limit_req") == [["zone=cvlb_login", "burst=10", "nodelay"]]
    assert not nginx_server(Settings())[1].all("location", "=", "/login")


def test_body_header_and_slow_client_bounds():
    http, _ = nginx_server(Settings(max_body="30MiB"))
    assert http.values("client_max_body_size") == [[str(30 * MiB)]]
    for name in ("client_header_timeout", "client_body_timeout", "send_timeout", "keepalive_timeout"):
        assert http.values(name), name
    assert http.values("autoindex") == [["off"]]


def test_instances_get_the_policy_file_only_when_credentials_are_required():
    def command(settings):
        conf = supervisor_sections(rendered(settings=settings)["run/supervisord.conf"])
        return shlex.split(conf.get("program:instance-0", "command"))

    assert "--auth-file" not in command(Settings())
    args = command(Settings(public=True))
    assert args[args.index("--auth-file") + 1] == str(SHORT / "run/access.json")


def test_every_answer_carries_a_request_id_that_reaches_the_instance_and_the_access_log():
    http, server = nginx_server(Settings())
    ids = http.one("map", "$http_x_request_id", "$cvlb_request_id")
    pattern = ids.block[0].name  # (a map entry: the pattern, then its value)
    assert pattern.startswith("~") and ids.values("default") == [["$request_id"]]
    assert re.fullmatch(pattern[1:], "my-trace.0001:a") and not re.fullmatch(pattern[1:], "a b c d e f g h")
    assert not re.fullmatch(pattern[1:], "short") and not re.fullmatch(pattern[1:], "x" * 129)
    assert ["X-Request-Id", "$cvlb_request_id"] in server.values("proxy_set_header")
    assert ["X-Request-Id", "$cvlb_request_id", "always"] in server.values("add_header")
    (log_format,) = http.values("log_format")
    assert "rid=$cvlb_request_id" in " ".join(log_format) and "upstream=$upstream_addr" in " ".join(log_format)
    # a location with add_header of its own repeats it (nginx drops the server's there)
    for location in server.all("location"):
        if location.values("add_header"):
            assert ["X-Request-Id", "$cvlb_request_id", "always"] in location.values("add_header"), location.args


def test_the_panel_and_the_metrics_go_to_the_admin_socket_never_to_an_instance():
    http, server = nginx_server(Settings())
    (admin,) = http.all("upstream", "cvlb_admin")
    assert admin.values("server") == [[f"unix:{SHORT}/run/admin.sock"]]
    for args in (("=", "/admin"), ("^~", "/admin/"), ("=", "/admin/login"), ("=", "/metrics"), ("^~", "/metrics/")):
        assert server.one("location", *args).values("proxy_pass") == [["http://cvlb_admin"]], args
    assert server.one("location", "=", "/admin/login").values("limit_req") == [
        ["zone=cvlb_login", "burst=10", "nodelay"]
    ]
    for args in (("=", "/admin"), ("^~", "/admin/"), ("=", "/metrics"), ("^~", "/metrics/")):
        assert server.one("location", *args).values("limit_req") == [["zone=cvlb_admin", "burst=50", "nodelay"]]


def test_the_jobs_api_goes_to_the_jobs_socket_with_the_apis_rate_limit():
    http, server = nginx_server(Settings(rate_limit="10r/s", rate_burst=7))
    (jobs,) = http.all("upstream", "cvlb_jobs")
    assert jobs.values("server") == [[f"unix:{SHORT}/run/jobs.sock"]]
    location = server.one("location", "^~", "/v1/audio/jobs")
    assert location.values("proxy_pass") == [["http://cvlb_jobs"]]
    assert location.values("limit_req") == server.one("location", "/v1/").values("limit_req")
    assert ["502", "504", "=", "@jobs_down"] in location.values("error_page")
    _, unlimited = nginx_server(Settings())
    assert unlimited.one("location", "^~", "/v1/audio/jobs").values("limit_req") == []


def test_the_jobs_program_runs_before_the_instances_stop_and_gets_redis_by_environment():
    secret = "redis://:pass%word@10.0.0.9:6379/0"
    conf = supervisor_sections(rendered(settings=Settings(jobs_redis=secret))["run/supervisord.conf"])
    jobs = conf["program:jobs"]
    argv = shlex.split(jobs["command"])
    assert argv[1:] == ["-m", "cosyvoice_lb.jobs", "--state-dir", str(SHORT)] and secret not in jobs["command"]
    env = dict_of_key_value_pairs(jobs["environment"].replace("%%", "%"))
    assert env == {"PYTHONUNBUFFERED": "1", "COSYVOICE_LB_JOBS_REDIS": secret}
    assert int(jobs["priority"]) > int(conf["program:instance-0"]["priority"])
    plain = supervisor_sections(rendered(settings=Settings())["run/supervisord.conf"])["program:jobs"]
    assert dict_of_key_value_pairs(plain["environment"]) == {"PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(
    "host, extra",
    [
        ("127.0.0.1", None),
        ("0.0.0.0", None),
        ("10.1.2.3", "10.1.2.3"),
        ("127.0.0.2", "127.0.0.2"),
        ("::", None),
        ("fd00::5", "fd00::5"),
        ("box.lan", None),
        ("localhost", None),
    ],
)
def test_stub_status_answers_this_box_only(host, extra):
    _, server = nginx_server(Settings(host=host, no_auth=True))
    status = server.one("location", "=", "/nginx_status")
    assert status.values("stub_status") == [[]]
    allowed = [a[0] for a in status.values("allow")]
    assert allowed == ["127.0.0.1", "::1"] + ([extra] if extra else []) and status.values("deny") == [["all"]]


# --- pools and CUDA MPS ------------------------------------------------------------------------


def test_parked_slots_are_programs_too_and_instances_count_their_peers_without_them(tmp_path_factory):
    inventory = Inventory(gpus=(Gpu(0, 24 * GiB, 24 * GiB),), cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB)
    the_plan = plan(inventory, Budget(5 * GiB, 512 * MiB), instances=2, spares=1, surge=1)
    files = rendered(settings=Settings(max_long_chars=2000), the_plan=the_plan)
    conf = supervisor_sections(files["run/supervisord.conf"])
    for slot in the_plan.slots:
        argv = shlex.split(conf[f"program:{slot.name}"]["command"])
        assert argv[argv.index("--peers") + 1] == "2"  # long texts spread over those that serve
    assert record.parse(files["run/cluster.json"]).roles.started == 3
    assert files["nginx/upstreams.conf"].count("# instance-3") == 4  # api, ui, segments, last resort


@pytest.mark.parametrize("state_dir", ["cvlb-mps-"], indirect=True)
def test_mps_runs_one_daemon_per_gpu_and_points_each_instance_at_its_cards(state_dir):
    the_plan = gpu_plan()  # gpu 0, 1, 0
    settings = Settings(mps=True, mps_thread_percentage=40)
    write(state_dir, rendered(state_dir, settings=settings, the_plan=the_plan))
    options = load_in_supervisor(Layout(state_dir).supervisord_conf)
    programs = {p.name: p for group in options.process_group_configs for p in group.process_configs}
    assert {"mps-gpu0", "mps-gpu1"} <= set(programs)
    for gpu in (0, 1):
        daemon = programs[f"mps-gpu{gpu}"]
        argv = shlex.split(daemon.command)
        assert argv[1:3] == ["-m", "cosyvoice_lb.launcher.cluster.mps"]
        assert argv[argv.index("--gpu") + 1] == str(gpu)
        assert argv[argv.index("--pipe-dir") + 1] == str(state_dir / "run" / f"mps-gpu{gpu}")
        # up before the instances, down after them (supervisord stops by descending priority)
        assert daemon.priority < programs["nginx"].priority < programs["instance-0"].priority
    for slot in the_plan.slots:
        env = programs[slot.name].environment
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(state_dir / "run" / f"mps-gpu{slot.gpu}")
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(state_dir / "logs" / f"mps-gpu{slot.gpu}")
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        # the daemon of gpuN sees that card only and remaps it: its clients see device 0
        assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_without_mps_nothing_of_it_is_rendered():
    text = rendered(settings=Settings())["run/supervisord.conf"]
    assert "mps" not in text.lower()


def test_mps_on_a_plan_without_gpus_is_refused():
    with pytest.raises(RenderError, match="--mps shares NVIDIA GPUs between instances, and this plan has none"):
        rendered(settings=Settings(mps=True), the_plan=cpu_plan())


# --- routing by work ---------------------------------------------------------------------------


def test_routing_by_work_has_a_last_resort_nginx_reaches_only_after_every_instance():
    files = rendered(settings=Settings(retries=2))
    http = parse_nginx(files["nginx/nginx.conf"]).one("http")
    upstreams = parse_nginx(files["nginx/upstreams.conf"])
    socket = f"unix:{SHORT}/run/overflow.sock"
    for pool in ("cvlb_api", "cvlb_segments"):  # the API's pools end in the last resort...
        assert upstreams.one("upstream", pool).values("server")[-1] == [socket, "backup"]
    for pool in ("cvlb_ui", "cvlb_instances"):  # ...the UI's and the last resort's own do not
        assert [socket, "backup"] not in upstreams.one("upstream", pool).values("server")
    server = public_server(http)
    headers = server.values("proxy_set_header")
    assert ["X-Cvlb-Try", "$request_id"] in headers and ["X-Cvlb-Route", ""] in headers  # a client cannot say "last"
    v1 = server.one("location", "/v1/")
    slots = len(gpu_plan().slots)
    assert v1.values("proxy_next_upstream_tries") == [[str(slots + 1)]]  # every instance, then the last resort
    assert server.values("proxy_next_upstream_tries") == [["2"]]  # (elsewhere --retries)
    assert v1.values("proxy_hide_header") == [["X-Cvlb-Declined"]]
    assert server.one("location", "=", "/ping").values("proxy_pass")[0][0].startswith("http://cvlb_instances")
    (last,) = [s for s in http.all("server") if s.values("listen") == [[socket]]]
    assert ["X-Cvlb-Route", "last"] in last.values("proxy_set_header")
    assert last.values("proxy_next_upstream_tries") == [["2"]]
    assert last.one("location", "/").values("proxy_pass") == [["http://cvlb_instances"]]
    assert last.values("access_log") == [["off"]]


def test_least_connections_renders_no_last_resort_and_plain_retries():
    files = rendered(settings=Settings(routing="least-conn", retries=2))
    http = parse_nginx(files["nginx/nginx.conf"]).one("http")
    assert len(http.all("server")) == 1
    assert "backup" not in files["nginx/upstreams.conf"]
    assert public_server(http).one("location", "/v1/").values("proxy_next_upstream_tries") == [["2"]]


# --- the client's address behind a proxy (--trusted-proxies) ----------------------------------


def test_without_trusted_proxies_nginx_believes_no_forwarded_address():
    http, server = nginx_server(Settings(public=True))
    for directive in ("set_real_ip_from", "real_ip_header", "real_ip_recursive"):
        assert not http.values(directive) and not server.values(directive), directive
    assert ["X-Forwarded-For", "$proxy_add_x_forwarded_for"] in server.values("proxy_set_header")
    assert "realip" not in rendered(settings=Settings(public=True))["nginx/nginx.conf"]


def test_trusted_proxies_name_the_client_in_remote_addr():
    http, server = nginx_server(Settings(public=True, trusted_proxies="10.0.0.0/8, 192.168.1.7,10.0.0.0/8,::1"))
    # each network once, in its normal form; the rightmost untrusted address is the client
    assert http.values("set_real_ip_from") == [["10.0.0.0/8"], ["192.168.1.7/32"], ["::1/128"]]
    assert http.values("real_ip_header") == [["X-Forwarded-For"]] and http.values("real_ip_recursive") == [["on"]]
    # what reaches the instance adds the hop nginx got the request from (the proxy), not the client again
    forwarded = http.one("map", "$http_x_forwarded_for", "$cvlb_forwarded_for")
    assert forwarded.values("default") == [["$http_x_forwarded_for, $realip_remote_addr"]]
    assert ["X-Forwarded-For", "$cvlb_forwarded_for"] in server.values("proxy_set_header")
    # what keys on the address now keys on the client's: the details of /ping, the logins' throttle
    assert http.one("map", "$remote_addr", "$cvlb_ping_uri")
    assert ["$binary_remote_addr", "zone=cvlb_login:1m", "rate=10r/m"] in http.values("limit_req_zone")


@pytest.mark.parametrize("given, bad", [("10.0.0.0/8,proxy.example", "proxy.example"), ("10.0.0.0/33", "10.0.0.0/33")])
def test_a_trusted_proxy_that_is_no_network_is_refused_naming_it(given, bad):
    with pytest.raises(RenderError, match=rf"--trusted-proxies: '{re.escape(bad)}' is not an address or a network"):
        rendered(settings=Settings(trusted_proxies=given))


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed")
def test_nginx_accepts_the_trusted_proxies(state_dir):
    files = rendered(state_dir, settings=Settings(public=True, rate_limit="10r/s", trusted_proxies="10.0.0.0/8,::1"))
    write(state_dir, files)
    write_segment_key(Layout(state_dir))
    done = nginx_test(state_dir)
    assert done.returncode == 0, done.stderr


class Echo(BaseHTTPRequestHandler):
    """An instance that answers with the path it was asked and the addresses nginx sent it."""

    def do_GET(self):
        body = json.dumps(
            {"path": self.path, "real_ip": self.headers.get("X-Real-IP"), "xff": self.headers.get("X-Forwarded-For")}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextmanager
def running_nginx(root: Path, settings: Settings, instance_port: int):
    """nginx from the rendered config, in front of one instance at ``instance_port``."""
    write(root, rendered(root, settings=settings, the_plan=gpu_plan(instances=1, base_port=instance_port)))
    write_segment_key(Layout(root))
    layout = Layout(root)
    nginx = subprocess.Popen(
        [NGINX, "-p", str(layout.nginx_dir), "-c", str(layout.nginx_conf), "-e", str(layout.log("nginx-error"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while port_free(settings.port) and time.monotonic() < deadline and nginx.poll() is None:
            time.sleep(0.05)
        assert nginx.poll() is None, nginx.stderr.read() if nginx.stderr else ""
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        nginx.terminate()
        nginx.wait(10)


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed")
def test_behind_a_trusted_proxy_the_client_is_the_forwarded_address_over_real_http(state_dir):
    session = requests.Session()
    session.trust_env = False
    with http_server(Echo) as instance:
        trusted = Settings(port=free_port_block(1), trusted_proxies="127.0.0.1")
        with running_nginx(state_dir, trusted, instance) as url:
            # a request relayed by the proxy on this box: the client is the address it forwards
            relayed = session.get(url + "/ping", headers={"X-Forwarded-For": "203.0.113.9"}, timeout=10).json()
            assert relayed["path"] == "/ping/brief"  # not this box: the brief answer
            assert relayed["real_ip"] == "203.0.113.9" and relayed["xff"] == "203.0.113.9, 127.0.0.1"
            # a client that wrote an address itself, the proxy appending the real one: not believed
            lied = {"X-Forwarded-For": "127.0.0.1, 203.0.113.9"}
            assert session.get(url + "/ping", headers=lied, timeout=10).json()["real_ip"] == "203.0.113.9"
            # a request from this box without a proxy: this box, with the details
            local = session.get(url + "/ping", timeout=10).json()
            assert local["path"] == "/ping" and local["real_ip"] == "127.0.0.1"
        untrusted = Settings(port=free_port_block(1))
        with running_nginx(state_dir, untrusted, instance) as url:
            # no trusted proxies: a forwarded address is never the client
            claimed = session.get(url + "/ping", headers={"X-Forwarded-For": "203.0.113.9"}, timeout=10).json()
            assert claimed["path"] == "/ping" and claimed["real_ip"] == "127.0.0.1"


# --- what the plan resolved reaches each instance's command line ------------------------------


def instance_argvs(settings: Settings, the_plan) -> dict[str, list[str]]:
    conf = supervisor_sections(rendered(settings=settings, the_plan=the_plan)["run/supervisord.conf"])
    return {s.name: shlex.split(conf[f"program:{s.name}"]["command"]) for s in the_plan.slots}


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_each_instance_gets_its_slots_concurrency_and_vllm_share(tmp_path):
    from cosyvoice_lb.common.instance_argv import parse_instance_args
    from cosyvoice_lb.launcher.plan.footprint import budget_for

    settings = Settings(engine="cosyvoice3", model_dir="/m", load_vllm=True, state_dir=str(tmp_path))
    gpus = (Gpu(0, 141 * GiB, 141 * GiB), Gpu(1, 24 * GiB, 24 * GiB))
    inventory = Inventory(gpus=gpus, cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB)
    the_plan = plan(inventory, budget_for(settings, Layout(tmp_path))[0])
    # (a share of each card: the smaller card's is larger)
    assert {s.vllm_memory for s in the_plan.slots if s.gpu == 0} != {s.vllm_memory for s in the_plan.slots if s.gpu}
    argvs = instance_argvs(settings, the_plan)
    for slot in the_plan.slots:
        argv = argvs[slot.name]
        assert flag_value(argv, "--instance-concurrency") == str(slot.concurrency)
        assert flag_value(argv, "--vllm-memory") == f"{slot.vllm_memory:g}" and slot.vllm_memory > 0
        parsed, _ = parse_instance_args(argv[2:])  # (what the instance reads back)
        assert (parsed.instance_concurrency, parsed.vllm_memory) == (str(slot.concurrency), slot.vllm_memory)


def test_a_cpu_slot_with_vllm_gets_its_planned_kv_cache_and_a_gpu_slot_none(tmp_path):
    from cosyvoice_lb.launcher.plan.figures import VLLM_CPU_ENGINE
    from cosyvoice_lb.launcher.plan.footprint import budget_for, vllm_cpu_kv_space

    settings = Settings(engine="cosyvoice3", model_dir="/m", load_vllm=True, state_dir=str(tmp_path))
    budget = budget_for(settings, Layout(tmp_path))[0]
    cpu = Inventory(gpus=(), cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB)
    cpu_plan = plan(cpu, budget)
    slot = cpu_plan.slots[0]
    assert slot.concurrency == 8 and slot.vllm_memory == 0.0
    env = instance_env(Layout(tmp_path), slot, settings)
    # Qwen2-0.5B's 12 KiB a token for a 32,768-token sequence, or 8 x 4,096: 384 MiB, plus a tenth: 1 GiB
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" == str(vllm_cpu_kv_space(8))
    assert vllm_cpu_kv_space(64) == 4  # (64 x 4,096 tokens x 12 KiB x 1.1 = 3.3 GiB)
    # its engine process and that cache are planned in host RAM beside the instance
    assert budget.on_host(1) == 6 * GiB + VLLM_CPU_ENGINE + 1 * GiB
    gpu = Inventory(gpus=(Gpu(0, 80 * GiB, 80 * GiB),), cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB)
    gpu_slot = plan(gpu, budget).slots[0]
    assert "VLLM_CPU_KVCACHE_SPACE" not in instance_env(Layout(tmp_path), gpu_slot, settings)
    plain = Settings(engine="cosyvoice3", model_dir="/m", state_dir=str(tmp_path))
    assert "VLLM_CPU_KVCACHE_SPACE" not in instance_env(Layout(tmp_path), slot, plain)


def test_a_given_vllm_share_and_a_plan_without_vllm_render_as_such():
    cards = Inventory(gpus=(Gpu(0, 80 * GiB, 80 * GiB),), cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB)
    given = Settings(engine="cosyvoice3", model_dir="/m", load_vllm=True, vllm_memory=0.25)
    with_share = plan(cards, Budget(5 * GiB, 512 * MiB, concurrency=4, vllm=VllmShare(given=0.25)))
    for argv in instance_argvs(given, with_share).values():
        assert (flag_value(argv, "--vllm-memory"), flag_value(argv, "--instance-concurrency")) == ("0.25", "4")
    plain = Settings(engine="cosyvoice3", model_dir="/m")
    for argv in instance_argvs(plain, plan(cards, Budget(5 * GiB, 512 * MiB, concurrency=2))).values():
        assert flag_value(argv, "--instance-concurrency") == "2" and flag_value(argv, "--vllm-memory") == "0.0"
    # an engine without vLLM's setting gets its concurrency alone
    for argv in instance_argvs(Settings(engine="espeak"), cpu_plan()).values():
        assert flag_value(argv, "--instance-concurrency") == "1" and "--vllm-memory" not in argv


def test_the_rendered_concurrency_becomes_the_instances_admission_slots(tmp_path):
    from cosyvoice_lb.common.instance_argv import parse_instance_args
    from cosyvoice_lb.instance.wiring import build_pipeline

    cards = Inventory(gpus=(Gpu(0, 80 * GiB, 80 * GiB),), cpu_cores=8, ram_total=64 * GiB, ram_available=64 * GiB)
    the_plan = plan(cards, Budget(5 * GiB, 512 * MiB, concurrency=6), instances=1)
    settings = Settings(engine="simulated", outputs_dir=str(tmp_path))
    argv = instance_argvs(settings, the_plan)["instance-0"]
    parsed, args = parse_instance_args(argv[2:])
    assert build_pipeline(parsed, args.port).admission.concurrency == 6  # (not what auto is for simulated: 1)


def test_streaming_sessions_are_upgraded_to_one_instance_with_no_last_resort_and_outlive_reloads():
    settings = Settings(stream_max_seconds=200.0, drain_timeout=30.0, rate_limit="5r/s", retries=3)
    files = rendered(settings=settings)
    http = parse_nginx(files["nginx/nginx.conf"]).one("http")
    server = public_server(http)
    stream = server.one("location", "=", "/v1/audio/speech/stream")
    # a refusal (503: no slot free) goes to the next instance, never to the last resort,
    # which would queue it: a session never queues
    assert stream.values("proxy_pass") == [["http://cvlb_instances"]]
    upstreams = parse_nginx(files["nginx/upstreams.conf"])
    assert not [s for s in upstreams.one("upstream", "cvlb_instances").values("server") if "backup" in s]
    # the upgrade headers come from the server level: a location of its own would drop them
    assert stream.values("proxy_set_header") == []
    assert ["Upgrade", "$http_upgrade"] in server.values("proxy_set_header")
    assert stream.values("proxy_read_timeout") == [["205s"]] and stream.values("proxy_send_timeout") == [["205s"]]
    assert stream.values("proxy_buffering") == [["off"]]
    assert stream.values("limit_req")[0][0] == "zone=cvlb_rate"  # a session's handshake is a request
    # every rotation change reloads nginx: its old workers let a session run to its limit
    assert parse_nginx(files["nginx/nginx.conf"]).values("worker_shutdown_timeout") == [["205s"]]
