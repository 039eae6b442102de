"""`aiflame doctor`: what this host supports and how to fix what is missing."""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from aiflame.core.errors import HostError

NAME = "doctor"
HELP = "check what this host supports and what to fix"
DESCRIPTION = ""
EXAMPLES = ""
__all__ = ["CHECKS", "DESCRIPTION", "EXAMPLES", "HELP", "NAME", "Check", "add_arguments", "run", "run_checks"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--pid", type=int, metavar="PID",
                   help="also show, per executable file PID maps, how much of its code the CFI unwinder covers")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show the daemon unit's hardening table (shown anyway when the unit is installed or "
                        "a daemon runs)")


def run(args: argparse.Namespace) -> int:
    console = Console()
    status = doctor(console)
    nvidia(console)
    daemon_hardening(console, verbose=args.verbose)
    if args.pid is not None:
        unwind_coverage(console, args.pid)
    return status


def nvidia(console: Console) -> None:
    """NVIDIA stall sampling on this host: driver, CUDA, GPUs, profiling permission, CUPTI and the collector's
    build (informational: a host without a GPU is ready to profile CPUs and to read GPU captures)."""
    from aiflame.agent.accel.nvidia_host import nvidia_checks

    table = Table(title="NVIDIA GPU stall sampling", title_justify="left")
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for c in nvidia_checks():
        table.add_row(c.name, "[green]ok[/]" if c.ok else "[yellow]no[/]", c.detail, c.fix)
    console.print(table)


def daemon_hardening(console: Console, verbose: bool = False) -> None:
    """The daemon's sandbox: the shipped unit's hardening against the installed one's, and what a running daemon
    has in fact (docs/daemon.md, "Security"). On a host without the unit or a daemon, one line unless `verbose`."""
    from aiflame.cli.unit_hardening import unit_table

    rows, daemons = unit_table()
    unit_installed = any(installed != "(not installed)" for _, _, installed in rows)
    if not (verbose or unit_installed or daemons):
        console.print("daemon: unit not installed, no daemon running (--verbose shows the unit's hardening)",
                      highlight=False)
        return
    table = Table(title="daemon unit hardening (deploy/aiflame-agent.service)", title_justify="left")
    for col in ("setting", "shipped", "installed"):
        table.add_column(col)
    for key, shipped, installed in rows:
        mark = "" if installed in (shipped, "(not installed)") else "[yellow]"
        table.add_row(key, shipped, f"{mark}{installed}")
    console.print(table)
    for d in daemons:
        console.print(f"running daemon pid {d.pid}: capability bounding set {' '.join(d.capabilities) or 'empty'}; "
                      f"no-new-privileges {'yes' if d.no_new_privs else '[yellow]no[/]'}; controlling terminal "
                      f"{'none' if not d.tty else f'[red]{d.tty:#x}[/]'}; memory limit {d.memory_limit}",
                      highlight=False, soft_wrap=True)
    if not daemons:
        console.print("no daemon running", highlight=False)


def unwind_coverage(console: Console, pid: int) -> None:
    """A table of the CFI unwinder's coverage of each file `pid` maps: what walks whole, what falls back."""
    from aiflame.agent.kernel.unwind import coverage

    table = Table(title=f"native unwinding of pid {pid}: CFI per mapped file", title_justify="left")
    for col in ("file", "code mapped", "CFI covers", "rows", "rules followed", "note"):
        table.add_column(col)
    for c in coverage(pid):
        share = f"{100 * min(c.covered_bytes, c.text_bytes) / c.text_bytes:.1f}%" if c.text_bytes else "-"
        note = c.error or ("" if c.rows else "no CFI: frame pointers only")
        table.add_row(c.path, f"{c.text_bytes >> 10} KiB", share if not c.error else "-", str(c.rows),
                      f"{100 * c.rules_followable:.1f}%" if c.rows else "-", note)
    console.print(table)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _root() -> Check:
    ok = os.geteuid() == 0
    return Check("root", ok, "running as root" if ok else f"running as uid {os.geteuid()}", "run as root (sudo)")


def _bcc() -> Check:
    try:
        import bcc

        return Check("bcc", True, f"bcc importable ({os.path.dirname(bcc.__file__)})")
    except ImportError as e:
        return Check("bcc", False, f"cannot import bcc: {e}", "make setup (installs python3-bpfcc, makes .venv)")


def _headers() -> Check:
    build = f"/lib/modules/{platform.release()}/build"
    ok = os.path.isdir(os.path.join(build, "include"))
    return Check("kernel headers", ok, build + (" -> " + os.path.realpath(build) if ok else " missing"),
                 "make setup (installs linux-headers-amd64 and links them)")


def _tracefs() -> Check:
    ok = os.path.exists("/sys/kernel/tracing/uprobe_events")
    return Check("tracefs", ok, "/sys/kernel/tracing" + (" mounted" if ok else " not mounted"),
                 "mount -t tracefs nodev /sys/kernel/tracing")


def _perf() -> Check:
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as f:
            level = f.read().strip()
    except OSError:
        return Check("perf events", False, "no /proc/sys/kernel/perf_event_paranoid", "a kernel with perf events")
    return Check("perf events", True, f"perf_event_paranoid={level} (root is exempt)")


def _uprobes() -> Check:
    ok = os.path.exists("/sys/bus/event_source/devices/uprobe/type")
    return Check("uprobes", ok, "uprobe PMU present" if ok else "no uprobe PMU", "a kernel with CONFIG_UPROBE_EVENTS",
                 required=False)


def _kprobes() -> Check:
    ok = os.path.exists("/sys/bus/event_source/devices/kprobe/type")
    return Check("kprobes", ok, "kprobe PMU present" if ok else "absent (aiflame does not need them)",
                 required=False)


def _btf() -> Check:
    ok = os.path.exists("/sys/kernel/btf/vmlinux")
    return Check("BTF", ok, "/sys/kernel/btf/vmlinux" + ("" if ok else " missing"), "CONFIG_DEBUG_INFO_BTF=y",
                 required=False)


def _kallsyms() -> Check:
    try:
        with open("/proc/kallsyms") as f:
            first = f.readline().split()
        ok = bool(first) and int(first[0], 16) != 0
    except (OSError, ValueError):
        ok = False
    return Check("kallsyms", ok, "kernel symbols readable" if ok else "addresses hidden",
                 "run as root, or sysctl kernel.kptr_restrict=0", required=False)


CHECKS: list[Callable[[], Check]] = [_root, _bcc, _headers, _tracefs, _perf, _uprobes, _btf, _kallsyms, _kprobes]


def run_checks() -> list[Check]:
    return [c() for c in CHECKS]


def doctor(console: Console) -> int:
    """Print every check; exit status 0 when all required ones pass, else 3 (the host is not set up)."""
    checks = run_checks()
    table = Table(title="aiflame doctor", title_justify="left")
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail")
    table.add_column("fix")
    for c in checks:
        status = "[green]ok[/]" if c.ok else ("[red]missing[/]" if c.required else "[yellow]optional[/]")
        table.add_row(c.name, status, c.detail, "" if c.ok else c.fix)
    console.print(table)
    bad = [c.name for c in checks if c.required and not c.ok]
    if bad:
        console.print(f"[red]not ready:[/] {', '.join(bad)}")
        return HostError.exit_code
    console.print("[green]ready to profile[/]")
    return 0
