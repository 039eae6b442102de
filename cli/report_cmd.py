"""`aiflame report comm CAPTURE`: the collective-balance report. Per collective and rank: calls, bytes and time;
ranks whose counts, sizes or times differ from their peers' beyond a threshold are flagged; and a plot of message
sizes per rank (SVG) shows where the imbalance is."""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from html import escape as xml_escape
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiflame.cli.summary_events import Totals, event_totals, human_bytes
from aiflame.core.errors import BadInput
from aiflame.core.model import EventKind, Profile

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#bab0ac")


class ReportError(BadInput):
    """A report cannot be made from this input; one line."""


CommTotals = Totals  # one collective on one rank


@dataclass(frozen=True)
class Flag:
    """A rank that stands out from its peers in one collective."""

    collective: str
    rank: int
    what: str  # "calls", "bytes", "time"
    value: float
    median: float

    @property
    def deviation(self) -> float:
        """Relative difference from the peers' median (inf when the median is 0)."""
        return (self.value - self.median) / self.median if self.median else math.inf

    def text(self) -> str:
        dev = "n/a" if math.isinf(self.deviation) else f"{self.deviation:+.0%}"
        return f"{self.collective}: rank {self.rank} {self.what} {self.value:g} vs median {self.median:g} ({dev})"


def comm_totals(prof: Profile) -> dict[str, dict[int, CommTotals]]:
    """collective name -> rank -> totals, over the capture's collective events (send/recv included)."""
    # unranked events are told apart by pid, shown negative
    flat = event_totals(((ev.name, ev.rank if ev.rank >= 0 else -ev.pid), ev)
                        for ev in prof.events if ev.kind == EventKind.COLLECTIVE)
    out: dict[str, dict[int, CommTotals]] = defaultdict(dict)
    for (name, rank), t in flat.items():
        out[name][rank] = t
    return dict(out)


def imbalance(totals: dict[str, dict[int, CommTotals]], size_threshold: float = 0.1,
              time_threshold: float = 0.5, min_time_ms: float = 5.0) -> list[Flag]:
    """Ranks whose call count differs from the median rank's, or whose bytes (time) differ from the median by more
    than `size_threshold` (`time_threshold`) of it; a time difference must also exceed `min_time_ms`, since a
    scheduler tick alone moves a small collective's time by half. Collectives seen on one rank only are compared
    with nothing."""
    flags: list[Flag] = []
    ranks = sorted({r for per in totals.values() for r in per})
    for name, per in sorted(totals.items()):
        if len(ranks) < 2:
            continue
        rows = [(r, per.get(r, CommTotals())) for r in ranks]
        for what, values, limit in (("calls", [t.calls for _, t in rows], 0.0),
                                    ("bytes", [t.bytes for _, t in rows], size_threshold),
                                    ("time ms", [t.ns / 1e6 for _, t in rows], time_threshold)):
            med = statistics.median(values)
            for (r, _), v in zip(rows, values, strict=True):
                if what == "time ms" and abs(v - med) <= min_time_ms:
                    continue
                if (med == 0 and v != 0) or (med and abs(v - med) / med > limit):
                    flags.append(Flag(name, r, what, round(v, 3), round(med, 3)))
    return flags


def plot_svg(totals: dict[str, dict[int, CommTotals]], flags: list[Flag], title: str = "") -> str:
    """Bytes per rank for each collective as horizontal bars (log scale), flagged ranks outlined in red."""
    ranks = sorted({r for per in totals.values() for r in per})
    names = sorted(totals)
    flagged = {(f.collective, f.rank) for f in flags if f.what in ("bytes", "calls")}
    bar, gap, left, width = 14, 12, 150, 520
    top = 50
    height = top + len(names) * (len(ranks) * bar + gap) + 40
    peak = max((t.bytes for per in totals.values() for t in per.values()), default=1)
    scale = width / math.log10(max(peak, 10) + 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 160}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<text x="10" y="20" font-size="15">{xml_escape(title or "Collective bytes per rank")}</text>',
             '<text x="10" y="38" fill="#555">bytes sent per rank and collective, log scale; '
             'red outline: differs from the other ranks</text>']
    y = top
    for name in names:
        parts.append(f'<text x="10" y="{y + bar * len(ranks) / 2 + 4}">{xml_escape(name)}</text>')
        for i, r in enumerate(ranks):
            t = totals[name].get(r, CommTotals())
            w = scale * math.log10(t.bytes + 1)
            colour = PALETTE[i % len(PALETTE)]
            stroke = ' stroke="#d62728" stroke-width="2"' if (name, r) in flagged else ""
            label = f"rank {r}: {t.calls} calls, {human_bytes(t.bytes)}"
            parts.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 2}" fill="{colour}"{stroke}>'
                         f'<title>{xml_escape(name)} {xml_escape(label)}</title></rect>')
            parts.append(f'<text x="{left + w + 4:.1f}" y="{y + bar - 4}" font-size="10">{xml_escape(label)}</text>')
            y += bar
        y += gap
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="reports over a capture (comm: collective balance across ranks)")
    kinds = p.add_subparsers(dest="report", metavar="REPORT", required=True)
    c = kinds.add_parser("comm", help="collectives per rank: calls, bytes, time; flags imbalance; plots sizes")
    c.add_argument("capture", type=Path, help="a .aiflame capture of a multi-rank job")
    c.add_argument("--threshold", type=float, default=0.1,
                   help="flag a rank whose bytes differ from the median rank's by more than this fraction (0.1)")
    c.add_argument("--time-threshold", type=float, default=0.5,
                   help="the same for time spent in the collective (0.5; times are noisier than sizes)")
    c.add_argument("--min-time-ms", type=float, default=5.0,
                   help="ignore time differences smaller than this many ms, whatever their ratio (5)")
    c.add_argument("--plot", type=Path, help="SVG plot of bytes per rank (default: next to the capture, .comm.svg)")
    c.add_argument("--no-plot", action="store_true", help="do not write the plot")


def report_comm(prof: Profile, console: Console, size_threshold: float, time_threshold: float,
                plot: Path | None, title: str = "", min_time_ms: float = 5.0) -> list[Flag]:
    """Print the table and the flags; write the plot when `plot` is given. Returns the flags."""
    totals = comm_totals(prof)
    if not totals:
        raise ReportError("no collectives in this capture (taken with --no-runtimes, or no gloo/NCCL calls?)")
    flags = imbalance(totals, size_threshold, time_threshold, min_time_ms)
    marked = {(f.collective, f.rank, f.what) for f in flags}
    t = Table(title="Collectives per rank", title_justify="left")
    for col, right in (("collective", False), ("rank", True), ("calls", True), ("bytes", True),
                       ("largest", True), ("time ms", True)):
        t.add_column(col, justify="right" if right else "left")

    def cell(text: str, name: str, rank: int, what: str) -> str:
        return f"[bold red]{escape(text)}[/]" if (name, rank, what) in marked else escape(text)

    for name, per in sorted(totals.items()):
        for r, x in sorted(per.items()):
            t.add_row(escape(name), str(r), cell(str(x.calls), name, r, "calls"),
                      cell(human_bytes(x.bytes), name, r, "bytes"), human_bytes(x.max_bytes),
                      cell(f"{x.ns / 1e6:.3f}", name, r, "time ms"))
    console.print(t)
    if flags:
        console.print(f"[bold]imbalance[/] (bytes beyond {size_threshold:.0%}, time beyond {time_threshold:.0%} "
                      f"and {min_time_ms:g} ms of the median rank; any difference in calls):")
        for f in flags:
            console.print("  " + escape(f.text()), highlight=False)
    else:
        console.print("no imbalance: every rank made the same calls with sizes and times within the thresholds")
    if plot is not None:
        try:
            plot.write_text(plot_svg(totals, flags, title))
        except OSError as e:
            raise ReportError(f"cannot write {plot}: {e.strerror or e}") from None
        console.print(f"wrote {plot}", highlight=False)
    return flags
