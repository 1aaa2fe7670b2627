"""One declaration per setting (cosyvoice_lb/common/settings.py): the checks each carries, and the
instance's command line written and parsed by the same declarations."""

from __future__ import annotations

import dataclasses

import pytest

from cosyvoice_lb.common.instance_argv import instance_args, instance_settings, parse_instance_args
from cosyvoice_lb.common.setting_errors import setting_errors
from cosyvoice_lb.common.settings import Settings, declarations, flag
from cosyvoice_lb.common.timeouts import Timeouts

INSTANCE_ONLY = {"port", "host", "starts_file"}


def test_defaults_have_no_problems():
    assert setting_errors(Settings()) == []


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"port": 0}, "--port 0 is not a TCP port"),
        ({"base_port": 70000}, "--base-port 70000 is not a TCP port"),
        ({"probe_interval": 0}, "--probe-interval must be above 0"),
        ({"request_timeout": -1}, "--request-timeout must be above 0"),
        ({"drain_timeout": -1}, "--drain-timeout cannot be negative"),
        ({"max_queue": -1}, "--max-queue cannot be negative"),
        ({"instance_concurrency": "0"}, "--instance-concurrency must be auto or a whole number of at least 1"),
        ({"max_prompt_seconds": 31}, "at most 30 (upstream refuses longer prompts)"),
        ({"max_prompt_seconds": 2}, "must be at least 3 (shorter prompts are refused)"),
        ({"max_upload": "lots"}, "--max-upload: cannot read size 'lots'"),
        ({"max_memory": "12 bananas"}, "--max-memory: cannot read size"),
        ({"engine": "cosyvoice3"}, "--engine cosyvoice3 needs --model-dir"),
    ],
)
def test_each_setting_is_checked_by_its_own_declaration(changes, words):
    found = setting_errors(Settings(**changes))
    assert len(found) == 1 and words in found[0]


def test_every_problem_is_reported_not_only_the_first():
    assert len(setting_errors(Settings(port=0, retries=0, max_chars=0))) == 3


@pytest.mark.parametrize(
    "settings",
    [
        Settings(),
        Settings(engine="simulated", simulated_ms_per_char=2.5, simulated_base_ms=7.0, max_queue=0),
        Settings(
            model_dir="/models/CosyVoice3",
            cosyvoice_root="/src/CosyVoice",
            fp16=True,
            load_trt=True,
            max_upload="3MiB",
            outputs_max_size="1GiB",
            request_timeout=12.5,
            drain_timeout=0.0,
            instance_concurrency="2",
            max_chars=80,
            max_prompt_seconds=9.5,
            outputs_max_age=60.0,
        ),
    ],
)
def test_the_instance_parses_back_exactly_what_the_launcher_wrote(settings):
    argv = [
        "--port",
        "7861",
        "--starts-file",
        "/s/run/instance-1.starts",
        *instance_args(settings, outputs_dir="/s/outputs"),
    ]
    parsed, args = parse_instance_args(argv)
    assert (args.port, args.host, args.starts_file) == (7861, "127.0.0.1", "/s/run/instance-1.starts")
    for f in instance_settings(settings.resolved_engine):
        expected = "/s/outputs" if f.name == "outputs_dir" else getattr(settings, f.name)
        if f.name == "engine":
            expected = settings.resolved_engine
        assert getattr(parsed, f.name) == expected, f.name


def test_an_instance_gets_only_its_engine_s_settings():
    espeak = " ".join(instance_args(Settings()))
    assert "--model-dir" not in espeak and "--simulated-ms-per-char" not in espeak and "--fp16" not in espeak
    simulated = " ".join(instance_args(Settings(engine="simulated")))
    assert "--simulated-ms-per-char 4.0" in simulated and "--load-trt" not in simulated
    # launcher-only settings never reach an instance
    for name in ("probe_interval", "hang_timeout", "port", "state_dir", "retries"):
        assert flag(name) not in espeak + simulated


def test_every_instance_flag_is_declared_once():
    names = [f.name for f in declarations() if f.metadata["instance"]]
    assert len(names) == len(set(names)) and not INSTANCE_ONLY & set(names)
    assert all(
        f.metadata["instance"] in (True, "cosyvoice3", "simulated") for f in declarations() if f.metadata["instance"]
    )


def test_derived_timeouts_keep_their_margins():
    t = Timeouts(
        Settings(request_timeout=90.0, drain_timeout=30.0, probe_interval=1.0, probe_timeout=2.0, startup_timeout=300.0)
    )
    assert t.nginx_api_read == 95 and t.nginx_retry_window == 90  # the instance's 504 arrives first
    assert t.supervisord_stop_wait == 35 and t.nginx_worker_shutdown == 125  # after the drain and a session
    assert t.nginx_stream_read == 125  # (the instance closes a session at its limit first)
    assert t.serving == 360 and t.others_serving == 330 and t.health_stale == 10.0
    assert Timeouts(Settings(request_timeout=0.5)).nginx_retry_window == 1  # never 0 (= no bound to nginx)
    assert Timeouts(Settings(probe_interval=10.0)).loop_answer == 100.0


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().port = 1  # type: ignore[misc]


def test_an_instance_started_with_an_earlier_version_s_flags_still_starts():
    parsed, _ = parse_instance_args(["--port", "7860", "--max-upload-mib", "10", "--outputs-max-mib", "2048"])
    assert (parsed.max_upload, parsed.outputs_max_size) == ("10MiB", "2048MiB")


@pytest.mark.parametrize("name", ["request_timeout", "drain_timeout", "probe_interval", "simulated_ms_per_char"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_infinite_or_nan_seconds_are_refused(name, value):

    found = setting_errors(Settings(**{name: value}))
    assert any(f"--{name.replace('_', '-')} must be" in p for p in found), found


def test_the_instances_command_line_carries_its_format_and_a_newer_one_is_refused(capsys):
    from cosyvoice_lb.common.instance_argv import ARGV_VERSION, instance_args, parse_instance_args

    argv = instance_args(Settings(engine="espeak"))
    assert argv[:2] == ["--argv-version", str(ARGV_VERSION)]
    settings, args = parse_instance_args(["--port", "7860", *argv])
    assert settings.engine == "espeak" and args.argv_version == ARGV_VERSION
    assert parse_instance_args(["--port", "7860", "--engine", "espeak"])[1].argv_version == 0  # 0.1's, no version
    with pytest.raises(SystemExit):
        parse_instance_args(["--port", "7860", "--argv-version", str(ARGV_VERSION + 1)])
    assert "'cosyvoice-lb restart --all' stages the launcher's code" in capsys.readouterr().err
