"""The processes a capture has seen: each one's latest snapshot of executable mappings (agent.procmaps), the
user addresses already found inside it, when it was last read, and how many times the process has exec'd.
Decides when a process's mappings must be read again (an address outside them: a library opened since)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from aiflame.agent.procmaps import BuildIdCache, read_maps, read_process
from aiflame.core.raw import ProcessSnapshot


class ProcessTable:
    def __init__(self) -> None:
        self.snaps: dict[int, ProcessSnapshot] = {}
        self.build_ids = BuildIdCache()
        self._known: dict[int, set[int]] = {}  # pid -> user addresses already inside its mappings
        self._read_at: dict[int, float] = {}
        self._exec_seq: dict[int, int] = {}

    def exec_seq(self, pid: int) -> int:
        """How many times `pid` has exec'd since the capture saw it (0: the image it had then)."""
        return self._exec_seq.get(pid, 0)

    def exec_seen(self, pid: int) -> None:
        self._exec_seq[pid] = self._exec_seq.get(pid, 0) + 1

    def read(self, pid: int, time_ns: int) -> ProcessSnapshot | None:
        """Read `pid`'s mappings now; the new snapshot, or None when the process is gone (a zombie's maps are
        empty: what was read while it lived is kept)."""
        snap = read_process(pid, time_ns, self.build_ids, self.exec_seq(pid))
        self._read_at[pid] = time.monotonic()
        if snap is None or (not snap.mappings and pid in self.snaps):
            return None
        self.snaps[pid] = snap
        self._known[pid] = set()
        return snap

    def stale(self, stacks: Iterable[tuple[int, Sequence[int]]], min_age_s: float) -> list[int]:
        """Processes to read again: those whose user addresses fall outside their mappings (dlopen, late
        libraries), at most once per `min_age_s` each, and at once those never read."""
        stale: set[int] = set()
        for pid, user in stacks:
            known = self._known.get(pid)
            if known is None:
                stale.add(pid)
                continue
            snap = self.snaps[pid]
            for a in user:
                if a not in known:
                    if snap.find(a) is None:
                        stale.add(pid)
                        break
                    known.add(a)
        now = time.monotonic()
        return [pid for pid in stale if now - self._read_at.get(pid, 0.0) >= min_age_s or pid not in self.snaps]

    def read_soon(self, pid: int) -> None:
        """Let the next address outside `pid`'s mappings read them again at once, not min_age_s later."""
        self._read_at[pid] = 0.0

    def unchanged(self, pid: int) -> bool:
        """True when every executable mapping of `pid` is already in its snapshot (cheap: no build ids read)."""
        snap = self.snaps.get(pid)
        if snap is None:
            return False
        known = {(m.start, m.end) for m in snap.mappings}
        return all((lo, hi) in known for lo, hi, perms, *_ in read_maps(pid) or [] if "x" in perms)

    def restart_known(self) -> None:
        """A new capture file: addresses are checked against the snapshots afresh."""
        for pid in self.snaps:
            self._known[pid] = set()

    def forget(self, pid: int) -> None:
        """The process is gone: drop everything kept about it."""
        for table in (self.snaps, self._known, self._read_at, self._exec_seq):
            table.pop(pid, None)
