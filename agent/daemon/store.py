"""The daemon's capture store: where rolling windows and on-demand captures go, each a directory made complete
before it becomes visible (built under a dot-name, then renamed), and retention (windows by age and total size,
captures by count).

Layout under the output directory:
    windows/20260102T030405Z-000017/profile.aiflame, profile.folded
    captures/20260102T030500Z-c0003/profile.aiflame, profile.folded, profile.svg
A directory whose name does not match these patterns is never touched by retention.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aiflame.core.errors import BadInput

WINDOW_RE = re.compile(r"^\d{8}T\d{6}Z-\d{6}(-incomplete)?$")
CAPTURE_RE = re.compile(r"^\d{8}T\d{6}Z-c\d{4,}$")
PARTIAL_PREFIX = ".partial-"
DIR_MODE = 0o750
FILE_UMASK = 0o027  # outputs are readable by root's group at most


def stamp(wall: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(wall))


def _safe_dir(path: Path) -> None:
    """Create `path` (mode 0750) and refuse a symlink in its place: root must not follow one planted there."""
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create {path}: {e.strerror}") from None
    if path.is_symlink() or not path.is_dir():
        raise BadInput(f"{path} is not a plain directory")


class OutputDirs:
    """The daemon's output tree. Everything it writes goes below `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.windows = root / "windows"
        self.captures = root / "captures"

    def prepare(self) -> list[str]:
        """Create the tree; keep what a crash left half-written as `-incomplete` windows. One line per such."""
        notes = []
        for d in (self.root, self.windows, self.captures):
            _safe_dir(d)
        for parent in (self.windows, self.captures):
            for entry in os.scandir(parent):
                if entry.name.startswith(PARTIAL_PREFIX) and entry.is_dir(follow_symlinks=False):
                    name = entry.name[len(PARTIAL_PREFIX):]
                    final = parent / (name + "-incomplete" if parent is self.windows else name)
                    if final.exists():
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.rename(entry.path, final)
                        notes.append(f"kept an interrupted {parent.name[:-1]} as {final}")
        return notes

    def new_partial(self, parent: Path, name: str) -> Path:
        d = parent / (PARTIAL_PREFIX + name)
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(mode=DIR_MODE)
        return d

    def new_window(self, wall: float, seq: Iterator[int]) -> Path:
        """The partial directory of a window that starts at `wall`, named with the next unused number of `seq`."""
        while True:
            name = f"{stamp(wall)}-{next(seq):06d}"
            if not (self.windows / name).exists():
                return self.new_partial(self.windows, name)

    def new_capture(self, wall: float, seq: int) -> Path:
        """The partial directory of on-demand capture number `seq`, started at `wall`."""
        return self.new_partial(self.captures, f"{stamp(wall)}-c{seq:04d}")

    def latest_windows(self, count: int) -> list[Path]:
        """The newest `count` finished windows, oldest first."""
        return [s.path for s in list_stored(self.windows, WINDOW_RE)[-count:]]

    def prune_windows(self, now: float, max_age_s: float, max_bytes: int) -> list[Path]:
        """Retention of windows (enforce_retention); returns the deleted directories."""
        return enforce_retention(self.windows, WINDOW_RE, now, max_age_s, max_bytes)

    def prune_captures(self, keep: int) -> list[Path]:
        """Keep the newest `keep` captures; returns the deleted directories."""
        return enforce_count(self.captures, CAPTURE_RE, keep)

    @staticmethod
    def publish(partial: Path) -> Path:
        """Make a finished window or capture visible under its final name (an atomic rename)."""
        final = partial.with_name(partial.name[len(PARTIAL_PREFIX):])
        os.rename(partial, final)
        return final


@dataclass(frozen=True)
class Stored:
    path: Path
    mtime: float
    size: int


def _dir_size(path: Path) -> int:
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def list_stored(parent: Path, pattern: re.Pattern[str]) -> list[Stored]:
    """Finished windows or captures, oldest first (names start with their UTC time, then a sequence)."""
    out = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    for e in entries:
        if pattern.match(e.name) and e.is_dir(follow_symlinks=False):
            try:
                out.append(Stored(Path(e.path), e.stat(follow_symlinks=False).st_mtime, _dir_size(Path(e.path))))
            except OSError:
                continue
    out.sort(key=lambda s: s.path.name)
    return out


def plan_retention(stored: list[Stored], now: float, max_age_s: float, max_bytes: int,
                   keep_newest: int = 1) -> list[Stored]:
    """Which of `stored` (oldest first) to delete: everything older than `max_age_s`, then the oldest until
    the rest fit in `max_bytes`. The newest `keep_newest` always stay (the window just written)."""
    doomed: list[Stored] = []
    candidates = stored[:max(len(stored) - keep_newest, 0)]
    total = sum(s.size for s in stored)
    for s in candidates:
        if now - s.mtime > max_age_s or total > max_bytes:
            doomed.append(s)
            total -= s.size
    return doomed


def enforce_retention(parent: Path, pattern: re.Pattern[str], now: float, max_age_s: float, max_bytes: int,
                      keep_newest: int = 1) -> list[Path]:
    """Delete what plan_retention picks; returns the deleted paths."""
    deleted = []
    for s in plan_retention(list_stored(parent, pattern), now, max_age_s, max_bytes, keep_newest):
        shutil.rmtree(s.path, ignore_errors=True)
        deleted.append(s.path)
    return deleted


def enforce_count(parent: Path, pattern: re.Pattern[str], keep: int) -> list[Path]:
    """Keep the newest `keep` entries matching `pattern`; delete the rest."""
    stored = list_stored(parent, pattern)
    doomed = stored[:max(len(stored) - keep, 0)]
    for s in doomed:
        shutil.rmtree(s.path, ignore_errors=True)
    return [s.path for s in doomed]
