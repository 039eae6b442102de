"""`aiflame status`: what the running daemon is doing, as a table or its raw JSON."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiflame.cli.daemon_args import EXAMPLES, add_socket, ask

NAME = "status"
HELP = "what the running daemon is doing"
DESCRIPTION = ""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="the raw status as JSON")
    add_socket(p)


def run(args: argparse.Namespace) -> int:
    from aiflame.agent.daemon.protocol import StatusRequest

    data = ask(args.socket, StatusRequest(), 10.0)
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
