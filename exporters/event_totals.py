"""Timed events summed per key (calls, bytes, time, and the largest of each), and byte counts in words: what the
end-of-capture summary, the collective-balance report and the comm plot count."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from aiflame.core.model import TraceEvent

__all__ = ["Totals", "event_totals", "human_bytes"]


def human_bytes(n: float) -> str:
    """`n` bytes as B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Totals:
    """Events of one kind summed: calls, bytes, time, and the largest of each."""

    calls: int = 0
    bytes: int = 0
    ns: int = 0
    max_ns: int = 0
    max_bytes: int = 0


K = TypeVar("K")


def event_totals(items: Iterable[tuple[K, TraceEvent]]) -> dict[K, Totals]:
    """Totals per key; bytes from args["bytes"] (0 when absent or not a number)."""
    out: dict[K, Totals] = defaultdict(Totals)
    for key, e in items:
        nbytes = e.args.get("bytes", 0)
        n = int(nbytes) if isinstance(nbytes, int | float) else 0
        x = out[key]
        x.calls += 1
        x.bytes += n
        x.max_bytes = max(x.max_bytes, n)
        x.ns += e.duration_ns
        x.max_ns = max(x.max_ns, e.duration_ns)
    return dict(out)
