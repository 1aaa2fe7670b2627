"""The CLI contract that needs no running cluster: plan, render, env vars, errors.

Most calls run the command in this process (`cli_here`); the entry point itself, `--help` and
`render` with nginx -t, and the tests that need signals or a follower run it as a process."""

from __future__ import annotations

import json
import subprocess

from conftest import ROOT, clean_env, cli, cli_here


def test_plan_without_gpu_plans_cpu_slots_and_says_so():
    done = cli_here("plan", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["mode"] == "cpu" and plan["slots"]
    assert all(s["gpu"] is None and s["device"] == "cpu" for s in plan["slots"])
    assert any("no GPU found" in note for note in plan["notes"])
    table = cli_here("plan")
    assert "no GPU found" in table.stdout and "instance-0" in table.stdout


def test_plan_for_a_hypothetical_box():
    done = cli_here(
        "plan", "--gpus", "24GiB,24GiB", "--footprint", "5GiB", "--reserve", "1GiB", "--base-port", "9000", "--json"
    )
    plan = json.loads(done.stdout)
    assert [(s["gpu"], s["port"]) for s in plan["slots"]] == [
        (0, 9000),
        (1, 9001),
        (0, 9002),
        (1, 9003),
        (0, 9004),
        (1, 9005),
        (0, 9006),
        (1, 9007),
    ]
    capped = json.loads(
        cli_here("plan", "--gpus", "24GiB,24GiB", "--footprint", "5GiB", "--max-instances", "3", "--json").stdout
    )
    assert [s["gpu"] for s in capped["slots"]] == [0, 1, 0]


def test_every_option_can_come_from_the_environment():
    env = clean_env(COSYVOICE_LB_GPUS="12GiB", COSYVOICE_LB_FOOTPRINT="5GiB", COSYVOICE_LB_BASE_PORT="9100")
    plan = json.loads(cli_here("plan", "--json", env=env).stdout)
    assert [(s["gpu"], s["port"]) for s in plan["slots"]] == [(0, 9100), (0, 9101)]
    # a flag beats its variable
    plan = json.loads(cli_here("plan", "--json", "--base-port", "9200", env=env).stdout)
    assert plan["slots"][0]["port"] == 9200


def test_sizes_and_counts_are_checked_with_a_clear_message():
    bad_size = cli_here("plan", "--footprint", "lots")
    assert bad_size.returncode != 0 and "cannot read size 'lots'" in bad_size.stderr
    too_many = cli_here("plan", "--gpus", "12GiB", "--footprint", "5GiB", "--instances", "5")
    assert too_many.returncode != 0
    assert "5 instances requested but only 2 fit" in too_many.stderr and "--force" in too_many.stderr
    forced = cli_here("plan", "--gpus", "12GiB", "--footprint", "5GiB", "--instances", "5", "--force", "--json")
    assert forced.returncode == 0 and len(json.loads(forced.stdout)["slots"]) == 5
    bad_count = cli_here("plan", "--instances", "many")
    assert bad_count.returncode != 0 and "'auto'" in bad_count.stderr
    nothing_fits = cli_here("plan", "--gpus", "4GiB", "--footprint", "5GiB")
    assert nothing_fits.returncode != 0 and "no instance fits" in nothing_fits.stderr
    engine = cli_here("plan", "--engine", "nope")
    assert engine.returncode != 0 and "nope" in engine.stderr


def test_render_writes_every_config_and_nginx_accepts_it(state_dir):
    done = cli("render", "--state-dir", str(state_dir), "--instances", "2", "--port", "18999", "--base-port", "18990")
    assert done.returncode == 0, done.stderr
    for relative in ("run/supervisord.conf", "nginx/nginx.conf", "nginx/upstreams.conf", "run/cluster.json"):
        assert (state_dir / relative).is_file()
    assert "nginx -t accepts" in done.stdout
    test = subprocess.run(
        [
            "nginx",
            "-t",
            "-p",
            str(state_dir / "nginx"),
            "-c",
            str(state_dir / "nginx/nginx.conf"),
            "-e",
            str(state_dir / "logs/nginx-error.log"),
        ],
        capture_output=True,
        text=True,
    )
    assert test.returncode == 0, test.stderr
    # Closed by default: loopback only, and no credentials to make or read.
    assert "listen 127.0.0.1:18999" in (state_dir / "nginx/nginx.conf").read_text()
    assert not (state_dir / "api-token").exists() and not (state_dir / "run/access.json").exists()
    assert not (state_dir / "run/supervisor.sock").exists()  # nothing started


def test_commands_on_a_dir_without_a_cluster(state_dir):
    status = cli_here("status", "--state-dir", str(state_dir))
    assert status.returncode == 3 and "not running" in status.stdout
    assert json.loads(cli_here("status", "--json", "--state-dir", str(state_dir)).stdout)["running"] is False
    down = cli_here("down", "--state-dir", str(state_dir))
    assert down.returncode == 0 and "not running" in down.stdout
    restart = cli_here("restart", "--all", "--state-dir", str(state_dir))
    assert restart.returncode != 0 and "no cluster runs" in restart.stderr
    neither = cli_here("restart", "--state-dir", str(state_dir))
    assert neither.returncode != 0 and "--all" in neither.stderr


def test_help_lists_the_commands_and_env_vars():
    done = cli("--help")
    for command in ("plan", "render", "up", "down", "status", "restart", "logs"):
        assert command in done.stdout
    assert "COSYVOICE_LB_PORT" in cli("up", "--help").stdout


def test_docs_settings_table_is_the_one_the_settings_print():
    from conftest import ROOT

    from cosyvoice_lb.common.settings import markdown_table

    doc = (ROOT / "docs" / "settings.md").read_text()
    section = doc.split("<!-- settings: python -m cosyvoice_lb.common.settings -->\n")[1].split("<!-- /settings -->")[0]
    assert section == markdown_table(), (
        "docs/settings.md's table is not what the settings declare: replace everything between its two "
        "<!-- settings --> markers with the output of `python -m cosyvoice_lb.common.settings`"
    )
    assert "`--model-dir` | `COSYVOICE_LB_MODEL_DIR`" in section


def test_logs_follow_keeps_going_across_a_rotation(state_dir):
    import sys
    import time

    from conftest import ROOT

    logs = state_dir / "logs"
    logs.mkdir()
    log = logs / "instance-0.log"
    log.write_text("old line\n")
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cosyvoice_lb.launcher.cli",
            "logs",
            "instance-0",
            "-f",
            "-n",
            "5",
            "--state-dir",
            str(state_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        env=clean_env(),
    )
    import threading

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follower.stdout.readline, "")), daemon=True)
    reader.start()

    def printed(line: str) -> bool:  # bounded: each step waits for what the follower printed
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and line + "\n" not in lines:
            time.sleep(0.05)
        return line + "\n" in lines

    try:
        assert printed("old line")
        with open(log, "a") as handle:
            handle.write("before rotation\n")
        assert printed("before rotation")
        log.rename(logs / "instance-0.log.1")  # what supervisord does at logfile_maxbytes
        log.write_text("after rotation\n")
        assert printed("after rotation")
    finally:
        follower.terminate()
        follower.wait(timeout=10)
        reader.join(timeout=10)
    out = "".join(lines)
    assert out.splitlines() == ["old line", "before rotation", "after rotation"]


def test_status_and_plan_json_can_come_from_the_environment(state_dir):
    done = cli_here("status", "--state-dir", str(state_dir), env=clean_env(COSYVOICE_LB_JSON="1"))
    assert json.loads(done.stdout)["running"] is False


def test_plan_uses_a_calibrated_footprint_and_says_so(state_dir):
    model = str(ROOT / "tests" / "fake_models" / "Fun-CosyVoice3-0.5B")
    (state_dir / "run").mkdir()
    (state_dir / "run" / "footprint.json").write_text(
        json.dumps({"cosyvoice3": {"gpu_bytes": 3 * 2**30, "peak_bytes": 2**30, "when": "2026-11-29 20:00"}})
    )
    plan = json.loads(
        cli_here(
            "plan",
            "--json",
            "--gpus",
            "24GiB",
            "--model-dir",
            model,
            "--instance-concurrency",
            "1",
            "--state-dir",
            str(state_dir),
        ).stdout
    )
    assert plan["footprint_source"].startswith("calibrated") and len(plan["slots"]) == 7  # 23 GiB // 3 GiB
    flagged = json.loads(
        cli_here(
            "plan",
            "--json",
            "--gpus",
            "24GiB",
            "--model-dir",
            model,
            "--load-trt",
            "--instance-concurrency",
            "1",
            "--state-dir",
            str(state_dir),
        ).stdout
    )
    assert flagged["footprint_source"] == "default" and len(flagged["slots"]) == 2  # 23 // 9.5: other flags


def test_the_command_up_prints_to_run_next_works_as_typed(monkeypatch, tmp_path):
    from cosyvoice_lb.launcher import cli as cli_module

    monkeypatch.setenv("COSYVOICE_LB_INVOKED_AS", "./run.sh")  # what run.sh exports
    assert cli_module.invoked_as() == "./run.sh"
    monkeypatch.delenv("COSYVOICE_LB_INVOKED_AS")
    script = tmp_path / "cosyvoice-lb"  # a venv's script that is not on PATH
    script.write_text("")
    monkeypatch.setattr("sys.argv", [str(script), "up"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cli_module.invoked_as() == str(script)
    monkeypatch.setattr("sys.argv", ["/somewhere/cli.py", "up"])  # python -m cosyvoice_lb.launcher.cli
    assert cli_module.invoked_as().endswith(" -m cosyvoice_lb.launcher.cli")


def test_up_says_who_can_reach_the_service():
    from cosyvoice_lb.launcher.views import reach

    assert "other machines" in reach("0.0.0.0", 8080) and "other machines" in reach("::", 8080)
    assert reach("127.0.0.1", 8080) == "from this box only (loopback)"
    assert reach("203.0.113.5", 8080) == "on 203.0.113.5:8080 only"


def test_status_watch_refreshes_until_ctrl_c(state_dir):
    """Piped, --watch prints one plain block per refresh; a dir without a cluster is watched on."""
    import signal
    import sys
    import threading
    import time

    # Ctrl-C as a terminal delivers it: SIGINT raises KeyboardInterrupt in the watcher even when
    # this test runs under a shell that started it with SIGINT ignored (a background job),
    # which the child would inherit.
    ctrl_c = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['cosyvoice-lb', 'status', '--watch', '--interval', '0.2']; "
        "runpy.run_module('cosyvoice_lb.launcher.cli', run_name='__main__')"
    )
    watcher = subprocess.Popen(
        [sys.executable, "-c", ctrl_c],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        env=clean_env(COSYVOICE_LB_STATE_DIR=str(state_dir)),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(watcher.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while sum("not running" in line for line in list(lines)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        watcher.send_signal(signal.SIGINT)
        try:  # (bounded generously: a status read on a loaded box walks every process's command line)
            _, errors = watcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"--watch went on 60 s after SIGINT; it had printed {len(lines)} line(s)") from None
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=10)
    reader.join(timeout=10)
    assert watcher.returncode == 0, errors
    assert errors == ""  # quietly: no traceback, no "Aborted!"
    text = "".join(lines)
    assert "\x1b" not in text  # plain text when piped
    blocks = [block for block in text.split("\n\n") if block.strip()]
    assert len(blocks) >= 2
    assert all(block.strip() == f"not running ({state_dir.resolve()})" for block in blocks)


def test_status_watch_and_json_do_not_go_together(state_dir):
    done = cli_here("status", "--watch", "--json", "--state-dir", str(state_dir))
    assert done.returncode == 2 and "--watch" in done.stderr and "--json" in done.stderr
    from_env = cli_here("status", "-w", "--state-dir", str(state_dir), env=clean_env(COSYVOICE_LB_JSON="1"))
    assert from_env.returncode == 2 and "cannot be combined" in from_env.stderr
    watch_env = cli_here("status", "--json", "--state-dir", str(state_dir), env=clean_env(COSYVOICE_LB_WATCH="1"))
    assert watch_env.returncode == 2 and "cannot be combined" in watch_env.stderr
    interval = cli_here("status", "--watch", "--interval", "0", "--state-dir", str(state_dir))
    assert interval.returncode == 2 and "--interval" in interval.stderr


def test_status_help_names_the_watch_variables():
    text = cli_here("status", "--help").stdout
    assert "COSYVOICE_LB_WATCH" in text and "COSYVOICE_LB_INTERVAL" in text


def test_plan_shows_each_slots_role_at_up():
    done = cli_here(
        "plan", "--gpus", "24GiB", "--instances", "2", "--min-instances", "1", "--spares", "1", "--surge", "2"
    )
    assert done.returncode == 0, done.stderr
    roles = [line.split("│")[5].strip() for line in done.stdout.splitlines() if line.startswith("│ instance-")]
    # one 24 GiB card holds 4: the surge gets 1 of the 2 asked for, and the plan says so
    assert roles == ["serving", "warm spare", "parked (elastic)", "parked (surge)"]
    assert "--surge 2: room for 1 parked slot(s)" in done.stdout


def test_pool_settings_that_contradict_are_refused_with_the_fix(state_dir):
    done = cli_here("plan", "--gpus", "24GiB", "--instances", "4", "--spares", "1")
    assert done.returncode != 0 and "4 instances and 1 spare requested but only 4 fit" in done.stderr
    done = cli_here("plan", "--gpus", "24GiB", "--instances", "2", "--min-instances", "3")
    assert done.returncode != 0 and "--min-instances 3 is above the 2 instances planned to serve" in done.stderr
    done = cli_here("render", "--state-dir", str(state_dir), "--min-instances", "3", "--max-instances", "2")
    assert done.returncode != 0 and "--min-instances 3 is above --max-instances 2" in done.stderr
    done = cli_here("render", "--state-dir", str(state_dir), "--mps-thread-percentage", "50")
    assert done.returncode != 0 and "--mps-thread-percentage needs --mps" in done.stderr
    done = cli_here("render", "--state-dir", str(state_dir), "--mps")
    assert done.returncode != 0 and "--mps shares NVIDIA GPUs between instances, and this plan has none" in done.stderr


def test_up_with_mps_on_a_box_without_the_nvidia_driver_is_refused_before_anything_starts(state_dir):
    done = cli_here("up", "--state-dir", str(state_dir), "--mps", "--gpus", "24GiB", "--port", "1")
    assert done.returncode != 0
    assert "--mps needs the NVIDIA driver: /proc/driver/nvidia/version is missing" in done.stderr
    assert not (state_dir / "run" / "supervisord.conf").exists()
