"""A self-contained interactive flame graph SVG: no external resources, the script is embedded.

Layout is the classic one: the root `all` at the bottom (top when `inverted`), each stack's frames merged
along identical label prefixes, children ordered by label, widths proportional to weight. Frames narrower
than `minwidth` pixels are left out, but their weight still counts in their parents.

Colours by frame kind (hue varies deterministically with the label inside each kind's palette):
    native C / other native   red, warm          C++ (`::`)             yellow
    Python (`py::`)           pink               kernel (`_[k]`)        orange
    accelerator source `_[G]` aqua               accelerator instr/stall green
    separator `-`             grey               unknown                light grey
    process / thread root     purple             `all`                  pale blue-grey
Search matches are drawn magenta.

Differential (`baseline`): widths and layout come from the profile rendered (the "after" one), colours from the
change of each frame's weight against the baseline (scaled to the same total unless `normalize` is off): red
grew, blue shrank, white unchanged, deeper for larger changes (FlameGraph's difffolded.pl convention).
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from bisect import bisect_right
from dataclasses import dataclass
from html import escape
from operator import itemgetter
from pathlib import Path

from aiflame.core.errors import BadInput
from aiflame.core.model import FrameKind, Profile

from .base import Exporter, Option, StackLabeler

__all__ = ["ALERT_COLOUR", "FONT_FAMILY", "FONT_SIZE", "SERIES_COLOURS", "SvgExporter", "svg_open", "xml_text"]

FONT_FAMILY = "Verdana, sans-serif"
FONT_SIZE = 12
FONT_WIDTH = 0.59  # average glyph width in ems, for truncating labels to fit
FRAME_HEIGHT = 16
XPAD = 10
TITLE_PAD = 36
SUBTITLE_PAD = 18
BOTTOM_PAD = 2 * FONT_SIZE + 10  # details line
MATCH_COLOUR = "rgb(230,0,230)"
# Categorical colours for series told apart by colour alone (the ranks of the comm plot), and the outline of a
# series that stands out.
SERIES_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#bab0ac")
ALERT_COLOUR = "#d62728"

# (red, green, blue) ranges; each channel moves with a different byte of the label's hash.
_Range = tuple[int, int]
_PALETTES: dict[FrameKind, tuple[_Range, _Range, _Range]] = {
    FrameKind.NATIVE: ((205, 255), (50, 100), (50, 90)),
    FrameKind.NATIVE_CPP: ((190, 235), (180, 225), (40, 80)),
    FrameKind.PYTHON: ((225, 255), (100, 150), (170, 210)),
    FrameKind.KERNEL: ((235, 255), (130, 175), (0, 30)),
    FrameKind.ACCEL_SOURCE: ((40, 100), (180, 225), (180, 225)),
    FrameKind.ACCEL_INSTR: ((60, 120), (180, 235), (50, 100)),
    FrameKind.STALL: ((30, 90), (150, 200), (40, 90)),
    FrameKind.PROCESS: ((150, 190), (90, 130), (200, 240)),
    FrameKind.OFF_CPU: ((60, 110), (110, 160), (210, 250)),  # blue, as off-CPU flame graphs draw blocked time
}
_GREYS: dict[FrameKind, _Range] = {
    FrameKind.SEPARATOR: (160, 160),
    FrameKind.UNKNOWN: (200, 225),
}
_ROOT_COLOUR = "rgb(200,205,220)"

# Characters XML 1.0 cannot carry at all, not even as character references.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


@functools.cache
def _script() -> str:
    # Package data beside this module (see pyproject's package-data), so it stays editable as JavaScript.
    return Path(__file__).with_name("flamegraph.js").read_text(encoding="utf-8")


def xml_text(text: str) -> str:
    """`text` escaped for an SVG attribute or element; characters XML cannot carry become U+FFFD."""
    return escape(_XML_INVALID.sub("\ufffd", text), quote=True)


def svg_open(width: int, height: int) -> str:
    """The start tag of a standalone SVG document of `width` x `height` pixels, with its newline."""
    return (f'<svg version="1.1" width="{width}" height="{height}" viewBox="0 0 {width} {height}"'
            ' xmlns="http://www.w3.org/2000/svg">\n')


def _colour(kind: FrameKind | None, label: str) -> str:
    if kind is None:
        return _ROOT_COLOUR
    h = zlib.crc32(label.encode("utf-8", errors="replace"))
    v = [((h >> shift) & 0xFF) / 255 for shift in (0, 8, 16)]
    grey = _GREYS.get(kind)
    if grey is not None:
        level = round(grey[0] + (grey[1] - grey[0]) * v[0])
        return f"rgb({level},{level},{level})"
    ranges = _PALETTES.get(kind, _PALETTES[FrameKind.NATIVE])
    r, g, b = (round(lo + (hi - lo) * vi) for (lo, hi), vi in zip(ranges, v, strict=True))
    return f"rgb({r},{g},{b})"


def _fit_text(label: str, width: float) -> str:
    """The label cut to fit `width` pixels (same rule as fitText in flamegraph.js)."""
    chars = math.floor((width - 3) / (FONT_SIZE * FONT_WIDTH))
    if chars < 3:
        return ""
    return label[: chars - 2] + ".." if len(label) > chars else label


@dataclass(frozen=True, slots=True)
class _Placed:
    label: str
    kind: FrameKind | None  # None for the synthetic root
    weight: int
    depth: int
    x: float
    width: float
    first: int = 0  # index of the first label stack under this frame: its path is keys[first][:depth]


_Labels = tuple[str, ...]
_Kinds = tuple[FrameKind, ...]


def _merged_stacks(profile: Profile, lines: bool) -> tuple[list[_Labels], list[_Kinds], list[int]]:
    """Distinct label stacks sorted, each with the frame kinds of its first sample and its total weight."""
    labeler = StackLabeler(lines)
    weights: dict[_Labels, int] = {}
    kinds: dict[_Labels, _Kinds] = {}
    for s in profile.samples:
        labels = labeler.labels(s.stack)
        if labels in weights:
            weights[labels] += s.weight
        else:
            weights[labels] = s.weight
            kinds[labels] = tuple([f.kind for f in s.stack])
    keys = sorted(k for k, w in weights.items() if w > 0)
    return keys, [kinds[k] for k in keys], [weights[k] for k in keys]


def _layout(
    keys: list[_Labels], kinds: list[_Kinds], weights: list[int], width: int, minwidth: float
) -> list[_Placed]:
    """Frames to draw, parents before children, from distinct label stacks in sorted order.

    In sorted order every flame graph node is a contiguous run of stacks sharing its prefix, so a node's
    children are found by bisection and a child too narrow to draw is skipped whole: the work grows with
    what is drawn, not with the number of frames in the profile.
    """
    cum = [0]
    for w in weights:
        cum.append(cum[-1] + w)
    total = cum[-1]
    scale = (width - 2 * XPAD) / total
    placed: list[_Placed] = []
    # A node: stacks [lo, hi) share its prefix of `depth` labels; offset is its left edge in weight units.
    todo: list[tuple[int, int, int, int]] = [(0, len(keys), 0, 0)]
    while todo:
        lo, hi, depth, offset = todo.pop()
        weight = cum[hi] - cum[lo]
        if depth == 0:
            placed.append(_Placed("all", None, weight, 0, XPAD, weight * scale, lo))
        else:
            label, kind = keys[lo][depth - 1], kinds[lo][depth - 1]
            placed.append(_Placed(label, kind, weight, depth, XPAD + offset * scale, weight * scale, lo))
        # Stacks are distinct, so at most one ends exactly here (its weight is this node's self time),
        # and it sorts first.
        i = lo + 1 if len(keys[lo]) == depth else lo
        by_label = itemgetter(depth)
        children = []
        while i < hi:
            j = bisect_right(keys, keys[i][depth], i, hi, key=by_label)
            child_weight = cum[j] - cum[i]
            if child_weight * scale >= minwidth:  # narrower frames are omitted with all their children
                children.append((i, j, depth + 1, offset))
            offset += child_weight
            i = j
        todo.extend(reversed(children))
    return placed


def _prefix_weights(profile: Profile, lines: bool) -> dict[tuple[str, ...], int]:
    """Weight under every label path (each prefix of each stack), the root being the empty path."""
    labeler = StackLabeler(lines)
    out: dict[tuple[str, ...], int] = {}
    for s in profile.samples:
        labels = labeler.labels(s.stack)
        for i in range(len(labels) + 1):
            key = labels[:i]
            out[key] = out.get(key, 0) + s.weight
    return out


def _diff_colour(delta: float, maxabs: float) -> str:
    if maxabs <= 0 or delta == 0:
        return "rgb(250,250,250)"
    v = round(210 * min(abs(delta) / maxabs, 1.0))
    return f"rgb(255,{255 - v},{255 - v})" if delta > 0 else f"rgb({255 - v},{255 - v},255)"


class SvgExporter(Exporter):
    """Interactive flame graph (zoom, search, details on hover) as one standalone SVG file."""

    name = "svg"
    extension = ".svg"
    text = True
    description = "interactive flame graph SVG (click to zoom, Ctrl-F to search)"
    options = (
        Option("title", str, "Flame Graph", "title at the top of the graph"),
        Option("subtitle", str, "", "second line under the title"),
        Option("width", int, 1200, "image width in pixels"),
        Option("minwidth", float, 0.1, "omit frames narrower than this many pixels"),
        Option("countname", str, "", "what counts are called in tooltips (default: the profile's unit)"),
        Option("inverted", bool, False, "icicle graph: root at the top"),
        Option("lines", bool, False, "append [file:line] to native frames when known"),
        Option("normalize", bool, True, "differential: scale the baseline to the same total first"),
    )

    def __init__(
        self,
        title: str = "Flame Graph",
        subtitle: str = "",
        width: int = 1200,
        minwidth: float = 0.1,
        countname: str = "",
        inverted: bool = False,
        lines: bool = False,
        normalize: bool = True,
    ) -> None:
        if width < 100:
            raise BadInput(f"option width: must be at least 100 pixels, got {width}")
        if not (minwidth >= 0 and math.isfinite(minwidth)):
            raise BadInput(f"option minwidth: must be a non-negative number, got {minwidth}")
        self.title = title
        self.subtitle = subtitle
        self.width = width
        self.minwidth = minwidth
        self.countname = countname
        self.inverted = inverted
        self.lines = lines
        self.normalize = normalize
        # Set by `aiflame render --diff BEFORE AFTER` (a profile, so not an --opt): makes a differential graph.
        self.baseline: Profile | None = None

    def render(self, profile: Profile) -> bytes:
        keys, kinds, weights = _merged_stacks(profile, self.lines)
        unit = self.countname or profile.unit
        top = TITLE_PAD + (SUBTITLE_PAD if self.subtitle else 0)
        if not keys:
            return self._empty(top).encode("utf-8")
        placed = _layout(keys, kinds, weights, self.width, self.minwidth)
        total = placed[0].weight
        max_depth = max(p.depth for p in placed)
        height = top + (max_depth + 1) * FRAME_HEIGHT + BOTTOM_PAD
        out = self._header(height)
        before: dict[tuple[str, ...], int] | None = None
        factor, maxabs = 1.0, 0.0
        deltas: list[float] = []
        if self.baseline is not None:
            before = _prefix_weights(self.baseline, self.lines)
            btotal = before.get((), 0)
            factor = total / btotal if self.normalize and btotal else 1.0
            deltas = [p.weight - before.get(keys[p.first][:p.depth], 0) * factor for p in placed]
            maxabs = max((abs(d) for d in deltas), default=0.0)
        out.append('<g id="frames">\n')
        escaped: dict[str, str] = {}
        unit_xml = xml_text(unit)
        colours: dict[tuple[FrameKind | None, str], str] = {}
        for n, p in enumerate(placed):
            label = p.label
            esc = escaped.get(label)
            if esc is None:
                esc = escaped[label] = xml_text(label)
            extra = ""
            if before is not None:
                colour = _diff_colour(deltas[n], maxabs)
                extra = f' data-delta="{deltas[n]:.0f}"'
            else:
                hit = colours.get((p.kind, label))
                colour = hit if hit is not None else colours.setdefault((p.kind, label), _colour(p.kind, label))
            if self.inverted:
                y = top + p.depth * FRAME_HEIGHT
            else:
                y = height - BOTTOM_PAD - (p.depth + 1) * FRAME_HEIGHT
            kind = "root" if p.kind is None else p.kind.name.lower()
            shown = _fit_text(label, p.width)
            shown = esc if shown == label else xml_text(shown)
            pct = 100 * p.weight / total
            change = f"; {deltas[n]:+.0f} vs baseline" if before is not None else ""
            out.append(
                f'<g class="f" data-kind="{kind}" data-samples="{p.weight}"{extra}>'
                f"<title>{esc} ({p.weight} {unit_xml}, {pct:.2f}%{change})</title>"
                f'<rect x="{p.x:.2f}" y="{y}" width="{p.width:.2f}" height="{FRAME_HEIGHT - 1}"'
                f' fill="{colour}" rx="2" ry="2"/>'
                f'<text x="{p.x + 3:.2f}" y="{y + FRAME_HEIGHT - 5}">{shown}</text></g>\n'
            )
        out.append("</g>\n")
        config = {
            "total": total,
            "unit": unit,
            "width": self.width,
            "xpad": XPAD,
            "fontSize": FONT_SIZE,
            "fontWidth": FONT_WIDTH,
            "inverted": self.inverted,
            "matchColour": MATCH_COLOUR,
            "differential": before is not None,
        }
        # Escaping <, > and & keeps "]]>" (and anything tag-like) out of the CDATA section.
        config_js = json.dumps(config).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        script = _script()
        out.append(f'<script type="text/ecmascript"><![CDATA[\n{script}\naiflameInit({config_js});\n]]>')
        out.append("</script>\n")
        out.append("</svg>\n")
        return "".join(out).encode("utf-8")

    def _header(self, height: int) -> list[str]:
        w = self.width
        parts = [
            '<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n',
            svg_open(w, height),
            "<defs><linearGradient id=\"background\" x1=\"0\" y1=\"0\" x2=\"0\" y2=\"1\">"
            '<stop stop-color="#eeeeee" offset="5%"/><stop stop-color="#eeeeb0" offset="95%"/>'
            "</linearGradient></defs>\n",
            "<style><![CDATA[\n"
            f"text {{ font-family: {FONT_FAMILY}; font-size: {FONT_SIZE}px; fill: rgb(0,0,0); }}\n"
            "#title { text-anchor: middle; font-size: 17px; }\n"
            "#subtitle { text-anchor: middle; fill: rgb(110,110,110); }\n"
            "#matched { text-anchor: end; }\n"
            "#unzoom, #search, #ignorecase { cursor: pointer; opacity: 0.6; }\n"
            "#unzoom:hover, #search:hover, #ignorecase:hover, #search.on, #ignorecase.on { opacity: 1; }\n"
            "#ignorecase.on { font-weight: bold; }\n"
            "#search { text-anchor: end; }\n"
            "#ignorecase { text-anchor: end; }\n"
            ".f { cursor: pointer; }\n"
            ".f:hover rect { stroke: rgb(0,0,0); stroke-width: 0.5; }\n"
            ".f text { pointer-events: none; }\n"
            ".parent { opacity: 0.5; }\n"
            ".hide { display: none; }\n"
            "]]></style>\n",
            f'<rect x="0" y="0" width="{w}" height="{height}" fill="url(#background)"/>\n',
            f'<text id="title" x="{w / 2:.1f}" y="{2 * FONT_SIZE}">{xml_text(self.title)}</text>\n',
        ]
        if self.subtitle:
            parts.append(
                f'<text id="subtitle" x="{w / 2:.1f}" y="{2 * FONT_SIZE + SUBTITLE_PAD}">'
                f"{xml_text(self.subtitle)}</text>\n"
            )
        bottom_y = height - FONT_SIZE
        parts += [
            f'<text id="unzoom" class="hide" x="{XPAD}" y="{2 * FONT_SIZE}">Reset Zoom</text>\n',
            f'<text id="search" x="{w - XPAD - 30}" y="{2 * FONT_SIZE}">Search</text>\n',
            f'<text id="ignorecase" x="{w - XPAD}" y="{2 * FONT_SIZE}">ic</text>\n',
            f'<text id="details" x="{XPAD}" y="{bottom_y}"> </text>\n',
            f'<text id="matched" x="{w - XPAD}" y="{bottom_y}"> </text>\n',
        ]
        return parts

    def _empty(self, top: int) -> str:
        w = self.width
        height = top + 3 * FRAME_HEIGHT + BOTTOM_PAD
        return (
            '<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n'
            + svg_open(w, height)
            + f'<rect x="0" y="0" width="{w}" height="{height}" fill="rgb(238,238,238)"/>\n'
            f'<text id="title" x="{w / 2:.1f}" y="{2 * FONT_SIZE}" text-anchor="middle"'
            f' font-family="{FONT_FAMILY}" font-size="17">{xml_text(self.title)}</text>\n'
            f'<text id="nosamples" x="{w / 2:.1f}" y="{top + 2 * FRAME_HEIGHT}" text-anchor="middle"'
            f' font-family="{FONT_FAMILY}" font-size="{FONT_SIZE}">No samples</text>\n'
            "</svg>\n"
        )
