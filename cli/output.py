"""Where `export` and `render` put what they make: a file (its directory made first, as `profile` makes its output
directory), or stdout when `-o -` names it and the format is text. A binary format, a format of several files
or a directory is refused in one line rather than written to a file named `-` or to a terminal."""

from __future__ import annotations

import sys
from pathlib import Path

from aiflame.core.errors import BadInput, UsageError
from aiflame.core.model import Profile
from aiflame.exporters import REGISTRY, Exporter, Output

__all__ = ["STDOUT", "check_output", "is_stdout", "make_parent", "write_output"]

STDOUT = "-"


def is_stdout(path: Path | None) -> bool:
    """`-o -`: the output is stdout."""
    return path is not None and str(path) == STDOUT


def make_parent(path: Path) -> None:
    """Create the directory `path` goes in (and those above it), as `mkdir -p`; BadInput when it cannot be."""
    parent = path.parent
    if parent.is_dir():
        return
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create directory {parent}: {e.strerror or e}") from None


def check_output(cls: type[Exporter], path: Path | None) -> None:
    """Refuse, before any work, an output `cls` cannot go to: `-` for a format that is not text (UsageError), an
    existing directory for a format of one file (BadInput)."""
    if path is None:
        return
    if is_stdout(path):
        if not cls.text or cls.writes_many:
            what = "several files" if cls.writes_many else "binary"
            text = ", ".join(name for name, c in REGISTRY.items() if c.text and not c.writes_many)
            raise UsageError(f"format {cls.name} is {what}: -o - (stdout) takes text formats only ({text}); "
                             "give a file name")
    elif path.is_dir() and not cls.writes_many:
        raise BadInput(f"{path} is a directory: -o takes the file to write (e.g. {path / 'profile'}{cls.extension})")


def write_output(exporter: Exporter, profile: Profile, path: Path) -> list[Output]:
    """Write `profile` with `exporter` to `path` (stdout for `-`, else its directory made first); the files
    written (none for stdout). Refuses what `check_output` refuses."""
    check_output(type(exporter), path)
    if is_stdout(path):
        data = exporter.render(profile)
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return []
    make_parent(path)
    return exporter.write(profile, path)
