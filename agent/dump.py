"""`aiflame dump`: every thread's stack of a live process, now, with its state.

A one-shot dump reads the target from user space rather than through BPF (a BPF pass would only see the threads
that run during it; a dump wants the sleeping ones most). The steps:
- each thread's state (R, S, D, ...) from /proc/PID/task/TID/stat, read before anything stops it;
- the threads stopped with PTRACE_SEIZE + PTRACE_INTERRUPT (as py-spy pauses its target), their registers read
  (PTRACE_GETREGS), and detached as soon as the stacks are read; `--nonblocking` skips this (no native frames);
- native stacks unwound here in user space with the same DWARF CFI tables the BPF unwinder uses
  (symbolize/objfmt/cfi, built once per binary and cached), falling back to frame pointers where a file has none;
- Python frames read from the interpreter's thread states (agent/python/detect.py finds the runtime and checks
  its layout), named by CodeResolver and merged into the native stack as profiles merge them
  (symbolize/python/merge.py);
- the GIL holder: the interpreter's GIL state (`locked`, `last_holder`), at offsets taken from the pyenv
  builds' DWARF (3.10–3.13; 3.13 reads them from `_Py_DebugOffsets` when it can).
Everything a hostile target controls (thread counts, memory, names) is bounded; a read that fails ends that
thread's walk with a note, never the dump.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import time
from dataclasses import dataclass, field

from aiflame.agent.procmaps import read_maps
from aiflame.agent.python.detect import (
    PyTarget,
    PythonNotLoaded,
    PythonUnsupported,
    current_frame,
    detect_python,
    read_frame,
    tstate_tid,
)
from aiflame.core.errors import BadInput, TargetGone
from aiflame.core.model import Frame, FrameKind
from aiflame.core.python_layouts import PyLayout
from aiflame.core.raw import RawPyFrame
from aiflame.symbolize.errors import SymbolizeError
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.objfmt import cfi
from aiflame.symbolize.objfmt.cfi.table import (
    CFA_DEREF_RBP,
    CFA_END,
    CFA_PLT,
    CFA_PLT10,
    CFA_RBP,
    CFA_RSP,
    RBP_INVALID,
    RBP_OFFSET,
    UnwindTable,
)
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.process_memory import ProcessMemory, ProcessMemoryError
from aiflame.symbolize.python.code import CodeResolver, line_for
from aiflame.symbolize.python.merge import fold_interpreter, merge, python_runs

__all__ = ["DumpResult", "ThreadDump", "dump_process"]

MAX_THREADS = 4096  # threads dumped; the rest are counted
MAX_NATIVE = 128
MAX_PY = 256
STOP_WAIT_S = 0.5  # how long all threads together get to stop (one in D state may never)

STATES = {"R": "running", "S": "sleeping", "D": "disk", "T": "stopped", "t": "traced", "Z": "zombie",
          "X": "dead", "I": "idle", "P": "parked", "W": "waking"}

# GIL state offsets from the pyenv builds' DWARF (gdb: &((struct pyruntimestate*)0)->ceval.gil, etc.):
# (where the GIL is: "runtime" = embedded in _PyRuntime at off, "interp" = pointer at interp + off),
# offset of `locked` (int) and of `last_holder` (pointer) in struct _gil_runtime_state.
_GIL: dict[tuple[int, int], tuple[str, int, int, int]] = {
    (3, 10): ("runtime", 352, 16, 8),
    (3, 11): ("runtime", 360, 16, 8),
    (3, 12): ("interp", 384, 16, 8),
    (3, 13): ("interp", 16, 16, 8),
}

_PTRACE_GETREGS, _PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 12, 17, 0x4206, 0x4207
_WALL = 0x40000000
_REG_RBP, _REG_RIP, _REG_RSP = 4, 16, 19


@dataclass
class ThreadDump:
    tid: int
    name: str
    state: str  # running, sleeping, disk, ... or "exited"
    gil: bool = False
    waits_for_gil: bool = False  # its native stack is in take_gil (it wants to run Python)
    stack: tuple[Frame, ...] = ()  # root -> leaf
    python: int = 0  # Python frames in `stack`
    notes: list[str] = field(default_factory=list)


@dataclass
class DumpResult:
    pid: int
    command: str
    python: str  # "CPython 3.12.1 (/path)" or "" when none
    threads: list[ThreadDump]
    skipped_threads: int = 0
    stopped_s: float = 0.0  # how long the threads were held stopped (0: never stopped)
    gil_known: bool = False
    notes: list[str] = field(default_factory=list)


# --- /proc --------------------------------------------------------------------------------------------------


def _read(path: str, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _thread_state(pid: int, tid: int) -> tuple[str, str]:
    """(name, state) of a thread; state "exited" when it is gone."""
    stat = _read(f"/proc/{pid}/task/{tid}/stat")
    end = stat.rfind(")")
    if end < 0 or len(stat) < end + 3:
        return "", "exited"
    name = stat[stat.find("(") + 1:end]
    code = stat[end + 2]
    return name, STATES.get(code, code)


def _tracer(tid: int) -> int:
    """The pid tracing `tid` (a debugger, strace, py-spy), 0 for none."""
    for line in _read(f"/proc/{tid}/status").splitlines():
        if line.startswith("TracerPid:"):
            v = line.split(":", 1)[1].strip()
            return int(v) if v.isdigit() else 0
    return 0


def _tids(pid: int) -> list[int]:
    try:
        names = os.listdir(f"/proc/{pid}/task")
    except OSError:
        raise TargetGone(f"process {pid} does not exist (or is gone)") from None
    return sorted(int(n) for n in names if n.isdigit())


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
        except (SymbolizeError, OSError) as e:
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
            except ProcessMemoryError:
                break
            if not ra or cfa <= rsp:
                break
            pcs.append(ra)
            pc, rsp = ra, cfa
        return pcs


# --- Python -------------------------------------------------------------------------------------------------


def _py_frames(mem: ProcessMemory, tstate: int, lay: PyLayout) -> list[RawPyFrame]:
    """The thread state's frames, newest first, with what python_runs needs (owner, is_entry)."""
    out: list[RawPyFrame] = []
    frame = current_frame(mem, tstate, lay)
    seen: set[int] = set()
    while frame and len(out) < MAX_PY and frame not in seen:
        seen.add(frame)
        out.append(read_frame(mem, frame, lay))
        frame = mem.u64(frame + lay.frame_back)
    return out


def _python_threads(mem: ProcessMemory, t: PyTarget) -> dict[int, int]:
    """Kernel tid -> thread state of every Python thread (up to MAX_THREADS; detect.python_threads stops at 256),
    matched as detect.python_threads matches them."""
    lay = t.layout
    interp = mem.u64(t.runtime_addr + lay.runtime_interp_head)
    out: dict[int, int] = {}
    ts = mem.u64(interp + lay.interp_tstate_head) if interp else 0
    seen: set[int] = set()
    while ts and len(seen) < MAX_THREADS and ts not in seen:
        seen.add(ts)
        tid = tstate_tid(mem, ts, lay, t.tid_offset)
        if tid:
            out.setdefault(tid, ts)
        ts = mem.u64(ts + lay.tstate_next)
    return out


def _gil_holder(mem: ProcessMemory, t: PyTarget) -> int | None:
    """Address of the thread state holding the GIL, 0 when it is free; None when it cannot be read."""
    spec = _GIL.get(t.version[:2])
    if spec is None:
        return None
    where, off, locked_off, holder_off = spec
    try:
        if where == "runtime":
            gil = t.runtime_addr + off
        else:
            interp = mem.u64(t.runtime_addr + t.layout.runtime_interp_head)
            gil = mem.u64(interp + off) if interp else 0
        if not gil:
            return None
        locked = int.from_bytes(mem.read(gil + locked_off, 4), "little")
        return mem.u64(gil + holder_off) if locked else 0
    except ProcessMemoryError:
        return None


# --- the dump -----------------------------------------------------------------------------------------------


def _command(pid: int) -> str:
    args = _read(f"/proc/{pid}/cmdline", 1024).split("\0")
    return " ".join(a for a in args if a)[:200] or _read(f"/proc/{pid}/comm").strip()


def dump_process(pid: int, native: NativeSymbolizer, *, stop: bool = True, native_stacks: bool = True,
                 fold: bool = True) -> DumpResult:
    """Every thread of `pid` (up to MAX_THREADS) with its state, GIL and stack. `stop`: pause the threads with
    ptrace while reading (consistent stacks, and the only way to their registers); without it, Python frames
    only. TargetGone when the process does not exist."""
    tids = _tids(pid)
    skipped = max(len(tids) - MAX_THREADS, 0)
    tids = tids[:MAX_THREADS]
    res = DumpResult(pid, _command(pid), "", [], skipped)
    states = {tid: _thread_state(pid, tid) for tid in tids}  # before stopping: a stop changes every state
    if not _read(f"/proc/{pid}/maps", 1) and not _read(f"/proc/{pid}/cmdline", 1) and os.path.exists(f"/proc/{pid}"):
        raise BadInput(f"pid {pid} is a kernel thread: it has no user-space stack to dump")
    try:
        mem = ProcessMemory(pid)
    except ProcessMemoryError as e:
        raise TargetGone(str(e)) from None
    target: PyTarget | None = None
    try:
        target = detect_python(pid)
    except (PythonUnsupported, PythonNotLoaded) as e:
        res.notes.append(str(e))
    except OSError as e:
        res.notes.append(f"Python detection failed: {e}")
    if target is not None:
        res.python = f"CPython {'.'.join(map(str, target.version))} ({target.binary})"
        res.notes.extend(target.warnings)
    pt = _Ptrace() if stop and native_stacks else None
    raw: dict[int, tuple[list[int], list[RawPyFrame]]] = {}
    tstates: dict[int, int] = {}
    holder: int | None = None
    unwinder: _Unwinder | None = None
    t_stop = 0.0
    try:
        if pt is not None:
            t_stop = time.monotonic()
            why = pt.stop(tids)
            if why:
                res.notes.append(why + " (those threads: Python frames only)")
        if target is not None:
            try:
                tstates = _python_threads(mem, target)
            except ProcessMemoryError as e:
                res.notes.append(f"Python thread states unreadable: {e}")
            holder = _gil_holder(mem, target)
            res.gil_known = holder is not None
        unwinder = _Unwinder(pid, mem) if pt is not None else None
        for tid in tids:
            pcs: list[int] = []
            regs = pt.regs(tid) if pt is not None else None
            if regs is not None and unwinder is not None:
                pcs = unwinder.unwind(*regs)
            pyf: list[RawPyFrame] = []
            ts = tstates.get(tid)
            if ts is not None and target is not None:
                try:
                    pyf = _py_frames(mem, ts, target.layout)
                except ProcessMemoryError:
                    pyf = []
            raw[tid] = (pcs, pyf)
    finally:
        if pt is not None:
            if pt.seized:
                res.stopped_s = time.monotonic() - t_stop
            pt.release()  # the target runs again before any symbolizing
    if unwinder is not None and unwinder.errors:
        res.notes.extend(f"no CFI table, frame pointers only: {e}" for e in list(unwinder.errors.values())[:3])
    resolver = CodeResolver(pid, target.layout) if target is not None else None
    names = _Names(unwinder, native, [pcs for pcs, _ in raw.values()]) if unwinder is not None else None
    py_names: dict[tuple[int, int], Frame] = {}
    try:
        for tid in tids:
            name, state = states[tid]
            pcs, pyf = raw[tid]
            td = ThreadDump(tid, name, state)
            ts = tstates.get(tid)
            td.gil = bool(holder) and ts == holder
            nat = names.stack(pcs) if pcs and names is not None else []
            td.waits_for_gil = not td.gil and any(f.name.startswith("take_gil") for f in nat)
            if pyf and target is not None and resolver is not None:
                runs = python_runs(pyf, target.version[:2], target.layout.owner_cstack)

                def name_of(f: RawPyFrame, r: CodeResolver = resolver) -> Frame:
                    hit = py_names.get((f.code, f.instr))
                    if hit is None:
                        info = r.resolve(f.code)
                        hit = (Frame("[unknown python]", FrameKind.PYTHON) if info is None else
                               Frame(info.qualname, FrameKind.PYTHON, os.path.basename(info.filename), info.filename,
                                     line_for(info, f.instr)))
                        py_names[(f.code, f.instr)] = hit
                    return hit

                stack = merge(nat, runs, name_of).stack
                if fold:
                    stack = fold_interpreter(stack, os.path.basename(target.binary))
                td.stack = stack
            else:
                td.stack = tuple(nat)
            td.python = sum(1 for f in td.stack if f.kind == FrameKind.PYTHON)
            if not pcs and pt is not None and state != "exited":
                td.notes.append("native stack not read (thread not stopped)")
            if state == "exited" or (not td.stack and not os.path.exists(f"/proc/{pid}/task/{tid}")):
                td.state = "exited"
            res.threads.append(td)
    finally:
        if resolver is not None:
            resolver.close()
        mem.close()
    return res


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
            except SymbolizeError:
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
