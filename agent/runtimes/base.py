"""What a runtime plug-in is: the calls it probes (ProbeSpec), and how it turns a probed call into a RawEvent.

A probe reads raw values only (bpf/runtime_probes.bpf.c): argument registers, up to four pointer reads, one
string, and for return probes the return value and a value written through an out-pointer argument. Sources
are numbered: ARG0-ARG5 are the integer argument registers, SP the stack pointer at entry (stack arguments sit
at SP+8, SP+16...), RET_ADDR the caller's return address, DEREF0-DEREF3 the results of earlier reads.
A spec with `regs` (USDT sites, whose arguments may sit in any general register) fills ARG0-ARG5 with the
registers it names instead (symbolize/usdt.py REGISTERS order).
"""

from __future__ import annotations

import abc
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from aiflame.agent.procmaps import MapEntry, read_maps
from aiflame.core import limits
from aiflame.core.errors import Refused, TargetGone
from aiflame.core.limits import charge
from aiflame.core.raw import GpuCode, RawEvent, RawPyFrame
from aiflame.symbolize.process_memory import ProcessMemory, read_cstring

V = TypeVar("V")

ARG0, ARG1, ARG2, ARG3, ARG4, ARG5, SP, RET_ADDR = range(8)
DEREF0, DEREF1, DEREF2, DEREF3 = range(8, 12)
MAX_DEREFS = 4
MAX_REGS = 6


@dataclass(frozen=True, slots=True)
class Deref:
    """Read 8 bytes at (source) + offset."""

    src: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class UsdtValue:
    """Where one USDT argument is found in a Call: a captured register (ARGn), a deref (DEREFn), or a
    constant (`src` -1); cut to `size` bytes, signed or not."""

    src: int
    size: int = 8
    signed: bool = False
    const: int = 0

    def value(self, call: Call) -> int | None:
        if self.src < 0:
            raw: int | None = self.const
        elif self.src >= DEREF0:
            raw = call.derefs[self.src - DEREF0]
        else:
            raw = call.args[self.src]
        if raw is None:
            return None
        bits = 8 * self.size
        v = raw & ((1 << bits) - 1)
        return v - (1 << bits) if self.signed and v >> (bits - 1) else v


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """One probed function. The first of `symbols` present in a library is probed (aliases, versions)."""

    symbols: tuple[str, ...]
    call: str  # the name events carry, e.g. "cudaLaunchKernel"
    ret: bool = False  # also probe the return: end time, return value, `out_arg`
    stack: bool = True  # record the caller's user and Python stack
    derefs: tuple[Deref, ...] = ()
    string: int = -1  # a source holding a char* to read (-1: none)
    out_arg: int = -1  # an argument pointing where the call writes a result (a handle), read at return
    stop: bool = False  # stop the process at entry until the agent has looked at it (see ProbeManager)
    if_opened: bool = False  # with `stop`: only if it opened a shared object since its last such stop
    regs: tuple[int, ...] = ()  # registers (0-15) captured as ARG0.. instead of the argument registers
    # A launch: the argument naming what is launched (the kernel). Calls past the per-CPU record budget are then
    # counted per value of it in BPF, and the next record of the same value stands for them too ("calls").
    sample_arg: int = -1
    # a USDT site: where each of its arguments is in the Call (UsdtValue), and its semaphore's file offset
    usdt: tuple[UsdtValue, ...] = ()
    semaphore: int = 0
    # only in libraries whose file name starts with one of these (the driver's calls are libcuda's alone): the
    # rest of the runtime's libraries are not searched for it (a symbol search is time the opener waits)
    libs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.regs) > MAX_REGS:
            raise ValueError(f"{self.call}: at most {MAX_REGS} registers")
        if len(self.derefs) > MAX_DEREFS:
            raise ValueError(f"{self.call}: at most {MAX_DEREFS} derefs")
        if self.out_arg >= 0 and not self.ret:
            raise ValueError(f"{self.call}: out_arg needs a return probe")


@dataclass(slots=True)
class Call:
    """A probed call as the plug-in sees it: the entry record, and the return when there was one."""

    spec: ProbeSpec
    pid: int
    tid: int
    start_ns: int
    args: tuple[int, ...]  # indexed by ARG0..RET_ADDR
    derefs: tuple[int | None, ...]  # None: the read failed
    string: bytes | None
    user: tuple[int, ...] = ()
    user_err: int = 0
    py: tuple[RawPyFrame, ...] = ()
    py_flags: int = 0
    parent: str = ""  # the probed call (with a return probe) this one ran inside, on the same thread
    end_ns: int = 0
    ret: int | None = None
    out: int | None = None
    calls: int = 1  # calls this one stands for (see ProbeSpec.sample_arg)

    def arg(self, i: int, bits: int = 64, signed: bool = False) -> int:
        """Argument register `i` cut to `bits` (int arguments leave garbage in the upper half)."""
        v = self.args[i] & ((1 << bits) - 1)
        if signed and v >> (bits - 1):
            v -= 1 << bits
        return v

    def deref(self, i: int, bits: int = 64) -> int | None:
        v = self.derefs[i]
        return None if v is None else v & ((1 << bits) - 1)

    def event(self, runtime: str, kind: str, call: str = "", **args: int) -> RawEvent:
        """A RawEvent for this call with the caller's stack; `args` are the named arguments, and "calls" when the
        record stands for more calls than itself."""
        if self.calls > 1:
            args["calls"] = self.calls
        return RawEvent(runtime, call or self.spec.call, kind, self.pid, self.tid, self.start_ns, self.end_ns,
                        self.user, self.user_err, self.py, self.py_flags, dict(args))


def copy_refused(size: int, what: str) -> str:
    """Why a code object of `size` bytes is not copied from a target ("" when it is): each copy is capped by
    core/limits.py (copy_bytes), and all of them together by the target's allowance (ProbeManager charges a
    target's calls to it)."""
    cap = limits.current().copy_bytes
    if size > cap:
        return f"implausible size {size} (more than the {cap} bytes copied of one)"
    try:
        charge(size, what, cap)
    except Refused as e:
        return f"not copied: {e}"
    return ""


def _mapping_at(maps: list[MapEntry], addr: int) -> MapEntry | None:
    return next((m for m in maps if m[0] <= addr < m[1]), None)


def _is_file(m: MapEntry) -> bool:
    return m[6].startswith("/") and not m[6].endswith(" (deleted)")


def _still_mapped(pid: int, m: MapEntry) -> bool:
    """Whether `pid` maps the same file (inode) at the same range as when its maps were read."""
    try:
        return os.stat(f"/proc/{pid}/map_files/{m[0]:x}-{m[1]:x}").st_ino == m[5]
    except OSError:
        return False


class TargetMemory:
    """What runtime plug-ins read a target's memory through (what BPF could not read: pages not yet resident,
    long strings): any process, by pid, and None where a read fails, so a plug-in records what it could not
    read. Reads go through symbolize's ProcessMemory; tests stand in for a target by overriding `read`.

    A torch import registers ~500 fatbins and ~24,000 kernels, most with names longer than a probe's string:
    the `/proc/PID/mem` readers of the last KEEP processes stay open, and their maps are kept for `file_of`
    until `forget_maps` (the manager calls it at every stop of the process: an open, the loader, exit)."""

    KEEP = 16

    def __init__(self) -> None:
        self._readers: OrderedDict[int, ProcessMemory] = OrderedDict()
        self._maps: OrderedDict[int, list[MapEntry]] = OrderedDict()

    def read(self, pid: int, addr: int, size: int) -> bytes | None:
        if size <= 0:
            return None
        kept = self._readers.get(pid)
        if kept is not None:
            self._readers.move_to_end(pid)
            try:
                return kept.read(addr, size)
            except TargetGone:
                # A kept reader may be of the image before an exec, or of an earlier process by that pid: its
                # read fails, and a new reader decides.
                self._drop_reader(pid)
        try:
            mem = ProcessMemory(pid)
        except TargetGone:
            return None
        self._readers[pid] = mem
        while len(self._readers) > self.KEEP:
            self._readers.popitem(last=False)[1].close()
        try:
            return mem.read(addr, size)
        except TargetGone:
            return None

    def _drop_reader(self, pid: int) -> None:
        mem = self._readers.pop(pid, None)
        if mem is not None:
            mem.close()

    def file_of(self, pid: int, addr: int) -> tuple[str, int] | None:
        """The file and file offset mapped at `addr` in `pid` (any permissions); None for anonymous memory and for
        a file deleted since it was mapped (its path names another file, or none: read the memory instead).
        A file mapping in the kept maps answers if the process still maps that file there (its map_files entry,
        one stat); anything else reads them again."""
        kept = self._maps.get(pid)
        m = _mapping_at(kept, addr) if kept is not None else None
        if m is None or not _is_file(m) or not _still_mapped(pid, m):
            maps = read_maps(pid)
            if maps is None:
                self._maps.pop(pid, None)
                return None
            self._maps[pid] = maps
            self._maps.move_to_end(pid)
            while len(self._maps) > self.KEEP:
                self._maps.popitem(last=False)
            m = _mapping_at(maps, addr)
            if m is None or not _is_file(m):
                return None
        return m[6], addr - m[0] + m[3]

    def forget_maps(self, pid: int) -> None:
        """`pid` may have mapped or unmapped something: its kept maps go."""
        self._maps.pop(pid, None)

    def forget(self, pid: int) -> None:
        """`pid` exited: its reader and maps go."""
        self._maps.pop(pid, None)
        self._drop_reader(pid)

    def close(self) -> None:
        for pid in list(self._readers):
            self._drop_reader(pid)
        self._maps.clear()

    def read_u64(self, pid: int, addr: int) -> int | None:
        data = self.read(pid, addr, 8)
        return None if data is None else int.from_bytes(data, "little")

    def read_cstr(self, pid: int, addr: int, limit: int = 4096) -> str | None:
        """The string at `addr`, cut at `limit` bytes; None when a read before its end fails."""
        def read(at: int, n: int) -> bytes:
            data = self.read(pid, at, n)
            if data is None:
                raise TargetGone(f"pid {pid}: cannot read {n} bytes at {at:#x}")
            return data

        try:
            return read_cstring(read, addr, limit).decode("utf-8", "replace")
        except TargetGone:
            return None


@dataclass
class Library:
    """A shared object or executable a target maps; plug-ins decide from its name and sections."""

    path: str
    sections: frozenset[str] = field(default_factory=frozenset)

    @property
    def basename(self) -> str:
        return os.path.basename(self.path)


def drop_pid(table: dict[tuple[int, int], V], pid: int) -> None:
    """Remove the entries of `pid` from a table keyed by (pid, something): per-process plug-in state."""
    for key in [k for k in table if k[0] == pid]:
        del table[key]


class Runtime(abc.ABC):
    """A runtime plug-in. Subclasses set `name`, list `specs`, and implement `wants` and `decode`.

    Instances keep per-process state (handles seen, ranks) and are used by one capture."""

    name: ClassVar[str]

    @abc.abstractmethod
    def specs(self) -> list[ProbeSpec]:
        """Every call this runtime may probe (those absent from a library are skipped)."""

    @abc.abstractmethod
    def wants(self, lib: Library) -> bool:
        """Is `lib` one of this runtime's libraries? Cheap: name and section names only."""

    @abc.abstractmethod
    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        """The events of one call (none, one, or several), and code objects it loaded. Called once the call
        returned, or when the capture ends before it did (end_ns 0); nested calls finish before their parent."""

    def usdt(self) -> dict[tuple[str, str], tuple[str, int]]:
        """USDT sites this runtime probes in any library that has them: (provider, name) -> (the call name
        events carry, index of the argument that is a char* to read or -1)."""
        return {}

    def forget(self, pid: int) -> None:  # noqa: B027 - optional hook: stateless runtimes keep the default
        """The process exited or exec'd: drop its state."""
