"""Process discovery: a cheap periodic scan of the process list (psutil) that finds the processes to watch
(those that map an accelerator runtime, or match the configured selectors) and notices the ones that are gone.

Each process is known by psutil's identity (pid and start time), so a reused pid is a new process. A process
that is not (yet) a target is re-checked now and then: a Python job maps libtorch or libcudart only when it
imports them. What psutil does not give is read from /proc: the kernel's comm (psutil's name() stretches a
15-character one from argv[0]), the cgroup path, and the file names in /proc/PID/maps (psutil's memory_maps
reads the much larger smaps).
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import psutil

from aiflame.agent.daemon.config import WatchConfig
from aiflame.agent.procmaps import valid_utf8

# File names of accelerator runtimes as they appear in /proc/PID/maps (versioned sonames included).
_ACCEL = re.compile(
    r"/(?P<lib>libcudart|libcuda|libnccl|libze_loader|libtorch_cuda|libtorch_cpu|libtorch|libamdhip64)"
    r"(?:-[0-9a-f]{8})?\.so(?:\.[0-9.]+)?(?: \(deleted\))?$"
)
RUNTIME_OF = {
    "libcudart": "cuda", "libcuda": "cuda", "libnccl": "nccl", "libze_loader": "level_zero",
    "libtorch_cuda": "torch", "libtorch_cpu": "torch", "libtorch": "torch", "libamdhip64": "hip",
}


def accelerator_runtimes(maps_text: str) -> set[str]:
    """The accelerator runtimes a process maps, from the text of its /proc/PID/maps."""
    found: set[str] = set()
    for line in maps_text.splitlines():
        slash = line.find("/")
        if slash < 0:
            continue
        m = _ACCEL.search(line, slash - 1 if slash else 0)
        if m:
            found.add(RUNTIME_OF[m.group("lib")])
    return found


@dataclass(frozen=True)
class ProcInfo:
    """What the selectors look at."""

    pid: int
    created: float  # psutil's create_time: seconds since the epoch
    comm: str
    exe: str
    cmdline: str
    cgroup: str
    runtimes: frozenset[str]
    uid: int = -1  # real user id
    ppid: int = 0


class Selector:
    """The watch rules of the configuration, compiled."""

    def __init__(self, cfg: WatchConfig) -> None:
        self.cfg = cfg
        self._cmdlines = [re.compile(r) for r in cfg.cmdlines]

    @staticmethod
    def _glob(patterns: Iterable[str], info: ProcInfo) -> bool:
        base = os.path.basename(info.exe)
        return any(fnmatch.fnmatchcase(info.comm, p) or (base and fnmatch.fnmatchcase(base, p)) for p in patterns)

    def wants(self, info: ProcInfo) -> bool:
        if self._glob(self.cfg.exclude, info):
            return False
        if self.cfg.accelerators and info.runtimes:
            return True
        if self._glob(self.cfg.names, info):
            return True
        if any(r.search(info.cmdline) for r in self._cmdlines):
            return True
        return any(info.cgroup == c or info.cgroup.startswith(c.rstrip("/") + "/") for c in self.cfg.cgroups)

    @property
    def needs_maps(self) -> bool:
        return self.cfg.accelerators


KTHREAD_RECHECK_S = 600.0  # kernel threads were re-read at every scan: most of an idle daemon's CPU


def _read(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    return data.decode(errors="replace")


def _cgroup(pid: int) -> str:
    """The process's cgroup in the unified hierarchy (psutil has no cgroups)."""
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        if line.startswith("0::"):
            return line[3:]
    return ""


def vm_size(proc: psutil.Process) -> int | None:
    """The process's virtual size in bytes: it grows when a library is mapped. None when it is gone."""
    try:
        return int(proc.memory_info().vms)
    except psutil.Error:
        return None


def read_info(proc: psutil.Process, with_maps: bool) -> ProcInfo | None:
    """The selector's view of `proc`; None for a process that is gone, a zombie or a kernel thread."""
    try:
        with proc.oneshot():
            cmdline = valid_utf8(" ".join(proc.cmdline()).strip())
            if not cmdline:
                return None  # kernel threads (and zombies) have no command line
            created = proc.create_time()
            uid = proc.uids().real
            ppid = proc.ppid()
            try:
                exe = valid_utf8(proc.exe())
            except psutil.AccessDenied:
                exe = ""
        comm = _read(f"/proc/{proc.pid}/comm").strip()  # the kernel's (psutil's name() stretches a long one)
        cgroup = _cgroup(proc.pid)
        runtimes = frozenset(accelerator_runtimes(_read(f"/proc/{proc.pid}/maps"))) if with_maps else frozenset()
    except (psutil.Error, OSError):
        return None
    return ProcInfo(proc.pid, created, comm, exe, cmdline, cgroup, runtimes, uid, ppid)


def process_info(pid: int) -> ProcInfo | None:
    """read_info of `pid` without its maps; None when there is no such process (or it is a kernel thread)."""
    try:
        return read_info(psutil.Process(pid), False)
    except psutil.Error:
        return None


class _Seen(NamedTuple):
    """A process judged not to be a target: when to look again, and what it looked like."""

    proc: psutil.Process  # its identity (pid and start time); caches its create time
    next_check: float
    vms: int | None  # virtual size then (None: not read)
    runtimes: frozenset[str]


class Discovery:
    """Finds targets among the host's processes. `scan()` returns the new targets and the pids seen before that
    are gone.

    Memory stays bounded by the number of live processes: entries for vanished pids are dropped at each scan.
    """

    def __init__(self, selector: Selector, exclude_pids: Iterable[int] = (), recheck_s: float = 10.0) -> None:
        self.selector = selector
        self.recheck_s = recheck_s
        self._exclude = set(exclude_pids)
        self._seen: dict[int, _Seen] = {}  # non-target pids
        self.targets: dict[int, ProcInfo] = {}

    def set_selector(self, selector: Selector) -> None:
        """A reloaded configuration: every non-target is checked again at the next scan."""
        self.selector = selector
        self._seen.clear()

    def scan(self, now: float | None = None) -> tuple[list[ProcInfo], list[int]]:
        now = time.monotonic() if now is None else now
        wall = time.time()
        pids = psutil.pids()
        live = set(pids)
        new: list[ProcInfo] = []
        for pid in pids:
            if pid in self.targets or pid in self._exclude:
                continue
            seen = self._seen.get(pid)
            if seen is not None and now < seen.next_check:
                continue
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                self._seen.pop(pid, None)
                continue
            if seen is not None and proc == seen.proc:  # the same process (not a reused pid)
                proc = seen.proc  # knows its create time already
            else:
                seen = None
            # A re-check reads the maps (the costly file of a big process) only when the size changed since.
            vms = vm_size(proc) if self.selector.needs_maps else None
            same_size = seen is not None and vms is not None and vms == seen.vms
            info = read_info(proc, self.selector.needs_maps and not same_size)
            if info is not None and seen is not None and same_size:
                info = replace(info, runtimes=seen.runtimes)
            if info is None:
                if not proc.is_running():
                    self._seen.pop(pid, None)
                else:  # a kernel thread (no command line): never a target, looked at again only rarely
                    self._seen[pid] = _Seen(proc, now + KTHREAD_RECHECK_S, None, frozenset())
                continue
            if self.selector.wants(info):
                self._seen.pop(pid, None)
                self.targets[pid] = info
                new.append(info)
            else:
                # A young process is about to load its libraries (Python imports torch after it starts): look
                # again sooner the younger it is, up to every `recheck_s` for old ones.
                wait = min(self.recheck_s, max(wall - info.created, 0.0) / 2)
                self._seen[pid] = _Seen(proc, now + wait, vms, info.runtimes)
        gone = [pid for pid in self.targets if pid not in live]
        for pid in gone:
            del self.targets[pid]
        for pid in [p for p in self._seen if p not in live]:
            del self._seen[pid]
        return new, gone

    def add(self, info: ProcInfo) -> None:
        self.targets[info.pid] = info

    def forget(self, pid: int) -> None:
        """The process exited (its exit event came before the next scan)."""
        self.targets.pop(pid, None)
        self._seen.pop(pid, None)
