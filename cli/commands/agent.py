"""`aiflame agent`: run the always-on daemon (agent/daemon/), or check its configuration."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiflame.cli.daemon_args import EXAMPLES

NAME = "agent"
HELP = "the always-on root daemon (rolling low-rate windows, on-demand captures)"
DESCRIPTION = ("Profile accelerator processes continuously at a low rate, in rolling windows with retention, and "
               "take high-resolution captures on request (aiflame trigger). Runs as root; SIGHUP reloads the "
               "configuration, SIGTERM stops cleanly.")
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML configuration (default /etc/aiflame/aiflame.toml when present, else defaults)")
    p.add_argument("--check", action="store_true", help="validate the configuration, print it and exit")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from aiflame.agent.daemon.config import load_config
    from aiflame.agent.daemon.server import run_daemon
    from aiflame.core import limits

    if args.check:
        cfg = load_config(args.config)
        Console(highlight=False).print(f"{escape(cfg.source)}: ok\n{escape(repr(cfg))}", soft_wrap=True)
        return 0
    limits.use(limits.AGENT_LIMITS)  # we read what the targets point us at, as root
    return run_daemon(args.config)
