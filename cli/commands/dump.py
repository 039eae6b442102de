"""`aiflame dump`: every thread's stack of a running process, now (agent/dump.py), with its state and whether it
holds the GIL; Python frames merged into the native stack, leaf first, as py-spy dump prints them."""

from __future__ import annotations

import argparse
import json
import sys

from aiflame.cli import argtypes
from aiflame.core.model import FrameKind

NAME = "dump"
HELP = "print every thread's stack of a running process now (Python merged), with its state"
DESCRIPTION = ("Stops the process's threads for the few milliseconds it takes to read their registers and stacks "
               "(ptrace, as py-spy does; --nonblocking reads Python frames only, without stopping anything).")
EXAMPLES = """examples:
  aiflame dump --pid 1234             every thread, leaf first, Python and native frames
  aiflame dump --pid 1234 --json      the same as JSON
"""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--pid", type=argtypes.pid, required=True, help="the process to dump")
    p.add_argument("--nonblocking", action="store_true",
                   help="do not stop the process: Python frames only, possibly torn while threads run")
    p.add_argument("--no-native", action="store_true", help="Python frames only (still stops the process)")
    p.add_argument("--all-frames", action="store_true",
                   help="keep the interpreter's own native frames (by default they fold away, as in profiles)")
    p.add_argument("--json", action="store_true", help="print JSON: one object with a list of threads")


def run(args: argparse.Namespace) -> int:
    from aiflame.agent.dump import dump_process
    from aiflame.agent.preflight import check_pid, check_root
    from aiflame.core import limits
    from aiflame.symbolize.native import NativeSymbolizer

    limits.use(limits.AGENT_LIMITS)  # we read what the target points us at, as root
    check_root()
    check_pid(args.pid)
    native = NativeSymbolizer(debug_dirs=["/usr/lib/debug"])
    res = dump_process(args.pid, native, stop=not args.nonblocking, native_stacks=not args.no_native,
                       fold=not args.all_frames)
    if args.json:
        doc = {"pid": res.pid, "command": res.command, "python": res.python, "gil_known": res.gil_known,
               "skipped_threads": res.skipped_threads, "notes": res.notes,
               "stopped_s": round(res.stopped_s, 6),
               "threads": [{"tid": t.tid, "name": t.name, "state": t.state, "gil": t.gil,
                            "waits_for_gil": t.waits_for_gil, "notes": t.notes,
                            "frames": [{"name": f.name, "kind": f.kind.name.lower(), "module": f.module,
                                        "file": f.file, "line": f.line} for f in reversed(t.stack)]}
                           for t in res.threads]}
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    held = f" (threads stopped for {1000 * res.stopped_s:.1f} ms)" if res.stopped_s else ""
    out = [f"Process {res.pid}: {res.command}{held}"]
    if res.python:
        out.append(f"Python: {res.python}" + ("" if res.gil_known else " (GIL holder unknown)"))
    out.extend(f"note: {n}" for n in res.notes)
    for t in res.threads:
        flags = " [holds GIL]" if t.gil else " [waits for GIL]" if t.waits_for_gil else ""
        out.append("")
        out.append(f"Thread {t.tid} ({t.state}) {t.name!r}{flags}")
        for f in reversed(t.stack):
            if f.kind == FrameKind.PYTHON:
                out.append(f"    {f.name} ({f.file}:{f.line})")
            else:
                out.append(f"    {f.name} ({f.module})" if f.module and f.module not in f.name else f"    {f.name}")
        if not t.stack:
            out.append("    (exited while dumped)" if t.state == "exited" else
                       "    (no Python frames; native frames not read)" if args.no_native or args.nonblocking else
                       "    (no stack)")
        out.extend(f"    note: {n}" for n in t.notes)
    if res.skipped_threads:
        out.append(f"\n… {res.skipped_threads} more threads not dumped")
    sys.stdout.write("\n".join(_printable(line) for line in out) + "\n")
    return 0


def _printable(line: str) -> str:
    """Names come from the target: no terminal control characters through."""
    return "".join(c if c.isprintable() or c == "\t" else f"\\x{ord(c):02x}" for c in line)
