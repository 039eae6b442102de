"""Read what dies with a process: its executable mappings (with build ids), command line and parent.

The maps are parsed here (psutil's memory_maps() has no file offsets or inodes); the rest comes from psutil."""

from __future__ import annotations

import os

import psutil

from aiflame.core.errors import AiflameError, Refused
from aiflame.core.raw import Mapping, ProcessSnapshot
from aiflame.core.safe_files import open_regular
from aiflame.symbolize.objfmt.elf import read_build_id


class BuildIdCache:
    """Build ids keyed by (device, inode, path) so each file is read once per agent run."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int, str], str] = {}

    def get(self, pid: int, line_dev: str, inode: int, path: str, start: int, end: int) -> str:
        """The build id of the file mapped at start-end in `pid` ("" when it has none or cannot be read).
        `path` is the mapping's, " (deleted)" included."""
        key = (line_dev, inode, path)
        hit = self._ids.get(key)
        if hit is not None:
            return hit
        # map_files reaches the exact file mapped, even deleted or in another mount namespace. Its path, which the
        # process chose, is tried only while it names that same file (device and inode of the maps line), and
        # never for a deleted one (the name is another file's now, or nobody's).
        candidates = [f"/proc/{pid}/map_files/{start:x}-{end:x}"]
        if not path.endswith(" (deleted)"):
            candidates += [f"/proc/{pid}/root{path}", path]
        bid = ""
        for i, candidate in enumerate(candidates):
            try:
                bid = _build_id_of(candidate, None if i == 0 else (line_dev, inode))
                break
            except (OSError, ValueError, AiflameError):
                continue
        self._ids[key] = bid
        return bid


def _build_id_of(path: str, expect: tuple[str, int] | None) -> str:
    """The build id of the regular file at `path` ("" if none); with `expect` (maps-line device, inode), the
    file must be that one."""
    fd, st = open_regular(path)
    try:
        if expect is not None:
            major, _, minor = expect[0].partition(":")
            if (st.st_ino, os.major(st.st_dev), os.minor(st.st_dev)) != (expect[1], int(major, 16), int(minor, 16)):
                raise Refused(f"{path}: not the file mapped")
        return read_build_id(f"/proc/self/fd/{fd}") or ""
    finally:
        os.close(fd)


MapEntry = tuple[int, int, str, int, str, int, str]  # a maps line: start, end, perms, offset, dev, inode, path


def parse_maps(text: str) -> list[MapEntry]:
    """Lines of /proc/PID/maps as (start, end, perms, offset, dev, inode, path)."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        try:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            off = int(parts[2], 16)
            inode = int(parts[4])
        except ValueError:
            continue
        out.append((lo, hi, parts[1], off, parts[3], inode, parts[5].strip() if len(parts) > 5 else ""))
    return out


def read_maps(pid: int) -> list[MapEntry] | None:
    """parse_maps of /proc/PID/maps; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return parse_maps(f.read())
    except OSError:
        return None


def read_process(pid: int, time_ns: int, build_ids: BuildIdCache, exec_seq: int = 0) -> ProcessSnapshot | None:
    """Snapshot the executable mappings of `pid`; None if the process is already gone."""
    # Who the process is first, then its maps: a snapshot taken while it execs then holds the new image's maps
    # whenever it holds the new command line (maps read first could be the old image's, or none mid-exec).
    cmdline: list[str] = []
    comm, ppid, exe = "", 0, ""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            cmdline = [valid_utf8(a) for a in proc.cmdline()]
            # The kernel's comm, as samples carry it: psutil's name() stretches a 15-character one from argv[0].
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            ppid = proc.ppid()
            exe = valid_utf8(proc.exe())
    except (psutil.Error, OSError):
        pass  # the maps are what matter; the rest is best effort
    maps = read_maps(pid)
    if maps is None:
        return None
    mappings = []
    for lo, hi, perms, off, dev, inode, path in maps:
        if "x" not in perms:
            continue
        bid = ""
        if path.startswith("/") and inode:
            bid = build_ids.get(pid, dev, inode, path, lo, hi)
        mappings.append(Mapping(lo, hi, off, path, bid, perms))
    return ProcessSnapshot(pid, time_ns, mappings, ppid, comm, cmdline, exe, exec_seq)


def valid_utf8(s: str) -> str:
    """psutil keeps undecodable bytes as surrogates, which a protobuf string cannot hold: U+FFFD instead."""
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
