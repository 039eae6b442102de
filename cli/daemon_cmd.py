"""`aiflame agent`, `aiflame trigger`, `aiflame status` and `aiflame top`: the always-on daemon and its clients.

Only wiring: the work is in agent/daemon/. `add_parser` registers the four subcommands; `run` executes them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiflame.agent.daemon.config import ConfigError, ControlConfig
from aiflame.agent.daemon.protocol import (
    ProtocolError,
    Response,
    StatusRequest,
    TriggerRequest,
    request,
)
from aiflame.cli import argtypes

__all__ = ["add_parser", "run", "COMMANDS"]

COMMANDS = ("agent", "trigger", "status", "top")
DEFAULT_SOCKET = str(ControlConfig().socket)

EXAMPLES = """examples:
  aiflame agent                                 run the daemon with /etc/aiflame/aiflame.toml or defaults
  aiflame agent --config ./aiflame.toml         run it with another configuration
  aiflame trigger --pid 4242 -d 30 -F 499       a 30 s high-resolution capture of one process
  aiflame trigger --all --chakra                every watched process, default duration, Chakra too
  aiflame status                                watched processes, rates, windows, losses, daemon cost
  aiflame top --pid 4242                        live view of the hottest stacks, kernels and collectives
"""


def _add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"the daemon's control socket (default {DEFAULT_SOCKET})")


def add_parser(subparsers: Any) -> None:
    """Register `agent`, `trigger`, `status` and `top` on the aiflame parser's `add_subparsers()` object."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "agent", help="the always-on root daemon (rolling low-rate windows, on-demand captures)",
        description="Profile accelerator processes continuously at a low rate, in rolling windows with "
        "retention, and take high-resolution captures on request (aiflame trigger). Runs as root; SIGHUP "
        "reloads the configuration, SIGTERM stops cleanly.", epilog=EXAMPLES, formatter_class=fmt)
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML configuration (default /etc/aiflame/aiflame.toml when present, else defaults)")
    p.add_argument("--check", action="store_true", help="validate the configuration, print it and exit")

    t = subparsers.add_parser("trigger", help="ask the running daemon for a high-resolution capture",
                              epilog=EXAMPLES, formatter_class=fmt)
    which = t.add_mutually_exclusive_group(required=True)
    which.add_argument("-p", "--pid", type=argtypes.pid, action="append", help="process to capture (repeatable)")
    which.add_argument("--all", action="store_true", help="every process the daemon watches")
    t.add_argument("-d", "--duration", type=argtypes.positive_float, help="seconds (default: the daemon's, 10)")
    t.add_argument("-F", "--frequency", type=argtypes.frequency,
                   help="samples per second per CPU (default: the daemon's, 99)")
    t.add_argument("--chakra", action="store_true", help="also write Chakra execution traces")
    _add_socket(t)

    s = subparsers.add_parser("status", help="what the running daemon is doing", epilog=EXAMPLES,
                              formatter_class=fmt)
    s.add_argument("--json", action="store_true", help="the raw status as JSON")
    _add_socket(s)

    top = subparsers.add_parser("top", help="live view of the hottest stacks, kernels and collectives",
                                epilog=EXAMPLES, formatter_class=fmt)
    top.add_argument("-p", "--pid", type=argtypes.pid, help="only this process (default: what the daemon watches, or "
                     "every process when no daemon runs)")
    top.add_argument("-i", "--interval", type=argtypes.positive_float, default=2.0,
                     help="seconds between updates of the own collector (default 2)")
    top.add_argument("-F", "--frequency", type=argtypes.frequency, default=49,
                     help="sampling rate of the own collector (default 49)")
    top.add_argument("-n", "--iterations", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N
    top.add_argument("--own", action="store_true", help="use an own collector even when a daemon runs")
    _add_socket(top)


def _err(msg: str, code: int = 1) -> int:
    Console(stderr=True).print(f"[bold red]aiflame: error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return code


def run(args: argparse.Namespace) -> int:
    """Execute one of COMMANDS; 0 on success, 1 on an error (printed as one line), 2 on misuse."""
    try:
        if args.cmd == "agent":
            return _agent(args)
        if args.cmd == "trigger":
            return _trigger(args)
        if args.cmd == "status":
            return _status(args)
        if args.cmd == "top":
            from aiflame.agent.daemon.top import run_top

            return run_top(args)
    except (ConfigError, ProtocolError) as e:
        return _err(str(e))
    except KeyboardInterrupt:
        return _err("interrupted", 130)
    return _err(f"unknown command {args.cmd}", 2)


def _agent(args: argparse.Namespace) -> int:
    from aiflame.agent.daemon.config import load_config
    from aiflame.agent.daemon.server import DaemonError, run_daemon
    from aiflame.agent.kernel.sampler import SamplerError

    if args.check:
        cfg = load_config(args.config)
        Console(highlight=False).print(f"{escape(cfg.source)}: ok\n{escape(repr(cfg))}", soft_wrap=True)
        return 0
    try:
        return run_daemon(args.config)
    except (DaemonError, SamplerError) as e:
        return _err(str(e))


def _check(resp: Response) -> dict[str, Any]:
    if not resp.ok:
        raise ProtocolError(resp.error or "the daemon refused the request")
    return resp.data


def _trigger(args: argparse.Namespace) -> int:
    req = TriggerRequest(tuple(args.pid or ()), bool(args.all), args.duration, args.frequency, args.chakra)
    err = Console(stderr=True)
    wait = (args.duration or 600.0) + 180.0
    with err.status("capturing…") if err.is_terminal else _Null():
        data = _check(request(args.socket, req, wait))
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"capture: {escape(data.get('dir', ''))}")
    out.print(f"  samples {data.get('samples', 0)}  runtime events {data.get('events', 0)}  "
              f"lost {data.get('lost', 0)}  stopped: {escape(str(data.get('stop_reason', '')))}")
    for f in [data.get("capture", ""), *data.get("files", [])]:
        out.print(f"  wrote {escape(str(f))}")
    for n in data.get("notes", []):
        err.print(f"[yellow]note:[/] {escape(str(n))}", highlight=False)
    return 0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _status(args: argparse.Namespace) -> int:
    data = _check(request(args.socket, StatusRequest(), 10.0))
    if args.json:
        import json

        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"aiflame agent pid {data.get('pid')}  up {data.get('uptime_s', 0):.0f} s  "
              f"config {escape(str(data.get('config')))}  output {escape(str(data.get('output')))}")
    out.print(f"continuous: {data.get('frequency_hz')} Hz, windows of {data.get('window_s')} s, "
              f"runtime probes {'on' if data.get('runtimes') else 'off'}; "
              f"{data.get('windows_written', 0)} windows written, {data.get('captures_written', 0)} captures"
              + ("  (a capture is running)" if data.get("capture_running") else ""))
    c = data.get("counters", {})
    out.print(f"samples {data.get('samples_total', 0)}  lost {c.get('lost', 0)}  "
              f"user-stack errors {c.get('ustack_err', 0)}  process events lost {c.get('proc_lost', 0)}  "
              f"runtime calls lost {c.get('call_lost', 0)}")
    out.print(f"agent: CPU {data.get('agent_cpu_s', 0):.2f} s ({data.get('agent_cpu_pct', 0):.3f}% of a core)  "
              f"RSS {data.get('rss_mb', 0):.0f} MB  probed libraries {data.get('probed_libraries', 0)}  "
              f"exports pending {data.get('exports_pending', 0)} skipped {data.get('exports_skipped', 0)}")
    table = Table(title=f"watched processes ({data.get('target_count', 0)})", title_justify="left")
    for col in ("pid", "process", "runtimes", "via"):
        table.add_column(col)
    for t in data.get("targets", []):
        table.add_row(str(t.get("pid")), escape(str(t.get("comm", ""))), ",".join(t.get("runtimes", [])),
                      str(t.get("via", "")))
    out.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """These four commands alone (`python -m aiflame.cli.daemon_cmd agent ...`), as `aiflame` runs them."""
    import sys

    parser = argparse.ArgumentParser(prog="aiflame")
    add_parser(parser.add_subparsers(dest="cmd", metavar="COMMAND", required=True))
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
