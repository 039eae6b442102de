"""`aiflame top`: the live view of the hottest stacks, kernels and collectives (agent/daemon/top.py), from the
running daemon's windows or an own low-rate collector."""

from __future__ import annotations

import argparse

from aiflame.cli import argtypes
from aiflame.cli.daemon_args import EXAMPLES, add_socket

NAME = "top"
HELP = "live view of the hottest functions (self and total), stacks, kernels and collectives"
DESCRIPTION = ""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--pid", type=argtypes.pid, help="only this process (default: what the daemon watches, or "
                   "every process when no daemon runs)")
    p.add_argument("-i", "--interval", type=argtypes.positive_float, default=2.0,
                   help="seconds between updates of the own collector (default 2)")
    p.add_argument("-F", "--frequency", type=argtypes.frequency, default=49,
                   help="sampling rate of the own collector (default 49)")
    p.add_argument("-n", "--iterations", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N
    p.add_argument("--own", action="store_true", help="use an own collector even when a daemon runs")
    add_socket(p)


def run(args: argparse.Namespace) -> int:
    from aiflame.agent.daemon.top import run_top

    return run_top(args)
