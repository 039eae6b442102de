"""What every exporter shares: the `Exporter` interface, its options, errors, and frame labels.

An exporter is a small class: options go to its constructor, `render()` turns a `Profile` into bytes and
`write()` puts those bytes on disk atomically and says what it wrote. An exporter of several files (Chakra: one
per rank) takes a path prefix and overrides `write()`. The registry in `aiflame.exporters` maps format names to
exporter classes.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from aiflame.core import safe_files
from aiflame.core.errors import BadInput, Refused
from aiflame.core.model import Frame, FrameKind, Profile, Stack

__all__ = [
    "Exporter",
    "Option",
    "Output",
    "StackLabeler",
    "frame_label",
    "sanitize_label",
    "write_atomic",
]


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Option:
    """One keyword argument of an exporter's constructor, as the CLI offers it (`--opt name=value`)."""

    name: str
    type: builtins.type[object]  # int, float, str or bool
    default: object
    help: str

    def parse(self, text: str) -> object:
        """Convert a command-line string to this option's type; raises BadInput if it does not fit."""
        if self.type is bool:
            word = text.strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
            raise BadInput(f"option {self.name}: expected a boolean (1/0/true/false/yes/no), got {text!r}")
        if self.type is int or self.type is float:
            try:
                return int(text) if self.type is int else float(text)
            except ValueError:
                kind = "an integer" if self.type is int else "a number"
                raise BadInput(f"option {self.name}: expected {kind}, got {text!r}") from None
        return text

    def check(self, value: object) -> object:
        """Validate a Python value for this option (ints pass for floats); returns the value to use."""
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        # bool is a subclass of int, so an int option must not silently take True/False.
        ok = isinstance(value, self.type) and not (self.type is not bool and isinstance(value, bool))
        if not ok:
            raise BadInput(
                f"option {self.name}: expected {self.type.__name__}, got {type(value).__name__} {value!r}"
            )
        return value


@dataclass(frozen=True)
class Output:
    """One file an exporter wrote, and what it holds in a few words (for the "wrote" line)."""

    path: Path
    summary: str


class Exporter(abc.ABC):
    """Turns a Profile into output files. Subclasses take their `options` as constructor keywords."""

    name: ClassVar[str]
    extension: ClassVar[str]  # including the dot, e.g. ".folded"
    description: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    # `write` takes a prefix and writes several files, PREFIX.<part><extension> (Chakra: one per rank).
    writes_many: ClassVar[bool] = False
    # Reads the capture's timed events, not a stack view: written once per capture (from its CPU view).
    whole_capture: ClassVar[bool] = False
    # `render` makes text (UTF-8) a terminal or a pipe can take: `-o -` may send it to stdout.
    text: ClassVar[bool] = False
    # What the last `write` could not represent exactly, one line each.
    warnings: Sequence[str] = ()

    @abc.abstractmethod
    def render(self, profile: Profile) -> bytes:
        """The complete file contents for `profile`."""

    def summary(self, profile: Profile) -> str:
        """What the file of `profile` holds, in a few words."""
        if profile.unit == "ns":  # the offcpu and wall views
            return f"{profile.total_weight / 1e9:.3f} s"
        return f"{profile.total_weight} samples"

    @classmethod
    def output_path(cls, stem: Path) -> Path:
        """Where this format goes by default for a file stem (`out/profile`): the stem plus the extension, or the
        stem itself as the prefix of an exporter that writes several files."""
        return stem if cls.writes_many else stem.with_name(stem.name + cls.extension)

    def write(self, profile: Profile, path: Path) -> list[Output]:
        """Render `profile` and write it to `path` atomically; the file written."""
        write_atomic(Path(path), self.render(profile))
        return [Output(Path(path), self.summary(profile))]


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file renamed into place, both relative to the directory's
    descriptor with O_EXCL|O_NOFOLLOW (core/safe_files.py: a user who owns the directory cannot redirect it);
    BadInput when it cannot."""
    try:
        safe_files.write_atomic(path, data)
    except (OSError, Refused) as e:
        raise BadInput(f"cannot write {path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}") from e


# Characters that end a line for str.splitlines(); any of them would split a folded line in some reader.
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_LABEL_TABLE = str.maketrans({";": ":", **{c: " " for c in _LINE_BREAKS}})

_SUFFIX = {
    FrameKind.KERNEL: "_[k]",
    FrameKind.ACCEL_SOURCE: "_[G]",
    FrameKind.ACCEL_INSTR: "_[g]",
    FrameKind.STALL: "_[g]",
}


def sanitize_label(text: str) -> str:
    """Make text safe as one folded frame: `;` becomes `:`, line breaks become spaces."""
    return text.translate(_LABEL_TABLE)


def frame_label(frame: Frame, lines: bool = False) -> str:
    """The frame's text in folded stacks and flame graphs, with flamegraph.pl/iaprof kind annotations.

    Kernel `name_[k]`, accelerator source `name_[G]`, accelerator instruction or stall `name_[g]`,
    separator `-`, Python `py::name (file:line)`; other kinds are the bare name, plus ` [file:line]` when
    `lines` is set and the file is known.
    """
    kind = frame.kind
    suffix = _SUFFIX.get(kind)
    if suffix is not None:
        text = frame.name + suffix
    elif kind == FrameKind.SEPARATOR:
        return "-"
    elif kind == FrameKind.PYTHON:
        text = "py::" + frame.name
        if frame.file:
            text += f" ({frame.file}:{frame.line})" if frame.line else f" ({frame.file})"
    elif lines and frame.file:
        text = f"{frame.name} [{frame.file}:{frame.line}]" if frame.line else f"{frame.name} [{frame.file}]"
    else:
        text = frame.name
    return sanitize_label(text)


class StackLabeler:
    """`frame_label` over many stacks, computed once per frame object and once per stack object.

    Keyed by id() because Frame's generated __hash__ runs in Python and dominated large renders. Each
    entry keeps its object alive, so an id cannot be reused by another object while the cache exists.
    """

    def __init__(self, lines: bool = False) -> None:
        self.lines = lines
        self._frames: dict[int, tuple[Frame, str]] = {}
        self._stacks: dict[int, tuple[Stack, tuple[str, ...]]] = {}

    def label(self, frame: Frame) -> str:
        hit = self._frames.get(id(frame))
        if hit is None:
            hit = self._frames[id(frame)] = (frame, frame_label(frame, self.lines))
        return hit[1]

    def labels(self, stack: Stack) -> tuple[str, ...]:
        hit = self._stacks.get(id(stack))
        if hit is None:
            label = self.label
            hit = self._stacks[id(stack)] = (stack, tuple([label(f) for f in stack]))
        return hit[1]
