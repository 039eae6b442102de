#!/usr/bin/env bash
# Install (or with --remove, uninstall) the always-on daemon from this checkout:
#   /usr/local/bin/aiflame -> .venv/bin/aiflame, the systemd unit, /etc/aiflame/aiflame.toml (kept if present),
#   then, where systemd runs, enable and start it. Idempotent; each step says what it does.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[install-agent] %s\n' "$*"; }
[ "$(id -u)" = 0 ] || { echo "aiflame install-agent: must run as root" >&2; exit 1; }

BIN=/usr/local/bin/aiflame
UNIT=/etc/systemd/system/aiflame-agent.service
CONF=/etc/aiflame/aiflame.toml
# systemd's own test for "booted with systemd" (sd_booted): this directory exists.
have_systemd() { [ -d /run/systemd/system ]; }

if [ "${1:-}" = "--remove" ]; then
    if have_systemd && systemctl list-unit-files aiflame-agent.service >/dev/null 2>&1; then
        say "stopping and disabling aiflame-agent"
        systemctl disable --now aiflame-agent || true
    fi
    for f in "$UNIT" "$BIN"; do
        if [ -e "$f" ] || [ -L "$f" ]; then say "removing $f"; rm -f "$f"; fi
    done
    have_systemd && systemctl daemon-reload
    say "kept $CONF and /var/lib/aiflame (windows and captures); remove them by hand if unwanted"
    exit 0
fi

[ -x .venv/bin/aiflame ] || { echo "aiflame install-agent: no .venv/bin/aiflame; run 'make setup' first" >&2; exit 1; }
say "linking $BIN -> $(pwd)/.venv/bin/aiflame"
ln -sfn "$(pwd)/.venv/bin/aiflame" "$BIN"
say "installing $UNIT"
install -m 0644 deploy/aiflame-agent.service "$UNIT"
if [ -e "$CONF" ]; then
    say "keeping the existing $CONF"
else
    say "installing $CONF (the defaults, commented)"
    install -D -m 0644 deploy/aiflame.toml "$CONF"
fi
"$BIN" agent --check --config "$CONF" >/dev/null
say "configuration $CONF is valid"
if have_systemd; then
    systemctl daemon-reload
    if systemctl is-active --quiet aiflame-agent; then
        say "restarting the running aiflame-agent (new code and unit)"
        systemctl enable aiflame-agent
        systemctl restart aiflame-agent
    else
        say "enabling and starting aiflame-agent (systemctl enable --now)"
        systemctl enable --now aiflame-agent
    fi
    say "running: 'systemctl status aiflame-agent', 'journalctl -u aiflame-agent -f', 'aiflame status'"
else
    say "systemd is not running on this host: start the daemon with 'aiflame agent --config $CONF'"
fi
