"""What is wrong with a set of settings, each said with what to change: every setting checked
by its own declaration, then what no single setting can say (contradictions, limits in the
wrong order). Every entry point that takes settings (render, up, k8s render, preflight)
refuses with these."""

from __future__ import annotations

from cosyvoice_lb.common.alert_settings import alert_contradictions
from cosyvoice_lb.common.checks import size
from cosyvoice_lb.common.settings import Settings, declarations, flag, is_loopback
from cosyvoice_lb.common.sizes import parse_size


def setting_errors(settings: Settings) -> list[str]:
    """What is wrong with these settings, each setting checked by its own declaration, then
    what no single setting can say ([] when they can work)."""
    found = [
        message
        for f in declarations()
        if f.metadata["check"]
        for message in [f.metadata["check"](flag(f.name), getattr(settings, f.name))]
        if message
    ]
    return found + contradictions(settings) + alert_contradictions(settings) + limits_apart(settings)


def contradictions(settings: Settings) -> list[str]:
    """Settings that each can work, but not together: one asks for what another rules out."""
    found = []
    if settings.resolved_engine == "cosyvoice3" and not settings.model_dir:
        found.append("--engine cosyvoice3 needs --model-dir (a local CosyVoice model dir)")
    if settings.public and settings.host and is_loopback(settings.host):
        found.append(f"--public and --host {settings.host} contradict each other: drop one")
    if settings.no_auth and (settings.api_token_file or settings.ui_auth):
        found.append("--no-auth with --api-token-file or --ui-auth: drop --no-auth to require the credentials")
    if settings.mps_thread_percentage and not settings.mps:
        found.append("--mps-thread-percentage needs --mps: add --mps, or drop the percentage")
    if settings.asr == "sherpa-onnx" and not settings.asr_model:
        found.append("--asr sherpa-onnx needs --asr-model (a local sherpa-onnx model dir)")
    if bool(settings.canary_prompt) != bool(settings.canary_prompt_text.strip()):
        found.append("--canary-prompt and --canary-prompt-text go together: give the WAV and its transcript")
    return found


def limits_apart(settings: Settings) -> list[str]:
    """Pairs of limits in the wrong order: a lower bound above its upper one, or a whole too
    small for its part."""
    found = []
    if settings.min_instances and settings.max_instances and settings.min_instances > settings.max_instances:
        found.append(
            f"--min-instances {settings.min_instances} is above --max-instances {settings.max_instances}: "
            "lower one of them"
        )
    if settings.max_long_chars and settings.max_long_chars < settings.max_chars:
        found.append(
            f"--max-long-chars {settings.max_long_chars} is below --max-chars {settings.max_chars}: raise it, "
            "or 0 for no long texts"
        )
    if not size(" ", settings.max_body) and not size(" ", settings.max_upload):
        if parse_size(settings.max_upload) + 2**20 > parse_size(settings.max_body):
            found.append(
                f"--max-body {settings.max_body} cannot hold a --max-upload {settings.max_upload} prompt and the "
                "form around it: raise --max-body (at least 1MiB above --max-upload)"
            )
    return found
