"""Folded stacks, the text format of Brendan Gregg's FlameGraph (`flamegraph.pl`, inferno, speedscope).

One line per distinct stack: frame labels root -> leaf joined by `;`, a space, an integer count. Kind
annotations (`_[k]`, `_[G]`, `_[g]`, `py::`, `-`) follow flamegraph.pl and Intel's AI flame graphs, so
`parse_folded` can read the kinds back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from aiflame.core.errors import BadInput, NothingToShow, Unreadable
from aiflame.core.model import SEPARATOR, Frame, FrameKind, Profile, Sample, Stack

from .base import Exporter, Option, StackLabeler, frame_label

__all__ = ["FoldedExporter", "folded_lines", "frame_label", "parse_folded", "with_separator"]


def with_separator(stack: Stack) -> Stack:
    """Insert a `-` frame between the user frames and the leaf-side run of kernel frames, if both exist."""
    start = len(stack)
    while start > 0 and stack[start - 1].kind == FrameKind.KERNEL:
        start -= 1
    if start == 0 or start == len(stack) or stack[start - 1].kind == FrameKind.SEPARATOR:
        return stack
    return (*stack[:start], SEPARATOR, *stack[start:])


# Upstream flamegraph.pl has no gpu palette; its java palette draws `_[j]` green and `_[i]` aqua, which are the
# AI palette's colours for accelerator instructions/stall reasons and accelerator source/kernels.
_JAVA_SUFFIXES = {"_[G]": "_[i]", "_[g]": "_[j]"}
PALETTES = ("gpu", "java")


def _java_label(label: str) -> str:
    tail = label[-4:]
    return label[:-4] + _JAVA_SUFFIXES[tail] if tail in _JAVA_SUFFIXES else label


# flamegraph.pl reads a line ending "<space><number> <count>" as a differential file's two counts: a leaf such as
# `worker 2` would lose its number and turn its count into a second column. Such a leaf's last space becomes `_`.
_LEAF_NUMBER = re.compile(r"\s+(?=\d+(?:\.\d*)?$)")


def folded_lines(
    stacks: Iterable[tuple[Stack, int]], lines: bool = False, separator: bool = False, palette: str = "gpu"
) -> list[str]:
    """Folded lines (without newlines), merged by label text and sorted; non-positive counts are dropped.

    `palette` "gpu" writes iaprof's `_[G]`/`_[g]` annotations (`flamegraph.pl --colors=gpu` of Intel's fork);
    "java" writes `_[i]`/`_[j]` instead, so stock `flamegraph.pl --colors=java` colours the layers right."""
    labeler = StackLabeler(lines)
    counts: dict[str, int] = {}
    java = palette == "java"
    for stack, weight in stacks:
        labels = labeler.labels(with_separator(stack) if separator else stack)
        text = _LEAF_NUMBER.sub("_", ";".join(map(_java_label, labels) if java else labels))
        counts[text] = counts.get(text, 0) + weight
    return [f"{text} {count}" for text, count in sorted(counts.items()) if count > 0]


class FoldedExporter(Exporter):
    """flamegraph.pl-compatible folded stacks."""

    name = "folded"
    extension = ".folded"
    text = True
    description = "folded stacks for flamegraph.pl, inferno, speedscope and Pyroscope"
    options = (
        Option("lines", bool, False, "append [file:line] to native frames when known"),
        Option("separator", bool, False, "insert a '-' frame between user and kernel frames"),
        Option("palette", str, "gpu", "accelerator annotations: gpu (_[G]/_[g], iaprof's --colors=gpu) or java "
               "(_[i]/_[j], stock flamegraph.pl --colors=java)"),
    )

    def __init__(self, lines: bool = False, separator: bool = False, palette: str = "gpu") -> None:
        if palette not in PALETTES:
            raise BadInput(f"option palette: expected one of {', '.join(PALETTES)}, got {palette!r}")
        self.lines = lines
        self.separator = separator
        self.palette = palette

    def render(self, profile: Profile) -> bytes:
        out = folded_lines(((s.stack, s.weight) for s in profile.samples), self.lines, self.separator, self.palette)
        text = "".join(line + "\n" for line in out)
        # Names come from arbitrary binaries; a stray surrogate must not abort the export.
        return text.encode("utf-8", errors="replace")


# ASCII digits and blanks only: Unicode digits would pass int() but no other folded reader takes them.
_LINE_RE = re.compile(r"(.*)[ \t]+([0-9]+)", re.DOTALL)
_ANNOTATIONS = (("_[k]", FrameKind.KERNEL), ("_[G]", FrameKind.ACCEL_SOURCE), ("_[g]", FrameKind.ACCEL_INSTR))


def _parse_frame(label: str) -> Frame:
    if label == "-":
        return Frame("-", FrameKind.SEPARATOR)
    for suffix, kind in _ANNOTATIONS:
        if label.endswith(suffix):
            return Frame(label[: -len(suffix)], kind)
    if label.startswith("[off-cpu"):
        return Frame(label, FrameKind.OFF_CPU)
    if label.startswith("py::"):
        # The label's " (file:line)" stays part of the name: splitting it back out would be guesswork.
        return Frame(label[4:], FrameKind.PYTHON)
    return Frame(label, FrameKind.NATIVE_CPP if "::" in label else FrameKind.NATIVE)


def parse_folded(text: str) -> Profile:
    """Read folded stacks back into a Profile (one aggregated sample per line); kinds from annotations.

    Raises Unreadable naming the first malformed line, NothingToShow if there are no stacks at all.
    """
    frames: dict[str, Frame] = {}
    samples: list[Sample] = []
    for number, raw in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        # Only the count side is trimmed: a leaf name may legitimately end in spaces.
        match = _LINE_RE.fullmatch(line.rstrip(" \t"))
        if match is None:
            shown = line if len(line) <= 60 else line[:57] + "..."
            raise Unreadable(f"line {number}: expected 'frame;...;frame COUNT' (integer), got {shown!r}")
        stack_text, count = match.groups()
        if len(count) > 19:  # beyond int64, and past Python's int() digit limit if far longer
            raise Unreadable(f"line {number}: count {count[:30]}... is too large")
        stack: list[Frame] = []
        if stack_text:
            for label in stack_text.split(";"):
                frame = frames.get(label)
                if frame is None:
                    frame = frames[label] = _parse_frame(label)
                stack.append(frame)
        samples.append(Sample(tuple(stack), int(count)))
    if not samples:
        raise NothingToShow("no stacks found in folded input")
    return Profile(samples=samples)
