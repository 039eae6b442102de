"""`aiflame trigger`: ask the running daemon for a high-resolution capture and say where it went."""

from __future__ import annotations

import argparse
import contextlib
import time

from rich.console import Console
from rich.markup import escape

from aiflame.cli import argtypes
from aiflame.cli.daemon_args import EXAMPLES, add_socket, ask

NAME = "trigger"
HELP = "ask the running daemon for a high-resolution capture"
DESCRIPTION = ""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("-p", "--pid", type=argtypes.pid, action="append", help="process to capture (repeatable)")
    which.add_argument("--all", action="store_true", help="every process the daemon watches")
    p.add_argument("-d", "--duration", type=argtypes.positive_float, help="seconds (default: the daemon's, 10)")
    p.add_argument("-F", "--frequency", type=argtypes.frequency,
                   help="samples per second per CPU (default: the daemon's, 99)")
    p.add_argument("--chakra", action="store_true", help="also write Chakra execution traces")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--at", type=argtypes.wall_time, metavar="TIME",
                      help="start the window at TIME (ISO 8601 with a zone, or epoch seconds): the same TIME on "
                           "every node of a job gives windows over the same steps (clocks as NTP/PTP keep them)")
    when.add_argument("--in", dest="in_s", type=argtypes.positive_float, metavar="SECONDS",
                      help="start the window SECONDS from now")
    add_socket(p)


def run(args: argparse.Namespace) -> int:
    from aiflame.agent.daemon.protocol import TriggerRequest

    at = args.at if args.in_s is None else time.time_ns() + round(args.in_s * 1e9)
    req = TriggerRequest(tuple(args.pid or ()), bool(args.all), args.duration, args.frequency, args.chakra, at)
    err = Console(stderr=True)
    wait = (args.duration or 600.0) + 180.0 + (max(0.0, (at - time.time_ns()) / 1e9) if at else 0.0)
    with err.status("capturing…") if err.is_terminal else contextlib.nullcontext():
        data = ask(args.socket, req, wait)
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"capture: {escape(data.get('dir', ''))}")
    if at and isinstance(data.get("started_ns"), int):
        out.print(f"  started {(data['started_ns'] - at) / 1e6:+.1f} ms from the time asked for")
    out.print(f"  samples {data.get('samples', 0)}  runtime events {data.get('events', 0)}  "
              f"lost {data.get('lost', 0)}  stopped: {escape(str(data.get('stop_reason', '')))}")
    for f in [data.get("capture", ""), *data.get("files", [])]:
        out.print(f"  wrote {escape(str(f))}")
    for n in data.get("notes", []):
        err.print(f"[yellow]note:[/] {escape(str(n))}", highlight=False)
    return 0
