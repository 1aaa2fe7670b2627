"""What `up` changes on a running cluster, in words (said before it acts), and the safe
order for access changes: credentials are never removed while nginx listens beyond
loopback, and nginx never widens before the credentials are in force.

`up` applies the settings it is given, defaults included: a plain `up` on a cluster started
with `--public` brings it back to loopback without credentials (said first).
"""

from __future__ import annotations

import dataclasses

from cosyvoice_lb.common.settings import Settings

# Settings whose change is said in their own words below (not as "--name: a -> b").
_ACCESS = ("host", "public", "port", "no_auth", "api_token_file", "ui_auth")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value) if value in ("", None) else str(value)


def described(old: Settings, new: Settings) -> list[str]:
    """One line per change, access first; none when nothing changes."""
    lines = []
    if (old.listen_host, old.port) != (new.listen_host, new.port):
        who = "other machines too" if new.exposed else "this box only"
        lines.append(
            f"nginx moves from {old.listen_host}:{old.port} to {new.listen_host}:{new.port} (reachable: {who})"
        )
    if old.auth_required != new.auth_required:
        lines.append(
            "credentials: " + ("now required" if new.auth_required else "no longer required (anyone on this box)")
        )
    elif new.auth_required and (old.api_token_file, old.ui_auth) != (new.api_token_file, new.ui_auth):
        lines.append("credentials: other token file or UI users")
    if new.exposed and not new.auth_required and not (old.exposed and not old.auth_required):
        lines.append(f"WARNING: open to anyone who reaches {new.listen_host}:{new.port} (--no-auth)")
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    for name in sorted(after):
        if name not in _ACCESS and before.get(name) != after[name]:
            lines.append(f"{_flag(name)}: {_value(before.get(name))} -> {_value(after[name])}")
    return lines


def guard_step(old: Settings, new: Settings, generated_token: str) -> Settings | None:
    """The settings to pass through first when the listener moves and credentials turn on
    or off together: the new settings with credentials in force and nginx still where it was
    (turning on: tighten first, widen last) or already where it goes (turning off: back on
    loopback before the credentials go). ``generated_token``: the generated token file,
    standing in for it while the new settings ask for none. None: one step is safe."""
    moves = (old.listen_host, old.port) != (new.listen_host, new.port)
    if not moves or old.auth_required == new.auth_required:
        return None
    tightening = new.auth_required
    held = new if tightening else old  # whose credentials are in force meanwhile
    host, port = (old.listen_host, old.port) if tightening else (new.listen_host, new.port)
    return dataclasses.replace(
        new,
        host=host,
        port=port,
        public=False,
        no_auth=False,
        api_token_file=held.api_token_file or ("" if held.ui_auth else generated_token),
        ui_auth=held.ui_auth,
    )
