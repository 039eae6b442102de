"""`aiflame dump`: every thread's stack of a live process, now, with its state.

A one-shot dump reads the target from user space rather than through BPF (a BPF pass would only see the threads
that run during it; a dump wants the sleeping ones most). The steps:
- each thread's state (R, S, D, ...) from /proc/PID/task/TID/stat, read before anything stops it;
- the threads stopped with PTRACE_SEIZE + PTRACE_INTERRUPT (as py-spy pauses its target), their registers read
  (PTRACE_GETREGS), and detached as soon as the stacks are read; `--nonblocking` skips this (no native frames);
- native stacks unwound here in user space with the same DWARF CFI tables the BPF unwinder uses
  (symbolize/objfmt/cfi, built once per binary and cached), falling back to frame pointers where a file has none;
  these two steps, and naming the native frames, are agent/dump_native.py;
- Python frames read from the interpreter's thread states (agent/python/detect.py finds the runtime and checks
  its layout), named by CodeResolver and merged into the native stack as profiles merge them
  (symbolize/python/merge.py);
- the GIL holder: the interpreter's GIL state (`locked`, `last_holder`), at offsets taken from the pyenv
  builds' DWARF (3.10–3.13; 3.13 reads them from `_Py_DebugOffsets` when it can).
Everything a hostile target controls (thread counts, memory, names) is bounded; a read that fails ends that
thread's walk with a note, never the dump.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from aiflame.agent.dump_native import _Names, _Ptrace, _read, _Unwinder
from aiflame.agent.python.detect import (
    PyTarget,
    current_frame,
    detect_python,
    read_frame,
    tstate_tid,
)
from aiflame.core.errors import BadInput, HostError, TargetGone
from aiflame.core.model import Frame, FrameKind
from aiflame.core.python_layouts import PyLayout
from aiflame.core.raw import RawPyFrame
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.process_memory import ProcessMemory
from aiflame.symbolize.python.code import CodeResolver, line_for
from aiflame.symbolize.python.merge import fold_interpreter, merge, python_runs

__all__ = ["DumpResult", "ThreadDump", "dump_process"]

MAX_THREADS = 4096  # threads dumped; the rest are counted
MAX_PY = 256

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


def _thread_state(pid: int, tid: int) -> tuple[str, str]:
    """(name, state) of a thread; state "exited" when it is gone."""
    stat = _read(f"/proc/{pid}/task/{tid}/stat")
    end = stat.rfind(")")
    if end < 0 or len(stat) < end + 3:
        return "", "exited"
    name = stat[stat.find("(") + 1:end]
    code = stat[end + 2]
    return name, STATES.get(code, code)


def _tids(pid: int) -> list[int]:
    try:
        names = os.listdir(f"/proc/{pid}/task")
    except OSError:
        raise TargetGone(f"process {pid} does not exist (or is gone)") from None
    return sorted(int(n) for n in names if n.isdigit())


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
    except TargetGone:
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
    mem = ProcessMemory(pid)
    resolver = None
    try:  # the process's memory (and the code resolver's) closed whatever happens from here
        target = _detect(pid, res)
        pt = _Ptrace() if stop and native_stacks else None
        raw = _read_threads(pid, tids, mem, target, pt, res)
        resolver = CodeResolver(pid, target.layout) if target is not None else None
        names = (_Names(raw.unwinder, native, [pcs for pcs, _ in raw.stacks.values()]) if raw.unwinder is not None
                 else None)
        py = _PyNames(target, resolver, fold) if target is not None and resolver is not None else None
        for tid in tids:
            res.threads.append(_thread_dump(pid, tid, states[tid], raw, names, py, pt is not None))
    finally:
        if resolver is not None:
            resolver.close()
        mem.close()
    return res


def _detect(pid: int, res: DumpResult) -> PyTarget | None:
    """The target's Python runtime, noted in `res`; None (and why, in its notes) when there is none to read."""
    try:
        target = detect_python(pid)
    except HostError as e:  # PythonNotLoaded among them
        res.notes.append(str(e))
        return None
    except OSError as e:
        res.notes.append(f"Python detection failed: {e}")
        return None
    if target is not None:
        res.python = f"CPython {'.'.join(map(str, target.version))} ({target.binary})"
        res.notes.extend(target.warnings)
    return target


@dataclass
class _Raw:
    """What the dump read of the threads while they were stopped: nothing here is named yet."""

    stacks: dict[int, tuple[list[int], list[RawPyFrame]]]  # tid -> (return addresses leaf first, Python frames)
    tstates: dict[int, int]  # tid -> its Python thread state
    holder: int | None  # the thread state holding the GIL (0: free, None: unknown)
    unwinder: _Unwinder | None  # None: the threads were not stopped


def _read_threads(pid: int, tids: list[int], mem: ProcessMemory, target: PyTarget | None, pt: _Ptrace | None,
                  res: DumpResult) -> _Raw:
    """Stop the threads (when `pt`), read their native and Python stacks and the GIL holder, and let them run
    again; what went wrong goes to `res.notes`, how long they were stopped to `res.stopped_s`."""
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
            except TargetGone as e:
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
                except TargetGone:
                    pyf = []
            raw[tid] = (pcs, pyf)
    finally:
        if pt is not None:
            if pt.seized:
                res.stopped_s = time.monotonic() - t_stop
            pt.release()  # the target runs again before any symbolizing
    if unwinder is not None and unwinder.errors:
        res.notes.extend(f"no CFI table, frame pointers only: {e}" for e in list(unwinder.errors.values())[:3])
    return _Raw(raw, tstates, holder, unwinder)


def _thread_dump(pid: int, tid: int, name_state: tuple[str, str], raw: _Raw, names: _Names | None,
                 py: _PyNames | None, stopped: bool) -> ThreadDump:
    """One thread's dump from what was read: its stack named and merged, its GIL role, its notes. `stopped`: the
    dump tried to stop the threads (so a thread without native frames is worth a note)."""
    name, state = name_state
    pcs, pyf = raw.stacks[tid]
    td = ThreadDump(tid, name, state)
    td.gil = bool(raw.holder) and raw.tstates.get(tid) == raw.holder
    nat = names.stack(pcs) if pcs and names is not None else []
    td.waits_for_gil = not td.gil and any(f.name.startswith("take_gil") for f in nat)
    td.stack = py.merged(nat, pyf) if pyf and py is not None else tuple(nat)
    td.python = sum(1 for f in td.stack if f.kind == FrameKind.PYTHON)
    if not pcs and stopped and state != "exited":
        td.notes.append("native stack not read (thread not stopped)")
    if state == "exited" or (not td.stack and not os.path.exists(f"/proc/{pid}/task/{tid}")):
        td.state = "exited"
    return td


class _PyNames:
    """Python frames named through the target's code objects (each code object and instruction once, for all
    threads) and merged into the native frames as profiles merge them."""

    def __init__(self, target: PyTarget, resolver: CodeResolver, fold: bool) -> None:
        self.target, self.resolver, self.fold = target, resolver, fold
        self.frames: dict[tuple[int, int], Frame] = {}

    def name(self, f: RawPyFrame) -> Frame:
        hit = self.frames.get((f.code, f.instr))
        if hit is None:
            info = self.resolver.resolve(f.code)
            hit = (Frame("[unknown python]", FrameKind.PYTHON) if info is None else
                   Frame(info.qualname, FrameKind.PYTHON, os.path.basename(info.filename), info.filename,
                         line_for(info, f.instr)))
            self.frames[(f.code, f.instr)] = hit
        return hit

    def merged(self, nat: list[Frame], pyf: list[RawPyFrame]) -> tuple[Frame, ...]:
        """The thread's stack, root -> leaf: native frames `nat` with the Python frames `pyf` (newest first)."""
        t = self.target
        runs = python_runs(pyf, t.version[:2], t.layout.owner_cstack)
        stack = merge(nat, runs, self.name).stack
        if self.fold:
            stack = fold_interpreter(stack, os.path.basename(t.binary))
        return stack
