#!/usr/bin/env bash
# cosyvoice-lb from a checkout, on a fresh Debian/Ubuntu box.
#
#   ./run.sh up [options]     start the service (embedded espeak engine unless told otherwise)
#   ./run.sh test [args]      run the test suite (args go to pytest; also installs chromium, redis-server)
#   ./run.sh install          only set things up: system packages, .venv, the package
#   ./run.sh <command> ...    any other cosyvoice-lb command: plan, render, status, down, ...
#
# It installs nginx and espeak-ng with apt when they are missing (as root; otherwise it
# prints the exact command), makes .venv and installs cosyvoice-lb into it. The checkout
# is the state dir unless COSYVOICE_LB_STATE_DIR says otherwise: logs/ and nginx/ fill up
# here, run/ holds sockets and state.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${COSYVOICE_LB_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"

say() { printf '%s\n' "$*" >&2; }

POLICY_RC=/usr/sbin/policy-rc.d

# Debian's prometheus, prometheus-alertmanager and redis-server packages are servers: their
# install starts one (Prometheus on every address, :9090) and enables it at boot. The tests
# need promtool, amtool, and the Alertmanager and redis-server binaries they start themselves
# on loopback, not services: a policy-rc.d that refuses every start (exit 101) stands for the
# install (unless the box has its own), the services are disabled afterwards, and recommends
# (node-exporter, another server) are left out.
install_servers() {
    local ours=""
    if [ ! -e "$POLICY_RC" ]; then
        trap 'rm -f "$POLICY_RC"' EXIT  # removed even when apt-get fails
        printf '#!/bin/sh\n# cosyvoice-lb ./run.sh: no service starts while it installs packages\nexit 101\n' >"$POLICY_RC"
        chmod 755 "$POLICY_RC"
        ours=1
    fi
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    local pkg
    for pkg in "$@"; do
        if command -v deb-systemd-helper >/dev/null 2>&1; then
            deb-systemd-helper disable "$pkg.service" >/dev/null 2>&1 || true
        fi
        if command -v update-rc.d >/dev/null 2>&1; then
            update-rc.d "$pkg" disable >/dev/null 2>&1 || true
        fi
    done
    if [ -n "$ours" ]; then
        rm -f "$POLICY_RC"
        trap - EXIT
    fi
}

system_packages() {
    local missing=()
    # The tests drive the UI in a real headless browser, and check the rendered Prometheus
    # config and alert rules with promtool (Debian ships it in the prometheus package).
    # With ffmpeg on the PATH Gradio changes how it delivers audio: the tests run with it,
    # as most boxes that serve audio have it.
    if [ "${1:-}" = test ]; then
        command -v chromium >/dev/null 2>&1 || missing+=(chromium)
        command -v ffmpeg >/dev/null 2>&1 || missing+=(ffmpeg)
        command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
        # the alerts' way to a webhook (up --alertmanager) and its config's check (amtool)
        command -v amtool >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
        command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
        # `systemd-analyze verify` checks the boot unit `service install` writes
        command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
        # the flite engine's tests (real speech that the speech check's recogniser understands)
        command -v flite >/dev/null 2>&1 || missing+=(flite)
    fi
    command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
    command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
    command -v "$PYTHON" >/dev/null 2>&1 || missing+=(python3)
    if command -v "$PYTHON" >/dev/null 2>&1 && ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        missing+=(python3-venv)
    fi
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -eq 0 ]; then
        say "installing ${missing[*]} with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        local pkg plain=() servers=()
        for pkg in "${missing[@]}"; do
            case "$pkg" in
                prometheus | prometheus-alertmanager | redis-server) servers+=("$pkg") ;;
                *) plain+=("$pkg") ;;
            esac
        done
        [ ${#plain[@]} -eq 0 ] || apt-get install -y -qq "${plain[@]}" >/dev/null
        [ ${#servers[@]} -eq 0 ] || install_servers "${servers[@]}"
    else
        say "cosyvoice-lb needs: ${missing[*]}. Install them with:"
        say "  sudo apt-get update && sudo apt-get install -y ${missing[*]}"
        if [[ " ${missing[*]} " == *" prometheus "* ]]; then
            say "  (the tests need only its promtool: stop the server it starts with"
            say "   sudo systemctl disable --now prometheus)"
        fi
        if [[ " ${missing[*]} " == *" prometheus-alertmanager "* ]]; then
            say "  (the tests start their own Alertmanager on loopback: stop the service with"
            say "   sudo systemctl disable --now prometheus-alertmanager)"
        fi
        if [[ " ${missing[*]} " == *" redis-server "* ]]; then
            say "  (the tests start their own redis-server on loopback: stop the service with"
            say "   sudo systemctl disable --now redis-server)"
        fi
        exit 1
    fi
}

python_ok() {
    "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' || {
        say "cosyvoice-lb needs Python 3.10 or newer; $PYTHON is $("$PYTHON" --version 2>&1)"
        exit 1
    }
}

venv() {
    python_ok
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    # Reinstall when the package's metadata or the dev tools' pins changed (editable: code
    # changes need nothing).
    local stamp="$VENV/.cosyvoice-lb-installed" constraints="$HERE/constraints-dev.txt"
    if [ ! -f "$stamp" ] || [ "$HERE/setup.cfg" -nt "$stamp" ] || [ "$HERE/pyproject.toml" -nt "$stamp" ] ||
       [ "$constraints" -nt "$stamp" ]; then
        say "installing cosyvoice-lb and its dependencies into $VENV (log: $VENV/install.log)"
        if ! { "$VENV/bin/python" -m pip install --upgrade pip &&
               "$VENV/bin/python" -m pip install -c "$constraints" -e "$HERE[test]"; } >"$VENV/install.log" 2>&1; then
            tail -n 30 "$VENV/install.log" >&2
            say "pip could not install cosyvoice-lb; the full log is $VENV/install.log"
            exit 1
        fi
        touch "$stamp"
    fi
}

command="${1:-up}"
[ $# -gt 0 ] && shift
system_packages "$command"
venv
case "$command" in
    install)
        say "ready: $VENV/bin/cosyvoice-lb"
        ;;
    test)
        # The contract fake of upstream CosyVoice yields torch tensors: a CPU torch is enough.
        if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
            say "installing a CPU torch for the CosyVoice contract tests (log: $VENV/install.log)"
            "$VENV/bin/python" -m pip install "torch==2.13.0" >>"$VENV/install.log" 2>&1 || {
                tail -n 20 "$VENV/install.log" >&2; exit 1; }
        fi
        cd "$HERE"
        # pytest keeps each test module's rewritten asserts in __pycache__, and the CLI and
        # instances the tests start their compiled modules: with PYTHONDONTWRITEBYTECODE set
        # (some shells and images set it) every run compiles them all again.
        exec env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -m pytest "$@"
        ;;
    *)
        export COSYVOICE_LB_STATE_DIR="${COSYVOICE_LB_STATE_DIR:-$HERE}"
        # what `up` prints as the way to run the next command (the venv is not on PATH)
        export COSYVOICE_LB_INVOKED_AS="${COSYVOICE_LB_INVOKED_AS:-$0}"
        exec "$VENV/bin/cosyvoice-lb" "$command" "$@"
        ;;
esac
