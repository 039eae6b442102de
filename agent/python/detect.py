"""Find CPython in a running process, pick its struct layout, and check that layout against live memory.

Detection reads `/proc/PID/maps` for the ELF holding `_PyRuntime` (a mapped `libpython3.X.so` for shared
builds and embedders, else the executable for static builds), reads the version from `Py_Version` (3.11+)
or the file name (3.10), prefers `_Py_DebugOffsets` on 3.13+, and then walks the live interpreter once:
runtime -> interpreter -> thread states, matching a thread state to a thread of the process, and the current
frame's code object to the `code` type. A layout that fails this check is never handed to the BPF walker.

Over 400 lines on purpose: detection, attach and the live check (and its reference walker) are one sequence.
"""

from __future__ import annotations

import os
import re
import struct
import time
from dataclasses import dataclass

import psutil

from aiflame.agent.procmaps import read_maps
from aiflame.agent.python.debug_offsets import (
    SIZE_313,
    compare_with_table,
    layout_from_debug_offsets,
    parse_debug_offsets,
)
from aiflame.core.errors import HostError, TargetGone, Unreadable
from aiflame.core.python_layouts import PyLayout, layout_for
from aiflame.core.raw import RawPyFrame
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.process_memory import ProcessMemory
from aiflame.symbolize.python.code import read_type_name

__all__ = [
    "PyTarget",
    "detect_python",
    "find_object_symbols",
    "python_threads",
    "read_python_stack",
]

_LIBPYTHON = re.compile(r"libpython3\.(\d+)(t?)(?:d)?\.so")
_EXE_NAME = re.compile(r"python3\.(\d+)(t?)$")
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_STT_OBJECT = 1
_SHN_UNDEF = 0
_MAX_THREADS = 256  # bound on the thread-state list walk
_MAX_FRAMES = 128
_PTHREAD_SCAN = 2048  # bytes of glibc's struct pthread searched for the kernel tid
_GLIBC_TID_OFFSET = 720  # glibc 2.36 x86-64; preferred when several offsets fit
_CHECK_TRIES = 3


class PythonNotLoaded(HostError):
    """The executable is named like CPython (pythonX.Y) but holds no runtime, and no libpython is mapped yet: the
    process was read between its exec and the dynamic loader mapping libpython. Not an answer: ask again (its own
    class because agent/python/runtime.py asks again on it and gives up on any other HostError)."""


@dataclass(frozen=True, slots=True)
class PyTarget:
    """A CPython interpreter found in a process, with the layout that passed the live check."""

    pid: int
    version: tuple[int, int, int]  # patch is 0 on 3.10 (no Py_Version; PY_VERSION is only an immediate)
    runtime_addr: int  # runtime address of _PyRuntime
    layout: PyLayout
    binary: str  # the ELF holding _PyRuntime, as named in /proc/PID/maps
    tid_offset: int  # 3.10: offset of the kernel tid in glibc's struct pthread; -1 otherwise
    warnings: tuple[str, ...]


# --- ELF ----------------------------------------------------------------------------------------------------


def find_object_symbols(elf: ElfFile, names: set[str]) -> dict[str, int]:
    """Link-time values of the defined symbols `names` (data objects or any type) from .symtab and .dynsym.

    Only 64-bit little-endian files are read; others give {}.
    """
    if not elf.is64 or not elf.little_endian:
        return {}
    want = {n.encode() for n in names}
    out: dict[str, int] = {}
    sym = struct.Struct("<IBBHQQ")
    # .dynsym first: it is small and, in CPython builds, exports both symbols we look for.
    tables = sorted((s for s in elf.sections if s.type in (_SHT_SYMTAB, _SHT_DYNSYM)), key=lambda s: s.type)
    for sec in reversed(tables):
        if not 0 < sec.link < len(elf.sections):
            continue
        entsize = sec.entsize or sym.size
        if entsize < sym.size:
            continue
        try:
            data = elf.read_section(sec)
            strtab = elf.read_section(elf.sections[sec.link])
        except Unreadable:
            continue
        for i in range(len(data) // entsize):
            name_off, info, _other, shndx, value, _size = sym.unpack_from(data, i * entsize)
            if shndx == _SHN_UNDEF or not value or name_off >= len(strtab):
                continue
            end = strtab.find(b"\0", name_off)
            name = strtab[name_off:end] if end >= 0 else b""
            if name in want and (info & 0xF) in (_STT_OBJECT, 0):
                out.setdefault(name.decode(), value)
        if len(out) == len(names):
            break
    return out


def _first_load(elf: ElfFile) -> tuple[int, int] | None:
    loads = [s for s in elf.segments if s.type == 1]
    if not loads:
        return None
    first = min(loads, key=lambda s: s.vaddr)
    return first.vaddr, first.offset


# --- process ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Candidate:
    path: str  # as in maps
    open_path: str  # what we can open (map_files, /proc/PID/root/..., path)
    offset0_start: int  # start of the file's offset-0 mapping
    name_minor: int | None
    name_free_threaded: bool


def _candidates(pid: int) -> list[_Candidate]:
    maps = read_maps(pid)
    if maps is None:
        return []
    try:
        exe = psutil.Process(pid).exe()
    except psutil.Error:
        exe = ""
    first_map: dict[str, tuple[int, int]] = {}
    for lo, hi, _perms, off, _dev, inode, path in maps:
        if not inode or not path.startswith("/") or off != 0 or path in first_map:
            continue
        first_map[path] = (lo, hi)
    libs: list[_Candidate] = []
    exes: list[_Candidate] = []
    for path, (lo, hi) in first_map.items():
        base_name = os.path.basename(path.removesuffix(" (deleted)"))
        m = _LIBPYTHON.search(base_name)
        is_exe = path == exe or path.removesuffix(" (deleted)") == exe.removesuffix(" (deleted)")
        if m is None and not is_exe:
            continue
        if m is None:
            m2 = _EXE_NAME.search(base_name)
            minor, ft = (int(m2.group(1)), bool(m2.group(2))) if m2 else (None, False)
        else:
            minor, ft = int(m.group(1)), bool(m.group(2))
        cand = _Candidate(path, f"/proc/{pid}/map_files/{lo:x}-{hi:x}", lo, minor, ft)
        (exes if m is None else libs).append(cand)
    return libs + exes


def _open_elf(pid: int, cand: _Candidate) -> ElfFile | None:
    for p in (cand.open_path, f"/proc/{pid}/root{cand.path}", cand.path):
        try:
            return ElfFile.open(p)
        except Unreadable:
            continue
    return None


def detect_python(pid: int, *, stopped: bool = False) -> PyTarget | None:
    """The CPython interpreter in `pid`, or None when the process holds none (or is gone). `stopped`: the process
    is being stopped (SIGSTOP from BPF): a failed live check is tried again after 1 ms and 2 ms instead of 10 and
    20 (its other threads stop within moments of the record; until then a read can tear).

    Raises HostError when CPython is there but cannot be walked safely (one line, meant to be shown once),
    PythonNotLoaded (a HostError) when its libpython is not mapped yet.
    """
    cands = _candidates(pid)
    launcher = False  # a pythonX.Y executable without a runtime: the runtime is in a libpython
    for cand in cands:
        elf = _open_elf(pid, cand)
        if elf is None:
            continue
        with elf:
            if cand.name_minor is None and elf.section(".PyRuntime") is None:
                continue  # an executable that is not CPython: don't read its (maybe huge) symbol table
            syms = find_object_symbols(elf, {"_PyRuntime", "Py_Version"})
            runtime = syms.get("_PyRuntime")
            if runtime is None:
                sec = elf.section(".PyRuntime")
                runtime = sec.addr if sec is not None and sec.addr else None
            if runtime is None:
                launcher = launcher or cand.name_minor is not None
                continue
            first = _first_load(elf)
            if first is None:
                continue
            vaddr, foff = first
            bias = cand.offset0_start - ((vaddr - foff) & ~0xFFF)
        version_sym = syms.get("Py_Version")
        version_addr = version_sym + bias if version_sym is not None else 0
        return _attach(pid, cand, runtime + bias, version_addr, 0.001 if stopped else 0.01)
    if launcher and not any(_LIBPYTHON.search(os.path.basename(c.path)) for c in cands):
        raise PythonNotLoaded(f"pid {pid}: libpython is not mapped yet")
    return None


def _attach(pid: int, cand: _Candidate, runtime_addr: int, version_addr: int, pause_s: float) -> PyTarget:
    try:
        mem = ProcessMemory(pid)
    except TargetGone as e:
        raise HostError(f"CPython in pid {pid}: {e}") from None
    with mem:
        version = _read_version(mem, cand, version_addr)
        label = f"CPython {version[0]}.{version[1]} in pid {pid} ({cand.path})"
        if cand.name_free_threaded:
            raise HostError(f"{label}: free-threaded builds are not supported")
        warnings: list[str] = []
        layout = layout_for(version[:2])
        if version[:2] >= (3, 13):
            try:
                dbg = parse_debug_offsets(mem.read(runtime_addr, SIZE_313))
                from_dbg = layout_from_debug_offsets(dbg) if dbg.version[:2] == version[:2] else None
            except HostError as e:  # well formed, but of a kind we have no verified reader for
                raise HostError(f"{label}: {e}") from None
            except (Unreadable, TargetGone) as e:  # malformed or unreadable: the built-in table may do
                if layout is None:
                    raise HostError(f"{label}: {e}") from None
                warnings.append(f"_Py_DebugOffsets unusable ({e}); using the built-in table")
            else:
                if from_dbg is None:
                    raise HostError(f"{label}: _Py_DebugOffsets says {dbg.version}, Py_Version {version}")
                warnings.extend(compare_with_table(from_dbg))
                layout = from_dbg
        if layout is None:
            raise HostError(f"{label}: no verified struct layout for this version")
        tid_offset = -1
        last_error = ""
        for attempt in range(_CHECK_TRIES):
            try:
                tid_offset, notes = _check_live(pid, mem, runtime_addr, layout)
                warnings.extend(notes)
                break
            except (TargetGone, Unreadable) as e:
                last_error = str(e)
                if not psutil.pid_exists(pid):
                    raise HostError(f"{label}: process exited during attach") from None
                if attempt + 1 < _CHECK_TRIES:
                    time.sleep(pause_s * (attempt + 1))  # the target runs while we read: retry a torn read
        else:
            raise HostError(f"{label}: layout check failed: {last_error}")
    return PyTarget(pid, version, runtime_addr, layout, cand.path, tid_offset, tuple(warnings))


def _read_version(mem: ProcessMemory, cand: _Candidate, version_addr: int) -> tuple[int, int, int]:
    if version_addr:
        try:
            hexv = int.from_bytes(mem.read(version_addr, 4), "little")
        except TargetGone as e:
            raise HostError(f"CPython in pid {mem.pid}: cannot read Py_Version: {e}") from None
        major, minor, micro = (hexv >> 24) & 0xFF, (hexv >> 16) & 0xFF, (hexv >> 8) & 0xFF
        if major != 3:
            raise HostError(f"CPython in pid {mem.pid}: implausible Py_Version {hexv:#x}")
        return major, minor, micro
    if cand.name_minor is None:
        raise HostError(f"CPython in pid {mem.pid} ({cand.path}): cannot tell its version")
    return 3, cand.name_minor, 0  # the patch level is not stored as data before 3.11


# --- live check and a reference walker ----------------------------------------------------------------------


def _tasks(pid: int) -> set[int]:
    try:
        return {t.id for t in psutil.Process(pid).threads()}
    except psutil.Error:
        return set()


def _thread_states(mem: ProcessMemory, runtime_addr: int, layout: PyLayout) -> list[int]:
    interp = mem.u64(runtime_addr + layout.runtime_interp_head)
    if not interp:
        raise Unreadable("no interpreter (starting up or finalizing)")
    out: list[int] = []
    ts = mem.u64(interp + layout.interp_tstate_head)
    while ts and len(out) < _MAX_THREADS:
        if ts in out:
            raise Unreadable("thread-state list loops")
        out.append(ts)
        ts = mem.u64(ts + layout.tstate_next)
    if not out:
        raise Unreadable("interpreter has no thread states")
    return out


def _find_tid_offset(mem: ProcessMemory, pthreads: list[int], pid: int, tasks: set[int]) -> int:
    """Offset of the kernel tid in glibc's struct pthread: a 4-byte slot holding the pid in the main thread's
    descriptor, and a tid of the process in as many other descriptors as possible (glibc 2.36: +720)."""
    main_hits: set[int] = set()
    counts: dict[int, int] = {}
    for pt in pthreads:
        if not pt:
            continue
        try:
            blob = mem.read(pt, _PTHREAD_SCAN)
        except TargetGone:
            continue
        for off in range(0, _PTHREAD_SCAN, 4):
            v = int.from_bytes(blob[off : off + 4], "little")
            if v in tasks:
                counts[off] = counts.get(off, 0) + 1
                if v == pid:
                    main_hits.add(off)
    if not main_hits:
        raise Unreadable("no thread descriptor holds the pid (main thread not in Python, or not glibc)")
    best = max(counts[o] for o in main_hits)
    fits = {o for o in main_hits if counts[o] == best}
    return _GLIBC_TID_OFFSET if _GLIBC_TID_OFFSET in fits else min(fits)


def current_frame(mem: ProcessMemory, tstate: int, layout: PyLayout) -> int:
    """The address of the thread state's newest interpreter frame (0: none)."""
    frame = mem.u64(tstate + layout.tstate_frame)
    if frame and layout.has_cframe:
        frame = mem.u64(frame + layout.cframe_current_frame)
    return frame


def read_frame(mem: ProcessMemory, frame: int, layout: PyLayout) -> RawPyFrame:
    """The interpreter frame at `frame` as the BPF walker ships it: code object (3.14's tagged reference bit
    cleared), instruction position (python_code.py's convention), owner and is-entry (0 where the version has
    none). The next older frame is at `frame + layout.frame_back`."""
    code = mem.u64(frame + layout.frame_code)
    if layout.version < (3, 11):
        instr = int.from_bytes(mem.read(frame + layout.frame_instr, 4), "little", signed=True)
    else:
        instr = mem.u64(frame + layout.frame_instr) - code
    owner = mem.read(frame + layout.frame_owner, 1)[0] if layout.frame_owner >= 0 else 0
    entry = mem.read(frame + layout.frame_is_entry, 1)[0] if layout.frame_is_entry >= 0 else 0
    if layout.version >= (3, 14):
        code &= ~1
    return RawPyFrame(code, instr, owner, entry)


def python_threads(target: PyTarget, mem: ProcessMemory) -> dict[int, int]:
    """Kernel tid -> thread-state address of every Python thread of the target, as the BPF walker matches them
    (native_thread_id on 3.11+, the tid inside glibc's struct pthread at `tid_offset` on 3.10)."""
    out: dict[int, int] = {}
    lay = target.layout
    try:
        states = _thread_states(mem, target.runtime_addr, lay)
    except Unreadable:
        return out
    for ts in states:
        tid = tstate_tid(mem, ts, lay, target.tid_offset)
        if tid:
            out[tid] = ts
    return out


def tstate_tid(mem: ProcessMemory, ts: int, lay: PyLayout, tid_offset: int) -> int:
    """The kernel thread id of thread state `ts` (0 when unknown): its native_thread_id where the version has one,
    else read from its pthread at `tid_offset`."""
    if lay.tstate_native_thread_id >= 0:
        return mem.u64(ts + lay.tstate_native_thread_id)
    pt = mem.u64(ts + lay.tstate_thread_id)
    return int.from_bytes(mem.read(pt + tid_offset, 4), "little") if pt else 0


def read_python_stack(mem: ProcessMemory, tstate: int, layout: PyLayout) -> list[tuple[int, int]]:
    """(code address, instr) of each Python frame of the thread state at `tstate`, leaf first, C-stack shim
    frames dropped: a user-space reference for what the BPF walker ships (instr convention: python_code.py)."""
    out: list[tuple[int, int]] = []
    frame = current_frame(mem, tstate, layout)
    for _ in range(_MAX_FRAMES):
        if not frame:
            break
        f = read_frame(mem, frame, layout)
        if layout.owner_cstack < 0 or f.owner != layout.owner_cstack:
            out.append((f.code, f.instr))
        frame = mem.u64(frame + layout.frame_back)
    return out


def _check_live(pid: int, mem: ProcessMemory, runtime_addr: int, layout: PyLayout) -> tuple[int, list[str]]:
    notes: list[str] = []
    tasks = _tasks(pid)
    states = _thread_states(mem, runtime_addr, layout)
    main_ts = 0
    tid_offset = -1
    if layout.tstate_native_thread_id >= 0:
        tids = [mem.u64(ts + layout.tstate_native_thread_id) for ts in states]
        if not any(t in tasks for t in tids):
            raise Unreadable(f"no thread state's native_thread_id is a thread of the process ({tids[:4]})")
        main_ts = next((ts for ts, t in zip(states, tids, strict=True) if t == pid), 0)
    else:
        pthreads = [mem.u64(ts + layout.tstate_thread_id) for ts in states]
        tid_offset = _find_tid_offset(mem, pthreads, pid, tasks)
        for ts, pt in zip(states, pthreads, strict=True):
            if pt and int.from_bytes(mem.read(pt + tid_offset, 4), "little") == pid:
                main_ts = ts
        if tid_offset != _GLIBC_TID_OFFSET:
            notes.append(f"struct pthread tid found at +{tid_offset}, not glibc 2.36's +{_GLIBC_TID_OFFSET}")
    ts = main_ts or states[0]
    frame = current_frame(mem, ts, layout)
    checked = False
    for _ in range(_MAX_FRAMES):
        if not frame:
            break
        owner = mem.read(frame + layout.frame_owner, 1)[0] if layout.frame_owner >= 0 else -1
        if layout.owner_cstack < 0 or owner != layout.owner_cstack:
            code = mem.u64(frame + layout.frame_code)
            name = read_type_name(mem.read, code, layout)
            if name != "code":
                raise Unreadable(f"current frame's code object has type {name!r}")
            checked = True
            break
        frame = mem.u64(frame + layout.frame_back)
    if not checked:
        notes.append("no Python frame running at attach: frame layout not checked")
    return tid_offset, notes
