"""`aiflame top`: a live terminal view of the hottest stacks, kernels and collectives. It reads the running
daemon's newest windows, or, without a daemon (or with --own), runs its own short collector and shows each
few-second segment as it ends. `q` or Ctrl-C quits."""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import tempfile
import termios
import time
import tty
from collections import Counter
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from aiflame.agent.daemon.protocol import LatestRequest, StatusRequest, request
from aiflame.core.errors import BadInput, Unreadable
from aiflame.core.model import EventKind, Frame, FrameKind, Profile
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.road import open_capture, symbolizer

_SKIP = (FrameKind.PROCESS, FrameKind.SEPARATOR)


@dataclass
class TopView:
    """What one update shows, computed from a symbolized profile."""

    source: str
    samples: int = 0
    stacks: list[tuple[int, str, str]] = field(default_factory=list)  # weight, leaf, callers (nearest first)
    functions: list[tuple[int, int, str]] = field(default_factory=list)  # self, total, function
    kernels: list[tuple[int, str]] = field(default_factory=list)
    collectives: list[tuple[int, int, str]] = field(default_factory=list)  # calls, bytes, name
    lost: int = 0


def function_label(f: Frame) -> str:
    """A function as `top` names it: Python ones with their file, native ones with their binary."""
    where = os.path.basename(f.file) if f.kind == FrameKind.PYTHON and f.file else f.module
    return f"{f.name} ({where})" if where and where not in f.name else f.name


def view_of(prof: Profile, source: str, pid: int | None = None, top: int = 12) -> TopView:
    """The hottest stacks (their leaf, and callers nearest first), the functions by self and total samples (as
    py-spy top ranks them: self = the leaf, total = anywhere in the stack, once per sample), kernels by launches
    and collectives by bytes, of `pid` or everything."""
    v = TopView(source)
    stacks: Counter[tuple[str, str]] = Counter()
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for s in prof.samples:
        if pid is not None and s.pid != pid:
            continue
        frames = [f for f in s.stack if f.kind not in _SKIP]
        names = [function_label(f) for f in frames]
        leaf = names[-1] if names else "[no frames]"
        callers = " ← ".join(reversed(names[:-1]))
        stacks[((s.comm + ": " if s.comm else "") + leaf, callers)] += s.weight
        v.samples += s.weight
        if names:
            own[leaf] += s.weight
            for n in set(names):
                total[n] += s.weight
    v.stacks = [(w, leaf, callers) for (leaf, callers), w in stacks.most_common(top)]
    ranked = sorted(total, key=lambda n: (-own[n], -total[n], n))[:top]
    v.functions = [(own[n], total[n], n) for n in ranked]
    kernels: Counter[str] = Counter()
    coll: dict[str, list[int]] = {}
    for e in prof.events:
        if pid is not None and e.pid != pid:
            continue
        if e.kind == EventKind.COMPUTE:
            kernels[e.name] += e.calls
        elif e.kind == EventKind.COLLECTIVE:
            c = coll.setdefault(e.name, [0, 0])
            c[0] += 1
            b = e.args.get("bytes", 0)
            c[1] += int(b) if isinstance(b, int | float) else 0
    v.kernels = [(n, k) for k, n in kernels.most_common(top)]
    v.collectives = sorted(((c, b, n) for n, (c, b) in coll.items()), key=lambda x: -x[1])[:top]
    v.lost = prof.counters.get("lost", 0)
    return v


def render(v: TopView) -> Group:
    share = max(v.samples, 1)
    funcs = Table(title=f"functions by self time — {escape(v.source)} — {v.samples} samples, lost {v.lost}",
                  title_justify="left", expand=True)
    funcs.add_column("%self", justify="right", min_width=6, no_wrap=True)
    funcs.add_column("%total", justify="right", min_width=6, no_wrap=True)
    funcs.add_column("self", justify="right", min_width=5, no_wrap=True)
    funcs.add_column("total", justify="right", min_width=5, no_wrap=True)
    funcs.add_column("function", overflow="fold")  # never cut: a long name wraps
    for own, tot, name in v.functions:
        funcs.add_row(f"{100 * own / share:.1f}", f"{100 * tot / share:.1f}", str(own), str(tot), escape(name))
    stacks = Table(title="hottest stacks", title_justify="left", expand=True)
    stacks.add_column("%", justify="right", min_width=5, no_wrap=True)
    stacks.add_column("samples", justify="right", min_width=7, no_wrap=True)
    stacks.add_column("leaf", overflow="fold", ratio=1)  # the leaf whole (it wraps); the callers are what is cut
    stacks.add_column("called from (nearest first)", overflow="ellipsis", no_wrap=True, ratio=1)
    for w, leaf, callers in v.stacks:
        stacks.add_row(f"{100 * w / share:.1f}", str(w), escape(leaf), escape(callers))
    parts: list[Table | Text] = [funcs, stacks]
    if v.kernels:
        k = Table(title="kernels by launches", title_justify="left")
        k.add_column("launches", justify="right")
        k.add_column("kernel", overflow="ellipsis", no_wrap=True)
        for n, name in v.kernels:
            k.add_row(str(n), escape(name))
        parts.append(k)
    if v.collectives:
        c = Table(title="collectives", title_justify="left")
        c.add_column("calls", justify="right")
        c.add_column("bytes", justify="right")
        c.add_column("collective")
        for calls, b, name in v.collectives:
            c.add_row(str(calls), str(b), escape(name))
        parts.append(c)
    parts.append(Text("q or Ctrl-C to quit", style="dim"))
    return Group(*parts)


@contextmanager
def _keys() -> Iterator[bool]:
    """Single keypresses from a terminal (cbreak mode, restored on exit); False when stdin is no terminal."""
    if not sys.stdin.isatty():
        yield False
        return
    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _wait_key(seconds: float, keys: bool) -> bool:
    """Sleep up to `seconds`; True when `q` was pressed."""
    if not keys:
        time.sleep(seconds)
        return False
    end = time.monotonic() + seconds
    while True:  # at least one look, even for 0 seconds
        ready, _, _ = select.select([sys.stdin], [], [], max(end - time.monotonic(), 0))
        if ready and os.read(sys.stdin.fileno(), 1) in (b"q", b"Q"):
            return True
        if time.monotonic() >= end:
            return False


def _daemon_views(args: argparse.Namespace, native: NativeSymbolizer) -> Generator[TopView | None]:
    last = ""
    while True:
        resp = request(args.socket, LatestRequest(1), 10.0)
        windows = resp.data.get("windows", []) if resp.ok else []
        if windows and windows[-1] != last:
            last = windows[-1]
            try:
                prof = open_capture(Path(last) / "profile.aiflame", native=native).profile
                yield view_of(prof, f"daemon window {Path(last).name}", args.pid)
                continue
            except Unreadable:
                pass  # deleted by retention in between: the next one will do
        yield None


def _own_views(args: argparse.Namespace, native: NativeSymbolizer) -> Generator[TopView | None]:
    from aiflame.agent.daemon.collector import Collector
    from aiflame.agent.kernel.sampler import SamplerConfig
    from aiflame.agent.preflight import check_pid, check_root, check_tracefs

    check_root()
    check_tracefs()
    if args.pid is not None:
        check_pid(args.pid)
    sampler = SamplerConfig(frequency=args.frequency, event="cpu-clock", all_processes=args.pid is None)
    # Runtime probes stop a target at library opens: only for a chosen process, never host-wide.
    collector = Collector(sampler, runtimes=args.pid is not None, label="top")
    collector.start()
    try:
        if args.pid is not None:
            collector.add_target(args.pid)
        with tempfile.TemporaryDirectory(prefix="aiflame-top-") as tmp:
            seg = Path(tmp) / "segment.aiflame"
            while True:
                collector.open_window(seg)
                end = time.monotonic() + args.interval
                while (left := end - time.monotonic()) > 0:
                    collector.tick(min(left, 0.1))
                collector.close_window("segment")
                prof = open_capture(seg, native=native).profile
                what = f"pid {args.pid}" if args.pid is not None else "all processes"
                yield view_of(prof, f"{what}, last {args.interval:g} s at {args.frequency} Hz", args.pid)
    finally:
        collector.close()


def run_top(args: argparse.Namespace) -> int:
    """Run the live view until `q`, Ctrl-C, or (tests) `--iterations` updates."""
    native = symbolizer()
    use_daemon = False
    if not args.own:
        try:
            use_daemon = request(args.socket, StatusRequest(), 5.0).ok
        except BadInput:
            use_daemon = False
    views = _daemon_views(args, native) if use_daemon else _own_views(args, native)
    # Ctrl-C quits even when started with SIGINT ignored (inherited, e.g. from a background job's shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    console = Console()
    shown = 0
    try:
        with _keys() as keys, Live(Text("collecting…"), console=console, auto_refresh=False,
                                   transient=False) as live:
            for v in views:
                if v is not None:
                    live.update(render(v), refresh=True)
                    shown += 1
                    if args.iterations and shown >= args.iterations:
                        break
                if _wait_key(args.interval if use_daemon else 0.0, keys):
                    break
    except KeyboardInterrupt:
        pass  # Ctrl-C is a way to quit, as q is (the collector closes in its generator's finally)
    finally:
        views.close()
    return 0
