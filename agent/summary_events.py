"""The accelerator part of the end-of-capture summary: kernels by launch count with their top launch stacks,
copies by direction, sync time, and collectives per rank."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiflame.model import EventKind, FrameKind, Profile, Stack, TraceEvent

_SKIP = (FrameKind.PROCESS, FrameKind.SEPARATOR)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def _stack_text(stack: Stack, width: int = 110) -> str:
    names = [f.name for f in stack if f.kind not in _SKIP]
    text = " ; ".join(names)
    return text if len(text) <= width else "… " + text[-(width - 2):]


def _rank_label(ev: TraceEvent) -> str:
    return f"rank {ev.rank}" if ev.rank >= 0 else f"pid {ev.pid}"


@dataclass
class _Totals:
    calls: int = 0
    bytes: int = 0
    ns: int = 0
    max_ns: int = 0


K = TypeVar("K")


def _totals(items: Iterable[tuple[K, TraceEvent]]) -> dict[K, _Totals]:
    """Calls, bytes (args["bytes"]), total and longest duration per key."""
    out: dict[K, _Totals] = defaultdict(_Totals)
    for key, e in items:
        x = out[key]
        x.calls += 1
        x.bytes += int(e.args.get("bytes", 0))
        x.ns += e.duration_ns
        x.max_ns = max(x.max_ns, e.duration_ns)
    return out


def _table(title: str, left: tuple[str, ...], right: tuple[str, ...]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in left:
        t.add_column(col)
    for col in right:
        t.add_column(col, justify="right")
    return t


def print_events(console: Console, prof: Profile, top: int = 10, stacks_per_kernel: int = 2) -> None:
    events = prof.events
    if not events:
        return
    launches = [e for e in events if e.kind == EventKind.COMPUTE]
    if launches:
        by_kernel: Counter[str] = Counter(e.name for e in launches)
        stacks: dict[str, Counter[Stack]] = defaultdict(Counter)
        for e in launches:
            stacks[e.name][e.stack] += 1
        t = Table(title=f"Kernels by launches ({len(launches)} launches)", title_justify="left")
        t.add_column("launches", justify="right")
        t.add_column("kernel")
        t.add_column("top launch stacks (root ; … ; launch call)")
        for name, n in by_kernel.most_common(top):
            lines = [f"{c}× {_stack_text(st)}" for st, c in stacks[name].most_common(stacks_per_kernel)]
            t.add_row(str(n), escape(name), escape("\n".join(lines)))
        console.print(t)
    copies = [e for e in events if e.kind == EventKind.COPY]
    if copies:
        t = _table("Copies by direction", ("direction",), ("calls", "bytes", "call time ms"))
        by_dir = _totals((str(e.args.get("direction", e.name)), e) for e in copies)
        for d, x in sorted(by_dir.items()):
            t.add_row(escape(d), str(x.calls), _bytes(x.bytes), _ms(x.ns))
        console.print(t)
    syncs = [e for e in events if e.kind == EventKind.SYNC]
    if syncs:
        t = _table("Synchronization", ("call",), ("calls", "total ms", "max ms"))
        for name, x in sorted(_totals((e.name, e) for e in syncs).items()):
            t.add_row(escape(name), str(x.calls), _ms(x.ns), _ms(x.max_ns))
        console.print(t)
    colls = [e for e in events if e.kind == EventKind.COLLECTIVE]
    if colls:
        t = _table("Collectives per rank", ("rank", "collective"), ("calls", "bytes", "time ms"))
        order = {_rank_label(e): e.rank if e.rank >= 0 else 1 << 30 for e in reversed(colls)}
        by_rank = _totals(((_rank_label(e), e.name), e) for e in colls)
        for (label, name), x in sorted(by_rank.items(), key=lambda kv: (order[kv[0][0]], kv[0])):
            t.add_row(label, escape(name), str(x.calls), _bytes(x.bytes), _ms(x.ns))
        console.print(t)
