"""The native half of `aiflame dump` (agent/dump.py): the target's threads stopped with PTRACE_SEIZE +
PTRACE_INTERRUPT and their registers read (`_Ptrace`), their stacks unwound in user space through the same DWARF
CFI tables the BPF unwinder uses, frame pointers where a file has none (`_Unwinder`), and the return addresses of
all threads named once per binary (`_Names`). Names with a leading underscore are shared with agent/dump.py only.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import time
from dataclasses import dataclass

from aiflame.agent.procmaps import read_maps
from aiflame.core.errors import TargetGone, Unreadable
from aiflame.core.model import Frame, FrameKind
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.objfmt import cfi
from aiflame.symbolize.objfmt.cfi.table import (
    CFA_DEREF_RBP,
    CFA_END,
    CFA_PLT,
    CFA_PLT10,
    CFA_RBP,
    CFA_RSP,
    RBP_AT_RBP,
    RBP_INVALID,
    RBP_OFFSET,
    UnwindTable,
)
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.process_memory import ProcessMemory

MAX_NATIVE = 128
STOP_WAIT_S = 0.5  # how long all threads together get to stop (one in D state may never)

_PTRACE_GETREGS, _PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 12, 17, 0x4206, 0x4207
_WALL = 0x40000000
_REG_RBP, _REG_RIP, _REG_RSP = 4, 16, 19


def _read(path: str, limit: int = 4096) -> str:
    """The start of a /proc file as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _tracer(tid: int) -> int:
    """The pid tracing `tid` (a debugger, strace, py-spy), 0 for none."""
    for line in _read(f"/proc/{tid}/status").splitlines():
        if line.startswith("TracerPid:"):
            v = line.split(":", 1)[1].strip()
            return int(v) if v.isdigit() else 0
    return 0


# --- stopping threads -----------------------------------------------------------------------------------------


class _Ptrace:
    """Threads seized and interrupted; registers read; all detached by `release` (also on any error)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self._libc.ptrace.restype = ctypes.c_long
        self.seized: list[int] = []
        self.stopped: set[int] = set()

    def _call(self, req: int, tid: int, data: ctypes.c_void_p | None = None) -> int:
        ctypes.set_errno(0)
        r = self._libc.ptrace(req, tid, None, data)
        return 0 if r == 0 else ctypes.get_errno() or errno.EIO

    def stop(self, tids: list[int]) -> str:
        """Stop what can be stopped; '' or why not all were."""
        why = ""
        for tid in tids:
            err = self._call(_PTRACE_SEIZE, tid)
            if err:
                if err != errno.ESRCH:  # a thread that exited is no failure
                    tracer = _tracer(tid)
                    why = why or (f"cannot stop thread {tid}: already traced by pid {tracer}" if tracer else
                                  f"cannot stop thread {tid}: {os.strerror(err)}")
                continue
            self.seized.append(tid)
            self._call(_PTRACE_INTERRUPT, tid)
        waiting = set(self.seized)
        end = time.monotonic() + STOP_WAIT_S
        while waiting and time.monotonic() < end:
            for tid in list(waiting):
                try:
                    got, status = os.waitpid(tid, os.WNOHANG | _WALL)
                except ChildProcessError:
                    waiting.discard(tid)  # exited
                    continue
                if got == tid:
                    waiting.discard(tid)
                    if os.WIFSTOPPED(status):
                        self.stopped.add(tid)
            if waiting:
                time.sleep(0.001)
        if waiting:
            why = why or f"{len(waiting)} thread(s) did not stop within {STOP_WAIT_S} s"
        return why

    def regs(self, tid: int) -> tuple[int, int, int] | None:
        """(rip, rsp, rbp) of a stopped thread."""
        if tid not in self.stopped:
            return None
        buf = (ctypes.c_uint64 * 27)()
        if self._call(_PTRACE_GETREGS, tid, ctypes.cast(buf, ctypes.c_void_p)):
            return None
        return buf[_REG_RIP], buf[_REG_RSP], buf[_REG_RBP]

    def release(self) -> None:
        for tid in self.seized:
            self._call(_PTRACE_DETACH, tid)
        self.seized.clear()
        self.stopped.clear()



# --- native unwinding -------------------------------------------------------------------------------------------


@dataclass
class _Map:
    start: int
    end: int
    offset: int
    path: str
    bias: int | None = None  # runtime address minus link-time address; None: not computed yet
    table: UnwindTable | None = None
    tried: bool = False


class _Unwinder:
    """User-space unwinding of one process's threads through the CFI tables of its file mappings."""

    def __init__(self, pid: int, mem: ProcessMemory) -> None:
        self.pid = pid
        self.mem = mem
        self.maps: list[_Map] = []
        for lo, hi, perms, off, _dev, inode, path in read_maps(pid) or []:
            if "x" in perms and inode and path.startswith("/"):
                self.maps.append(_Map(lo, hi, off, path))
        self._starts = [m.start for m in self.maps]
        self.errors: dict[str, str] = {}

    def find(self, pc: int) -> _Map | None:
        i = bisect.bisect_right(self._starts, pc) - 1
        return self.maps[i] if i >= 0 and pc < self.maps[i].end else None

    def _prepare(self, m: _Map) -> None:
        m.tried = True
        where = f"/proc/{self.pid}/map_files/{m.start:x}-{m.end:x}"
        try:
            with ElfFile.open(where) as elf:
                vaddr = elf.file_offset_to_vaddr(m.offset)
            if vaddr is None:
                return
            m.bias = m.start - vaddr
            m.table = cfi.load_or_build(where)
        except (Unreadable, OSError) as e:
            self.errors.setdefault(m.path, str(e).replace(where, m.path))

    def unwind(self, rip: int, rsp: int, rbp: int) -> list[int]:
        """Return addresses, leaf (the PC itself) first."""
        pcs = [rip]
        pc = rip
        for _ in range(MAX_NATIVE - 1):
            m = self.find(pc if len(pcs) == 1 else pc - 1)
            if m is None:
                break
            if not m.tried:
                self._prepare(m)
            kind = -1
            rule = None
            if m.table is not None and m.bias is not None:
                rule = m.table.lookup((pc if len(pcs) == 1 else pc - 1) - m.bias)
                kind = rule.cfa_type
            try:
                if rule is not None and kind in (CFA_RSP, CFA_RBP, CFA_PLT, CFA_PLT10, CFA_DEREF_RBP):
                    if kind == CFA_RSP:
                        cfa = rsp + rule.cfa_off
                    elif kind == CFA_RBP:
                        cfa = rbp + rule.cfa_off
                    elif kind in (CFA_PLT, CFA_PLT10):
                        cfa = rsp + 8 + (8 if (pc & 15) >= (11 if kind == CFA_PLT else 10) else 0)
                    else:
                        cfa = self.mem.u64(rbp + rule.cfa_off)
                    ra = self.mem.u64(cfa - 8)
                    if rule.rbp_type == RBP_OFFSET:
                        rbp = self.mem.u64(cfa + rule.rbp_off)
                    elif rule.rbp_type == RBP_AT_RBP:
                        rbp = self.mem.u64(rbp + rule.rbp_off)
                    elif rule.rbp_type == RBP_INVALID:
                        rbp = 0
                elif kind == CFA_END:
                    break
                else:  # no table, not covered, or a rule we cannot follow: frame pointers
                    if not rbp or rbp < rsp:
                        break
                    cfa = rbp + 16
                    ra = self.mem.u64(rbp + 8)
                    rbp = self.mem.u64(rbp)
            except TargetGone:
                break
            if not ra or cfa <= rsp:
                break
            pcs.append(ra)
            pc, rsp = ra, cfa
        return pcs


class _Names:
    """Native frames of all threads, symbolized once per binary (a dump of thousands of threads repeats the same
    few hundred return addresses)."""

    def __init__(self, unwinder: _Unwinder, native: NativeSymbolizer, stacks: list[list[int]]) -> None:
        self.unwinder = unwinder
        wanted: dict[str, set[int]] = {}
        for pcs in stacks:
            for i, pc in enumerate(pcs):
                m = unwinder.find(pc if i == 0 else pc - 1)
                if m is not None:
                    wanted.setdefault(m.path, set()).add((pc if i == 0 else pc - 1) - m.start + m.offset)
        self.frames: dict[str, dict[int, Frame]] = {}
        for path, offs in wanted.items():
            try:
                self.frames[path] = native.symbolize(path, None, offs)
            except Unreadable:
                self.frames[path] = {}

    def stack(self, pcs: list[int]) -> list[Frame]:
        """Native frames root -> leaf; return addresses looked up one byte back (the call)."""
        out: list[Frame] = []
        for i, pc in enumerate(pcs):
            look = pc if i == 0 else pc - 1
            m = self.unwinder.find(look)
            if m is None:
                out.append(Frame(f"[unknown] {pc:#x}", FrameKind.UNKNOWN))
                continue
            off = look - m.start + m.offset
            mod = os.path.basename(m.path)
            out.append(self.frames.get(m.path, {}).get(off) or Frame(f"{mod}+{off:#x}", FrameKind.UNKNOWN, mod))
        return out[::-1]
