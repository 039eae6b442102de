"""At the end of a capture, keep the GPU code needed to symbolize it offline: the cubins (every architecture)
that define a kernel the targets launched, read from the fatbins their registrations pointed at (in a file, or
copied from memory while the process lived)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Iterator

from aiflame.core.errors import Refused, Unreadable
from aiflame.core.raw import GpuCode, RawEvent
from aiflame.core.safe_files import open_regular
from aiflame.symbolize.accel.cubin import parse_cubin
from aiflame.symbolize.accel.fatbin import FatbinEntry, iter_entries, iter_file_entries

MAX_FATBIN_BYTES = 1 << 30
REGISTRATIONS = ("__cudaRegisterFatBinary", "__cudaRegisterFunction")


def _file_entries(path: str, offset: int, size: int, label: str) -> Iterator[FatbinEntry] | None:
    """The entries of the fatbin at `offset` of the regular file a target's registration named, read one at a
    time (nothing but a regular file is opened); None when it cannot be opened."""
    if not 0 < size <= MAX_FATBIN_BYTES or offset < 0:
        return None
    try:
        fd, _st = open_regular(path)
    except (OSError, Refused):
        return None

    def entries() -> Iterator[FatbinEntry]:
        try:
            yield from iter_file_entries(fd, offset, label=label, limit=size)
        finally:
            os.close(fd)

    return entries()


def launched_cubins(events: Iterable[RawEvent], stored: dict[str, bytes]) -> tuple[list[GpuCode], list[str]]:
    """Cubins defining launched kernels, and one-line warnings for fatbins that could not be read.

    `stored` holds fatbins already copied from memory, by digest (registration events name them)."""
    regs: dict[tuple[int, int], RawEvent] = {}  # (pid, fatbin handle) -> registration
    funcs: dict[tuple[int, int], tuple[int, str]] = {}  # (pid, host stub) -> (fatbin handle, device name)
    launched: set[tuple[int, int]] = set()
    launched_names: set[str] = set()
    for e in events:
        if e.call == "__cudaRegisterFatBinary" and e.args.get("handle"):
            regs[(e.pid, e.args["handle"])] = e
        elif e.call == "__cudaRegisterFunction" and "name" in e.strs:
            funcs[(e.pid, e.args.get("func", 0))] = (e.args.get("handle", 0), e.strs["name"])
        elif e.kind == "compute":
            if e.args.get("func"):
                launched.add((e.pid, e.args["func"]))
            if "name" in e.strs:
                launched_names.add(e.strs["name"])
    wanted: dict[tuple[int, int], set[str]] = defaultdict(set)  # registration -> kernel names launched from it
    for pid, func in launched:
        hit = funcs.get((pid, func))
        if hit and (pid, hit[0]) in regs:
            wanted[(pid, hit[0])].add(hit[1])
    out: list[GpuCode] = []
    warnings: list[str] = []
    seen: set[str] = set()
    done_sources: set[tuple[str, int]] = set()
    for key, names in wanted.items():
        reg = regs[key]
        path = reg.strs.get("fatbin_file")
        entries: Iterator[FatbinEntry] | None
        if path:
            source = (path, reg.args.get("fatbin_file_offset", 0))
            if source in done_sources:
                continue
            done_sources.add(source)
            origin = path
            entries = _file_entries(path, source[1], reg.args.get("fatbin_size", 0), _label(origin))
        else:
            data = stored.get(reg.strs.get("digest", ""))
            origin = f"memory of pid {reg.pid}"
            entries = None if data is None else iter_entries(data, label=origin)
        if entries is None:
            warnings.append(f"cannot read the fatbin of pid {reg.pid} ({origin}): its kernels stay unsymbolized")
            continue
        out.extend(_cubins_with(entries, names | launched_names, origin, seen, warnings))
    return out, warnings


def _label(origin: str) -> str:
    return os.path.basename(origin) if origin.startswith("/") else origin


def _cubins_with(entries: Iterator[FatbinEntry], names: set[str], origin: str, seen: set[str],
                 warnings: list[str]) -> list[GpuCode]:
    label = _label(origin)
    out: list[GpuCode] = []
    try:
        for entry in entries:
            if entry.kind != "elf" or entry.error or entry.digest in seen:
                if entry.error:
                    warnings.append(f"{label}: {entry.error}")
                continue
            try:
                cubin = parse_cubin(entry.data, label=f"{label} sm_{entry.arch}", digest=entry.digest)
            except Unreadable as e:
                warnings.append(str(e))
                continue
            if names & cubin.kernels.keys():
                seen.add(entry.digest)
                out.append(GpuCode(entry.digest, "cubin", cubin.arch, origin, entry.data))
    except Unreadable as e:
        warnings.append(str(e))
    return out


class LaunchLog:
    """The runtime events a capture keeps for its end, where `cubins` looks up the GPU code of the kernels they
    launched. A capture that ends keeps every event; a `bounded` one (the daemon's, which never ends) keeps the
    registrations for as long as their process lives and one launch per kernel."""

    def __init__(self, bounded: bool = False) -> None:
        self.bounded = bounded
        self._events: list[RawEvent] = []
        self._registrations: dict[int, list[RawEvent]] = {}  # pid -> fatbin/function registrations (bounded)

    def add(self, events: Iterable[RawEvent]) -> None:
        self._events.extend(events)
        if not self.bounded:
            return
        keep: dict[tuple[int, int, str], RawEvent] = {}
        for e in self._events:
            if e.call in REGISTRATIONS:
                self._registrations.setdefault(e.pid, []).append(e)
            elif e.kind == "compute":
                keep.setdefault((e.pid, e.args.get("func", 0), e.strs.get("name", "")), e)
        self._events[:] = keep.values()

    @property
    def events(self) -> list[RawEvent]:
        return [*(e for evs in self._registrations.values() for e in evs), *self._events]

    def saw_runtime(self, runtime: str) -> bool:
        return any(e.runtime == runtime for e in self._events)

    def cubins(self, stored: dict[str, bytes]) -> tuple[list[GpuCode], list[str]]:
        """launched_cubins of the events kept."""
        return launched_cubins(self.events, stored)

    def end_file(self) -> None:
        """A capture file is finished: its launches are done with (registrations stay)."""
        self._events.clear()

    def forget(self, pid: int) -> None:
        """The process exited: its registrations go."""
        self._registrations.pop(pid, None)
