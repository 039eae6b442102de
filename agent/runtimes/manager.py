"""Runs the runtime plug-ins in a capture: finds their libraries, attaches their probes before first use, pairs
call and return records, and hands finished calls to the plug-in that decodes them into events.

Over 400 lines on purpose: attaching probes and pairing their records share ProbeManager's state (the files
probed, the targets held stopped at a library open, the calls still open, each target's allowance)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from aiflame.agent.kernel.records import MAX_PROBES, PROBE_ARGS, PROBE_DEREFS, ProbeFlag, ProbeSpecRec
from aiflame.agent.kernel.sampler import CallRecord, OpenRecord, ProbeRecord, RetRecord
from aiflame.agent.kernel.uprobes import ENDBR64, ProbeSite, entry_offset
from aiflame.agent.runtimes.base import Call, Library, ProbeSpec, Runtime, TargetMemory
from aiflame.agent.runtimes.usdt import usdt_spec
from aiflame.core.errors import Unreadable
from aiflame.core.limits import Allowance, charged_to
from aiflame.core.raw import GpuCode, RawEvent
from aiflame.symbolize.objfmt.elf import EM_X86_64, ElfFile
from aiflame.symbolize.objfmt.usdt import read_notes

MAX_PENDING_PER_THREAD = 64  # open calls per thread kept for pairing (deeper nesting is a lost return)
# The longest we hold a target stopped: past it the target runs on while we finish (the stop watchdog,
# agent/kernel/stop_watchdog.py, resumes it at this deadline even if we hang or die).
STOP_DEADLINE_NS = 800_000_000

log = logging.getLogger(__name__)


def fnv1a(data: bytes) -> int:
    """The path hash bpf/runtime_probes.bpf.c computes for library opens."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def spec_rec(spec: ProbeSpec) -> ProbeSpecRec:
    rec = ProbeSpecRec()
    flags = ProbeFlag.STACK if spec.stack else ProbeFlag(0)
    for i in range(4):
        rec.src[i] = -1
    for i, d in enumerate(spec.derefs):
        rec.src[i] = d.src
        rec.off[i] = d.offset
    if spec.string >= 0:
        flags |= ProbeFlag.STR
        rec.str_src = spec.string
    if spec.out_arg >= 0:
        flags |= ProbeFlag.OUT
        rec.out_arg = spec.out_arg
    if spec.stop:
        flags |= ProbeFlag.STOP
    if spec.if_opened:
        flags |= ProbeFlag.IF_OPENED
    for i in range(len(rec.regs)):
        rec.regs[i] = spec.regs[i] if i < len(spec.regs) else -1
    if spec.regs:
        flags |= ProbeFlag.REGS
    if spec.ret:
        flags |= ProbeFlag.RET
    rec.sample_arg = spec.sample_arg
    if spec.sample_arg >= 0:
        flags |= ProbeFlag.SAMPLE
    rec.flags = int(flags)
    return rec


class ProbeTarget(Protocol):
    """What the manager needs from the sampler (tests stand in for BPF)."""

    def set_probe_spec(self, probe: int, spec: ProbeSpecRec) -> None: ...
    def attach_probes(self, path: str, sites: Sequence[ProbeSite], *, ret: bool = False) -> dict[int, str]: ...
    def mark_library_seen(self, path_hash: int) -> None: ...
    def resumed(self, pid: int, stopped_ns: int) -> None: ...
    def take_unsent_calls(self) -> list[tuple[int, int, int, int]]: ...


@dataclass
class Attached:
    """The probes placed in one library file."""

    path: str
    runtime: str
    calls: list[str] = field(default_factory=list)


class ProcessExit(Runtime):
    """Stops a target in libc's exit() so the agent reads its mappings before they vanish: a short-lived
    program's libraries may have been mapped after its last snapshot."""

    name: ClassVar[str] = "process"

    def specs(self) -> list[ProbeSpec]:
        return [ProbeSpec(("exit",), "exit", stack=False, stop=True)]

    def wants(self, lib: Library) -> bool:
        return lib.basename.startswith("libc.so")

    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        return []


class Loader(Runtime):
    """Stops a target in the dynamic loader once it has mapped the libraries it just opened, before their
    relocation and constructors (glibc calls _dl_debug_state with RT_CONSISTENT there, for debuggers): the agent
    reads the new mappings, so walks through those libraries have their tables from their first instruction.
    BPF makes the stop only when the process opened a shared object since its last one (PROBE_IF_OPENED)."""

    name: ClassVar[str] = "loader"

    def specs(self) -> list[ProbeSpec]:
        return [ProbeSpec(("_dl_debug_state",), "_dl_debug_state", stack=False, stop=True, if_opened=True)]

    def wants(self, lib: Library) -> bool:
        return lib.basename.startswith("ld-linux")

    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        return []


class ProbeManager:
    """Owns the plug-ins of one capture. Feed it every probe record (`on_record`) and every new mapping
    (`consider_process`); take its output with `take()`. `on_stop(pid, why)` runs while a target is stopped,
    before it continues: at a library open ("open"), in the loader once it has mapped what it opened ("loader"),
    or in exit() ("process"); the session re-reads its mappings there. A target is held at most
    `stop_deadline_ns` from its stop: a record read later than that continues it first.

    Work done for one target (libraries it maps, code objects its calls name) is charged to that target's
    core/limits.py Allowance, so one process cannot make us inflate or copy more than its share."""

    def __init__(self, runtimes: list[Runtime], bpf: ProbeTarget, mem: TargetMemory | None = None,
                 on_stop: Callable[[int, str], None] | None = None, stop_deadline_ns: int = STOP_DEADLINE_NS) -> None:
        runtimes = [*runtimes, ProcessExit(), Loader()]
        self.runtimes = runtimes
        self._on_stop = on_stop
        self._bpf = bpf
        self.mem = mem or TargetMemory()
        self._specs: list[tuple[Runtime, ProbeSpec]] = []
        for rt in runtimes:
            for spec in rt.specs():
                self._specs.append((rt, spec))
        self._owner = {id(spec): rt for rt, spec in self._specs}
        for probe, (_, spec) in enumerate(self._specs):
            bpf.set_probe_spec(probe, spec_rec(spec))
        self._files: dict[tuple[int, int], Attached | None] = {}  # (dev, inode) -> probes placed
        self._open: dict[int, list[Call]] = {}  # tid -> calls entered with a return probe, not yet returned
        self._events: list[RawEvent] = []
        self._code: list[GpuCode] = []
        self._stopped: dict[int, int] = {}  # pid -> when BPF stopped it (CLOCK_MONOTONIC ns)
        self._allowances: dict[int, Allowance] = {}
        self.stop_deadline_ns = stop_deadline_ns
        self.attached: list[Attached] = []
        self.warnings: list[str] = []
        self.calls_seen = 0  # records of calls
        self.calls_counted = 0  # calls they stand for, and those counted without a record (take_unsent)
        self.calls_unsent = 0  # of those, counted in BPF and left when the capture ended (events without a stack)
        self.returns_lost = 0
        self.stops_late = 0  # stop records read after the deadline (the target was continued first)
        self.stops = 0  # targets stopped (a library open, the loader, exit) and continued by us
        self.stopped_ns = 0  # how long they were held, all together (from BPF's stop to our SIGCONT)
        self.libs_seen_full = 0  # library paths BPF could not remember (their next open stops the target again)

    # --- libraries --------------------------------------------------------------------------------------------

    def consider(self, path: str, pid: int | None = None) -> Attached | None:
        """Probe `path` for every plug-in that wants it (once per file). `pid` resolves relative paths."""
        real = path
        if pid is not None and not path.startswith("/"):
            real = os.path.join(f"/proc/{pid}/cwd", path)
        try:
            st = os.stat(real)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        if key in self._files:
            return self._files[key]
        try:
            elf = ElfFile.open(real)
        except (OSError, Unreadable):
            # Not remembered: a /proc/PID/root path fails once its process exits, and a short-lived first user
            # of a library must not leave that library unprobed for every later process.
            return None
        self._files[key] = None
        try:
            return self._attach_file(elf, path, key)
        finally:
            elf.close()

    def _attach_file(self, elf: ElfFile, path: str, key: tuple[int, int]) -> Attached | None:
        lib = Library(path, frozenset(s.name for s in elf.sections))
        wanted = [(probe, rt, spec) for probe, (rt, spec) in enumerate(self._specs)
                  if rt.wants(lib) and (not spec.libs or lib.basename.startswith(spec.libs))]
        done = self._attach_symbols(elf, path, wanted) if wanted else None
        if ".note.stapsdt" in lib.sections:
            done = self._attach_usdt(elf, path, done)
        self._files[key] = done
        return done

    def _attach_usdt(self, elf: ElfFile, path: str, done: Attached | None) -> Attached | None:
        """A probe per USDT site some runtime asks for; each site gets its own spec (its own locations)."""
        sites = {k: (rt, v) for rt in self.runtimes for k, v in rt.usdt().items()}
        if not sites:
            return done
        try:
            notes = read_notes(elf)
        except Unreadable as e:
            self.warnings.append(f"{path}: {e}")
            return done
        placing: list[tuple[ProbeSite, Runtime, str]] = []  # (site, runtime, call)
        for note in notes:
            site = sites.get((note.provider, note.name))
            if site is None or note.offset < 0:
                continue
            rt, (call, string_arg) = site
            if len(self._specs) >= MAX_PROBES:
                self.warnings.append(f"{path}: {call}: more than {MAX_PROBES} probes, site {note.pc:#x} skipped")
                continue
            try:
                spec = usdt_spec(note, call, string_arg)
            except Unreadable as e:
                self.warnings.append(f"{path}: site {note.pc:#x}: {e}")
                continue
            probe = len(self._specs)
            self._specs.append((rt, spec))
            self._owner[id(spec)] = rt
            self._bpf.set_probe_spec(probe, spec_rec(spec))
            placing.append((ProbeSite(note.offset, probe, spec.semaphore), rt, call))  # semaphore 0: none
        failed = self._attach(elf, path, [at for at, _, _ in placing])
        for at, rt, call in placing:
            if at.cookie not in failed:
                done = self._placed(done, path, rt, call)
        return done

    def _attach_symbols(self, elf: ElfFile, path: str,
                        wanted: list[tuple[int, Runtime, ProbeSpec]]) -> Attached | None:
        addrs: dict[str, int] = {}
        for rt in {id(rt): rt for _, rt, _ in wanted}.values():  # each runtime's calls are one library's API
            addrs |= elf.function_addresses({s for _, r, spec in wanted if r is rt for s in spec.symbols}, True)
        placing: list[tuple[ProbeSite, Runtime, ProbeSpec]] = []
        for probe, rt, spec in wanted:
            sym = next((s for s in spec.symbols if s in addrs), None)
            if sym is None:
                continue
            offset = elf.vaddr_to_file_offset(addrs[sym])
            if offset is not None:
                placing.append((ProbeSite(offset + self._entry_offset(elf, offset), probe), rt, spec))
        failed = self._attach(elf, path, [site for site, _, _ in placing])
        failed |= self._attach(elf, path, [site for site, _, spec in placing if spec.ret and site.cookie not in failed],
                               ret=True)
        done: Attached | None = None
        for site, rt, spec in placing:
            if site.cookie not in failed:
                done = self._placed(done, path, rt, spec.call)
        return done

    @staticmethod
    def _entry_offset(elf: ElfFile, offset: int) -> int:
        """How far past a function's first byte its probe goes (uprobes.entry_offset; x86-64 only)."""
        if elf.machine != EM_X86_64:
            return 0
        try:
            return entry_offset(elf.pread(offset, len(ENDBR64)))
        except Unreadable:
            return 0

    def _attach(self, elf: ElfFile, path: str, sites: list[ProbeSite], *, ret: bool = False) -> dict[int, str]:
        """Attach `sites` in one go; returns (and warns about) the probes that did not go in, by probe id.
        Through the open file, not its path: a /proc/PID/root path fails once that process exits, and the file
        would then stay unprobed for every later process (the soak's first target often exits here)."""
        if not sites:
            return {}
        failed = self._bpf.attach_probes(elf.fd_path, sites, ret=ret)
        self.warnings += [why.replace(elf.fd_path, path) for why in failed.values()]
        return failed

    def _placed(self, done: Attached | None, path: str, rt: Runtime, call: str) -> Attached:
        """Record a probe placed in `path` for `call`; the file's Attached entry is made at its first probe."""
        if done is None:
            done = Attached(path, rt.name)
            self.attached.append(done)
        done.calls.append(call)
        return done

    def consider_process(self, pid: int, paths: list[str]) -> None:
        """A process's mapped files (at attach, fork, exec, or a new snapshot). A file deleted since it was mapped
        is skipped: its path names another file now, or none."""
        with charged_to(self.allowance(pid)):
            for p in paths:
                if p.startswith("/") and not p.endswith(" (deleted)"):
                    root = f"/proc/{pid}/root{p}"
                    self.consider(root if os.path.exists(root) else p)

    def allowance(self, pid: int) -> Allowance:
        """What target `pid` may still make us inflate or copy (core/limits.py)."""
        a = self._allowances.get(pid)
        if a is None:
            a = self._allowances[pid] = Allowance(f"pid {pid}")
        return a

    def _on_open(self, rec: OpenRecord) -> None:
        try:
            with charged_to(self.allowance(rec.pid)):
                self._hold_no_longer(rec.pid)
                self.consider(os.fsdecode(rec.path), rec.pid)
                self._remember_library(rec.path)
                if self._on_stop:
                    self._hold_no_longer(rec.pid)
                    self._on_stop(rec.pid, "open")  # the libraries opened before this one are mapped by now
        finally:
            self._continue(rec.pid)

    def _remember_library(self, path: bytes) -> None:
        """Opens of `path` stop targets no more; a full BPF set only means its next open stops again."""
        try:
            self._bpf.mark_library_seen(fnv1a(path))
        except OSError as e:
            self.libs_seen_full += 1
            if self.libs_seen_full == 1:
                log.warning("libraries seen: %s (later opens of such paths stop their target again)", e)

    def _hold_no_longer(self, pid: int) -> None:
        """Continue `pid` now if it has been stopped for the deadline already (its record was read late, or our
        work took long): what remains is done with the target running."""
        since = self._stopped.get(pid)
        if since is not None and time.monotonic_ns() - since >= self.stop_deadline_ns:
            self.stops_late += 1
            self._continue(pid)

    def _continue(self, pid: int) -> None:
        since = self._stopped.pop(pid, None)
        if since is None:
            return
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.stops += 1
        self.stopped_ns += max(0, time.monotonic_ns() - since)
        try:
            self._bpf.resumed(pid, since)
        except OSError:
            pass  # the watchdog's record of the stop outlives it by its deadline at most

    # --- calls ------------------------------------------------------------------------------------------------

    def on_record(self, rec: ProbeRecord) -> None:
        if isinstance(rec, OpenRecord):
            self._stopped[rec.pid] = rec.time_ns
            self.mem.forget_maps(rec.pid)
            self._on_open(rec)
        elif isinstance(rec, CallRecord):
            if rec.probe < len(self._specs) and self._specs[rec.probe][1].stop:
                self._stopped[rec.pid] = rec.time_ns
                self.mem.forget_maps(rec.pid)
                try:
                    with charged_to(self.allowance(rec.pid)):
                        self._hold_no_longer(rec.pid)
                        self._on_call(rec)
                        if self._on_stop:
                            self._hold_no_longer(rec.pid)
                            self._on_stop(rec.pid, self._specs[rec.probe][0].name)  # "process" (exit), "loader"
                finally:
                    self._continue(rec.pid)
                return
            with charged_to(self.allowance(rec.pid)):
                self._on_call(rec)
        else:
            self._on_ret(rec)

    def _on_call(self, rec: CallRecord) -> None:
        if rec.probe >= len(self._specs):
            return
        rt, spec = self._specs[rec.probe]
        self.calls_seen += 1
        user = rec.user
        # At entry the caller has not pushed a frame yet: its return address is at sp, not on the frame chain.
        ret_addr = rec.args[7]
        if spec.stack and user and ret_addr and (len(user) < 2 or user[1] != ret_addr):
            user = (user[0], ret_addr, *user[1:])
        stack = self._open.setdefault(rec.tid, [])
        call = Call(spec, rec.pid, rec.tid, rec.time_ns, rec.args, rec.derefs, rec.string, user, rec.user_err,
                    rec.py, rec.py_flags, parent=stack[-1].spec.call if stack else "", calls=rec.calls)
        self.calls_counted += rec.calls
        if spec.ret:
            if len(stack) >= MAX_PENDING_PER_THREAD:
                self.returns_lost += 1
                self._finish(stack.pop(0))
            stack.append(call)
        else:
            self._finish(call)

    def _on_ret(self, rec: RetRecord) -> None:
        stack = self._open.get(rec.tid)
        if not stack or rec.probe >= len(self._specs):
            return
        with charged_to(self.allowance(rec.pid)):
            self._pair(rec, stack)

    def _pair(self, rec: RetRecord, stack: list[Call]) -> None:
        spec = self._specs[rec.probe][1]
        # The innermost open call of this probe returned (calls deeper than it lost their returns).
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].spec is spec:
                call = stack.pop(i)
                for orphan in stack[i:]:
                    self.returns_lost += 1
                    self._finish(orphan)
                del stack[i:]
                if not stack:
                    del self._open[rec.tid]  # thread ids come and go: no entry per thread that ever called
                call.end_ns, call.ret, call.out = rec.time_ns, rec.ret, rec.out
                self._finish(call)
                return

    def _finish(self, call: Call) -> None:
        rt = self._owner[id(call.spec)]
        try:
            out = rt.decode(call, self.mem)
        except Exception as e:  # a plug-in bug must not stop the capture
            self.warnings.append(f"{rt.name}: cannot decode {call.spec.call}: {e}")
            return
        for item in out:
            if isinstance(item, GpuCode):
                self._code.append(item)
            else:
                self._events.append(item)

    def forget(self, pid: int) -> None:
        for rt in self.runtimes:
            rt.forget(pid)
        self._allowances.pop(pid, None)
        self.mem.forget(pid)

    def drop_open_calls(self, pid: int) -> None:
        """The process exited: its calls that never returned are dropped (they are kept by thread id)."""
        for tid in [t for t, stack in self._open.items() if stack and stack[0].pid == pid]:
            del self._open[tid]

    def take(self) -> tuple[list[RawEvent], list[GpuCode]]:
        """Events and code objects decoded since the last call."""
        ev, code = self._events, self._code
        self._events, self._code = [], []
        return ev, code

    def finish(self, end_ns: int = 0, *, unsent: bool = True) -> None:
        """The capture ends: calls still open are decoded without an end, launches counted without a record since
        their key's last record become events of their own (no stack; `unsent=False` leaves them in BPF for a
        later record), stopped targets continue."""
        for stack in self._open.values():
            for call in stack:
                self._finish(call)
        self._open.clear()
        if unsent:
            self.take_unsent(end_ns)
        for pid in list(self._stopped):
            self._continue(pid)
        self.mem.close()

    def take_unsent(self, end_ns: int) -> None:
        """Launches BPF counted without a record (over the record budget) and no later record carried: one event
        per (process, probe, kernel) with their count in "calls" and no stack."""
        try:
            unsent = self._bpf.take_unsent_calls()
        except OSError as e:
            self.warnings.append(f"cannot read the launches counted in BPF: {e.strerror}")
            return
        for pid, probe, arg, n in unsent:
            if probe >= len(self._specs) or n <= 0:
                continue
            spec = self._specs[probe][1]
            args = [0] * PROBE_ARGS
            args[spec.sample_arg % PROBE_ARGS] = arg
            self.calls_counted += n
            self.calls_unsent += n
            first = len(self._events)
            self._finish(Call(spec, pid, 0, end_ns, tuple(args), (None,) * PROBE_DEREFS, None, calls=n))
            for ev in self._events[first:]:
                ev.args["stackless"] = 1

    def probed_files(self) -> list[Attached]:
        return list(self.attached)

