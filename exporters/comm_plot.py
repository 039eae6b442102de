"""Collective balance across ranks: per collective and rank, calls, bytes and time (`comm_totals`); the ranks that
differ from their peers beyond a threshold (`imbalance`); and the `comm-svg` exporter, bytes per rank and
collective as bars on a log scale with the differing ranks outlined. `aiflame report comm` prints the first two
and writes the third."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from aiflame.core.errors import BadInput
from aiflame.core.model import EventKind, Profile

from .base import Exporter, Option
from .event_totals import Totals, event_totals, human_bytes
from .svg import ALERT_COLOUR, FONT_FAMILY, FONT_SIZE, SERIES_COLOURS, svg_open, xml_text

__all__ = ["CommPlotExporter", "CommTotals", "Flag", "comm_totals", "imbalance", "plot_svg"]

CommTotals = Totals  # one collective on one rank


@dataclass(frozen=True)
class Flag:
    """A rank that stands out from its peers in one collective."""

    collective: str
    rank: int
    what: str  # "calls", "bytes", "time ms"
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
    """Bytes per rank for each collective as horizontal bars (log scale), flagged ranks outlined."""
    ranks = sorted({r for per in totals.values() for r in per})
    names = sorted(totals)
    flagged = {(f.collective, f.rank) for f in flags if f.what in ("bytes", "calls")}
    bar, gap, left, width = 14, 12, 150, 520
    top = 50
    height = top + len(names) * (len(ranks) * bar + gap) + 40
    peak = max((t.bytes for per in totals.values() for t in per.values()), default=1)
    scale = width / math.log10(max(peak, 10) + 1)
    parts = [svg_open(left + width + 160, height)
             + f'<style>text {{ font-family: {FONT_FAMILY}; font-size: {FONT_SIZE}px; }}</style>',
             f'<text x="10" y="20" font-size="15">{xml_text(title or "Collective bytes per rank")}</text>',
             '<text x="10" y="38" fill="#555">bytes sent per rank and collective, log scale; '
             'red outline: differs from the other ranks</text>']
    y = top
    for name in names:
        parts.append(f'<text x="10" y="{y + bar * len(ranks) / 2 + 4}">{xml_text(name)}</text>')
        for i, r in enumerate(ranks):
            t = totals[name].get(r, CommTotals())
            w = scale * math.log10(t.bytes + 1)
            colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
            stroke = f' stroke="{ALERT_COLOUR}" stroke-width="2"' if (name, r) in flagged else ""
            label = f"rank {r}: {t.calls} calls, {human_bytes(t.bytes)}"
            parts.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 2}" fill="{colour}"{stroke}>'
                         f'<title>{xml_text(name)} {xml_text(label)}</title></rect>')
            parts.append(f'<text x="{left + w + 4:.1f}" y="{y + bar - 4}" font-size="10">{xml_text(label)}</text>')
            y += bar
        y += gap
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


class CommPlotExporter(Exporter):
    """The collective-balance plot of a capture's collectives (an empty plot when it has none)."""

    name = "comm-svg"
    extension = ".comm.svg"
    text = True
    description = "collective bytes per rank as SVG bars (log scale), ranks that differ from their peers outlined"
    whole_capture = True
    options = (
        Option("title", str, "", "title at the top (default: Collective bytes per rank)"),
        Option("threshold", float, 0.1, "outline a rank whose bytes differ from the median rank's by this fraction"),
    )

    def __init__(self, title: str = "", threshold: float = 0.1) -> None:
        if not (threshold >= 0 and math.isfinite(threshold)):
            raise BadInput(f"option threshold: must be a non-negative number, got {threshold}")
        self.title = title
        self.threshold = threshold

    def render(self, profile: Profile) -> bytes:
        totals = comm_totals(profile)
        return plot_svg(totals, imbalance(totals, self.threshold), self.title).encode("utf-8")

    def summary(self, profile: Profile) -> str:
        totals = comm_totals(profile)
        return f"{len(totals)} collectives on {len({r for per in totals.values() for r in per})} ranks"
