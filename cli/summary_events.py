"""The accelerator part of the end-of-capture summary: kernels by launch count with their top launch stacks,
copies by direction, sync time, and collectives per rank."""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiflame.core.model import EventKind, FrameKind, Profile, Stack, TraceEvent
from aiflame.exporters.event_totals import event_totals, human_bytes

_SKIP = (FrameKind.PROCESS, FrameKind.SEPARATOR)


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def _stack_text(stack: Stack, width: int = 110) -> str:
    names = [f.name for f in stack if f.kind not in _SKIP]
    text = " ; ".join(names)
    return text if len(text) <= width else "… " + text[-(width - 2):]


def _rank_label(ev: TraceEvent) -> str:
    return f"rank {ev.rank}" if ev.rank >= 0 else f"pid {ev.pid}"


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
        by_kernel: Counter[str] = Counter()
        stacks: dict[str, Counter[Stack]] = defaultdict(Counter)
        for e in launches:
            by_kernel[e.name] += e.calls
            stacks[e.name][e.stack] += e.calls
        t = Table(title=f"Kernels by launches ({by_kernel.total()} launches)", title_justify="left")
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
        by_dir = event_totals((str(e.args.get("direction", e.name)), e) for e in copies)
        for d, x in sorted(by_dir.items()):
            t.add_row(escape(d), str(x.calls), human_bytes(x.bytes), _ms(x.ns))
        console.print(t)
    syncs = [e for e in events if e.kind == EventKind.SYNC]
    if syncs:
        t = _table("Synchronization", ("call",), ("calls", "total ms", "max ms"))
        for name, x in sorted(event_totals((e.name, e) for e in syncs).items()):
            t.add_row(escape(name), str(x.calls), _ms(x.ns), _ms(x.max_ns))
        console.print(t)
    colls = [e for e in events if e.kind == EventKind.COLLECTIVE]
    if colls:
        t = _table("Collectives per rank", ("rank", "collective"), ("calls", "bytes", "time ms"))
        order = {_rank_label(e): e.rank if e.rank >= 0 else 1 << 30 for e in reversed(colls)}
        by_rank = event_totals(((_rank_label(e), e.name), e) for e in colls)
        for (label, name), x in sorted(by_rank.items(), key=lambda kv: (order[kv[0][0]], kv[0])):
            t.add_row(label, escape(name), str(x.calls), human_bytes(x.bytes), _ms(x.ns))
        console.print(t)


_STALL_COUNTERS = (
    ("stall_unknown_launch", "under [unknown launch] (kernel never seen launched)"),
    ("stall_unknown_kernel", "of an unknown kernel"),
    ("stall_xe_unmapped", "at Xe IPs no launched kernel covers"),
    ("stall_no_source", "without a source line (no code object or line info)"),
    ("stall_shared_by_launches", "shared over several launch stacks"),
    ("cupti_not_issued_samples", "in which no instruction issued (counted once, under their reason)"),
    ("stall_by_correlation", "attributed by correlation id"),
)


def _gpu_part(stack: Stack) -> Stack:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].kind == FrameKind.SEPARATOR:
            return stack[i + 1:]
    return ()


def print_stalls(console: Console, stalls: Profile, top: int = 10, per_kernel: int = 3) -> None:
    """Top kernels by stall samples with their dominant stall reasons and hottest instructions, then every
    fallback and drop counted by the merge and the collectors (counters starting stall_, cupti, xe_, rocprof)."""
    total = stalls.total_weight
    by_kernel: Counter[str] = Counter()
    reasons: dict[str, Counter[str]] = defaultdict(Counter)
    insns: dict[str, Counter[str]] = defaultdict(Counter)
    for s in stalls.samples:
        gpu = _gpu_part(s.stack)
        if len(gpu) < 4:
            continue
        kernel, src, insn, reason = gpu[0].name, gpu[1].name, gpu[2].name, gpu[3].name
        by_kernel[kernel] += s.weight
        reasons[kernel][reason] += s.weight
        insns[kernel][f"{insn}  ({src})"] += s.weight
    if total:
        t = Table(title=f"Kernels by stall samples ({total} stall samples)", title_justify="left")
        t.add_column("stalls", justify="right")
        t.add_column("%", justify="right")
        t.add_column("kernel")
        t.add_column("dominant stall reasons")
        t.add_column("hottest instructions")
        for name, n in by_kernel.most_common(top):
            rs = ", ".join(f"{r} {100 * c / n:.0f}%" for r, c in reasons[name].most_common(per_kernel))
            hot = "\n".join(f"{c}× {i}" for i, c in insns[name].most_common(per_kernel))
            t.add_row(str(n), f"{100 * n / total:.1f}", escape(name), escape(rs), escape(hot))
        console.print(t)
    c = stalls.counters
    parts = [f"{c[k]} {what}" for k, what in _STALL_COUNTERS if c.get(k)]
    drops = sorted((k, v) for k, v in c.items() if v and k.startswith(("stall_", "cupti", "xe_", "rocprof"))
                   and k not in dict(_STALL_COUNTERS) and k != "stall_samples")
    if parts:
        console.print("stall samples: " + "; ".join(parts), highlight=False, markup=False)
    if drops:
        console.print("accelerator sampling counters: " + "  ".join(f"{k} {v}" for k, v in drops), highlight=False)
