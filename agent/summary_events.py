"""The accelerator part of the end-of-capture summary: kernels by launch count with their top launch stacks,
copies by direction, sync time, and collectives per rank."""

from __future__ import annotations

from collections import Counter, defaultdict

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
        t = Table(title="Copies by direction", title_justify="left")
        for col in ("direction", "calls", "bytes", "call time ms"):
            t.add_column(col, justify="left" if col == "direction" else "right")
        agg: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for e in copies:
            a = agg[str(e.args.get("direction", e.name))]
            a[0] += 1
            a[1] += int(e.args.get("bytes", 0))
            a[2] += e.duration_ns
        for d, (n, b, ns) in sorted(agg.items()):
            t.add_row(escape(d), str(n), _bytes(b), _ms(ns))
        console.print(t)
    syncs = [e for e in events if e.kind == EventKind.SYNC]
    if syncs:
        t = Table(title="Synchronization", title_justify="left")
        for col in ("call", "calls", "total ms", "max ms"):
            t.add_column(col, justify="left" if col == "call" else "right")
        sagg: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for e in syncs:
            a = sagg[e.name]
            a[0] += 1
            a[1] += e.duration_ns
            a[2] = max(a[2], e.duration_ns)
        for name, (n, ns, mx) in sorted(sagg.items()):
            t.add_row(escape(name), str(n), _ms(ns), _ms(mx))
        console.print(t)
    colls = [e for e in events if e.kind == EventKind.COLLECTIVE]
    if colls:
        t = Table(title="Collectives per rank", title_justify="left")
        for col in ("rank", "collective", "calls", "bytes", "time ms"):
            t.add_column(col, justify="left" if col in ("rank", "collective") else "right")
        cagg: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        order: dict[str, int] = {}
        for e in colls:
            label = _rank_label(e)
            order.setdefault(label, e.rank if e.rank >= 0 else 1 << 30)
            a = cagg[(label, e.name)]
            a[0] += 1
            a[1] += int(e.args.get("bytes", 0))
            a[2] += e.duration_ns
        for (label, name), (n, b, ns) in sorted(cagg.items(), key=lambda kv: (order[kv[0][0]], kv[0])):
            t.add_row(label, escape(name), str(n), _bytes(b), _ms(ns))
        console.print(t)
