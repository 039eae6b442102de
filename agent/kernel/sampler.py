"""The CPU sampler: compiles bpf/cpu_sampler.bpf.c, with bpf/runtime_probes.bpf.c and bpf/offcpu.bpf.c when
asked (in the compiler process, once per host and options: later starts load it from agent/kernel/bpf_cache.py's
compile cache), attaches it to perf events on every CPU, and drains its ring buffer on the caller's timer (records
are submitted without wakeups). The records are decoded by agent/kernel/decode.py, whose types are re-exported here.
Over 400 lines on purpose: CpuSampler owns the one BPF object; most of its methods are thin doors to its maps."""

from __future__ import annotations

import errno
import logging
import re
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiflame.agent.kernel import bpf_object
from aiflame.agent.kernel.bpf_object import BpfObject
from aiflame.agent.kernel.bpf_sys import (
    PERF_COUNT_HW_CPU_CYCLES,
    PERF_COUNT_SW_CPU_CLOCK,
    PERF_TYPE_HARDWARE,
    PERF_TYPE_SOFTWARE,
    uprobe_session_supported,
)
from aiflame.agent.kernel.decode import CallRecord as CallRecord
from aiflame.agent.kernel.decode import OffCpuEnd, OffCpuStack
from aiflame.agent.kernel.decode import OpenRecord as OpenRecord
from aiflame.agent.kernel.decode import ProbeRecord as ProbeRecord
from aiflame.agent.kernel.decode import ProcEvent as ProcEvent
from aiflame.agent.kernel.decode import RetRecord as RetRecord
from aiflame.agent.kernel.decode import decode_record as decode_record
from aiflame.agent.kernel.offcpu import OffCpuPairs
from aiflame.agent.kernel.records import Counter, ProbeSpecRec, PyProcRec, TargetFlag
from aiflame.agent.kernel.ringbuf import RingBuffer
from aiflame.agent.kernel.stop_watchdog import StopWatchdog
from aiflame.agent.kernel.unwind import UnwindStats, UnwindTables
from aiflame.agent.kernel.uprobes import ProbeSite, Uprobe, attach_sites
from aiflame.core.errors import HostError
from aiflame.core.limits import LAUNCH_STACKS
from aiflame.core.raw import Mapping, RawSample
from aiflame.core.unwind import STOP_MASK

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"
SOURCE = BPF_DIR / "cpu_sampler.bpf.c"
PROBES_SOURCE = BPF_DIR / "runtime_probes.bpf.c"
OFFCPU_SOURCE = BPF_DIR / "offcpu.bpf.c"


log = logging.getLogger(__name__)


MAX_EVENT_HZ = 2000  # per CPU: above this the early exits alone cost more than they are worth
MAX_THINNING = 8


def oversample_for(frequency: int) -> int:
    """How many perf firings per kept sample at `frequency` Hz: as many as fit under MAX_EVENT_HZ, at most 8."""
    return max(1, min(MAX_THINNING, MAX_EVENT_HZ // max(frequency, 1)))


@dataclass(frozen=True)
class SamplerConfig:
    frequency: int = 99
    event: str = "auto"  # auto (cycles where the PMU allows, else cpu-clock), cpu-clock, cycles
    follow_children: bool = False
    all_processes: bool = False
    ringbuf_pages: int = 2048  # 8 MiB: ~4000 samples of slack between drains
    max_targets: int = 16384
    probes: bool = False  # build the runtime probes (uprobes on CUDA, NCCL, gloo, Level Zero calls)
    # The perf event fires `keep_one_in` times as often as asked and BPF keeps one firing of each block of
    # keep_one_in, at a random position: one sample per period as asked, jittered on a fine grid so it cannot
    # run in lockstep with a periodic workload; 0 chooses (oversample_for). bench/split_bias.py measures it.
    keep_one_in: int = 0
    # Walk user stacks with .eh_frame tables (bpf/unwind.h) in processes whose mappings the agent described;
    # False: frame pointers only (the kernel's walk), as before CFI unwinding.
    cfi: bool = True
    max_depth: int = 127  # user frames a CFI walk records at most (the record holds 127)
    # With probes: the longest a target stays stopped by them. The stop watchdog (stop_watchdog.py) continues it
    # then, whatever the agent is doing, and at once when the agent dies.
    stop_deadline_ms: int = 800
    # With probes: launch records a second per CPU (a token bucket of 64); launches beyond are counted per kernel
    # in BPF and carried by the next record of the same kernel (bpf/runtime_probes.bpf.c, PROBE_SAMPLE). 0: all.
    call_rate: int = LAUNCH_STACKS
    # Where target threads block and for how long (bpf/offcpu.bpf.c at sched_switch): built only when asked.
    off_cpu: bool = False
    # With probes: one uprobe session link per file for both directions, so that a call whose return is not
    # wanted (a launch counted without a record) costs one trap, not two. None: where the kernel has them (6.13+).
    # What is asked; what is in effect is CpuSampler.uprobe_session.
    session_links: bool | None = None

    @property
    def session(self) -> bool:
        """Whether runtime probes go in through uprobe session links (asking the kernel when not told)."""
        if not self.probes:
            return False
        return uprobe_session_supported() if self.session_links is None else self.session_links

    @property
    def thinning(self) -> int:
        return self.keep_one_in or oversample_for(self.frequency)

    @property
    def event_frequency(self) -> int:
        """The rate the perf event fires at; the mean rate of kept samples is `frequency`."""
        return self.frequency * self.thinning

    def describe(self, event: str) -> str:
        """How samples were taken, for the capture header (meta "sampling")."""
        if self.thinning == 1:
            return f"{event} at {self.frequency} Hz per CPU"
        return (f"{event} at {self.event_frequency} Hz per CPU, one firing in each {self.thinning} kept at a random "
                f"position ({self.frequency} Hz, jittered)")

    def cflags(self) -> list[str]:
        flags = [
            f"-I{BPF_DIR}",
            f"-DAIFLAME_RINGBUF_PAGES={self.ringbuf_pages}",
            f"-DAIFLAME_MAX_TARGETS={self.max_targets}",
            f"-DAIFLAME_KEEP_ONE_IN={self.thinning}",
            f"-DAIFLAME_UW_MAX_DEPTH={max(1, min(self.max_depth, 127))}",
            f"-DAIFLAME_CALL_INTERVAL_NS={1_000_000_000 // self.call_rate if self.call_rate > 0 else 0}",
        ]
        if self.follow_children:
            flags.append("-DAIFLAME_FOLLOW")
        if self.all_processes:
            flags.append("-DAIFLAME_ALL")
        if self.session:
            flags.append("-DAIFLAME_UPROBE_SESSION")
        return flags


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


def program_file(path: Path, seen: set[str] | None = None) -> str:
    """One .bpf.c file (each stands alone, including the headers it uses) with its bpf/ headers inlined, each once
    in a program text: BCC rewrites map calls and tracepoint arguments only in its main source, so what the
    headers declare must be in it, and the programs put together share the maps they declare."""
    seen = set() if seen is None else seen

    def inline(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return program_file(BPF_DIR / name, seen)

    return _LOCAL_INCLUDE.sub(inline, path.read_text())


def program_text(config: SamplerConfig) -> str:
    """The source handed to BCC: the sampler, plus the runtime probes and the off-CPU recorder when asked for."""
    seen: set[str] = set()
    sources = [SOURCE, *([PROBES_SOURCE] if config.probes else []), *([OFFCPU_SOURCE] if config.off_cpu else [])]
    return "\n".join(program_file(path, seen) for path in sources)


def bpf_source(config: SamplerConfig) -> str:
    """The program text as BCC compiles it, with the defines spelled out (for --print-bpf)."""
    defines = "".join(
        "#define " + f[2:].replace("=", " ", 1) + "\n" for f in config.cflags() if f.startswith("-D")
    )
    return defines + program_text(config)


DETACH_THREADS = 32


def _close_all(probes: list[Uprobe]) -> None:
    for u in probes:
        u.close()


LAYOUT_MAPS = {"sample_rec": "layout_sample", "proc_rec": "layout_proc", "py_proc": "layout_py_proc",
               "unwind_proc": "layout_unwind_proc", "unwind_rule": "layout_unwind_rule"}
PROBE_LAYOUT_MAPS = {"call_rec": "layout_call", "ret_rec": "layout_ret", "open_rec": "layout_open",
                     "probe_spec": "layout_spec"}
OFFCPU_LAYOUT_MAPS = {"offcpu_end_rec": "layout_offcpu_end"}
UNWIND_MAPS = ["unwind_rows", "unwind_index", "unwind_rules", "unwind_procs", "uw_progs", "uw_call_progs",
               "uw_off_progs"]
# The tail-call programs of the CFI walk, by prog array (one per program type: samples, probed calls, off-CPU
# stacks): index 0 steps (UW_PROG_STEP), 1 finishes the record, 2 scans the stack past code without CFI (not for
# launch stacks: UW_PROG_SCAN).
UW_PROGS = {"uw_progs": ("uw_sample_step", "sample_finish", "uw_sample_scan"),
            "uw_call_progs": ("uw_call_step", "call_finish"),
            "uw_off_progs": ("uw_offcpu_step", "offcpu_finish", "uw_offcpu_scan")}
MAPS = ["events", "stop_events", "targets", "children", "stops", "counters", "py_procs", "probe_specs", "libs_seen",
        "call_skipped", *UNWIND_MAPS,
        *LAYOUT_MAPS.values(), *PROBE_LAYOUT_MAPS.values(), *OFFCPU_LAYOUT_MAPS.values()]
OPENAT = [("syscalls", "sys_enter_openat"), ("syscalls", "sys_exit_openat")]
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SAMPLE_KEY = struct.Struct("<IIQ")  # struct sample_key: tgid, probe, arg
DRAIN_SLICE = 256  # records of the main ring buffer read between two looks at the ring of library opens


class CpuSampler:
    """Owns the BPF object. Call start(), then poll() on a timer, then close()."""

    def __init__(
        self,
        config: SamplerConfig,
        on_sample: Callable[[RawSample], None],
        on_proc: Callable[[ProcEvent], None],
        on_probe: Callable[[ProbeRecord], None] | None = None,
    ) -> None:
        self.config = config
        self._on_sample = on_sample
        self._on_proc = on_proc
        self._on_probe = on_probe
        self._obj: BpfObject | None = None
        self._ring: RingBuffer | None = None
        self._stop_ring: RingBuffer | None = None  # library opens, each holding its target stopped: read first
        self._uprobes: list[Uprobe] = []
        self._unwind: UnwindTables | None = None
        self._watchdog: StopWatchdog | None = None
        self.maps_full: dict[str, int] = {}  # per-process map -> processes it had no room for
        self._off_cpu = OffCpuPairs()
        self.event_used = ""
        self._session = False

    def start(self, pids: list[int], on_compile: Callable[[str], None] | None = None) -> None:
        """Load the program (`on_compile` is told when that means compiling it) and start sampling `pids`."""
        functions = {"on_sample": "perf_event"} | dict.fromkeys(UW_PROGS["uw_progs"], "perf_event")
        self._session = self.config.session
        if self._session:  # on_call runs at returns too: tail calls must stay within one attach type
            functions |= {"on_call": "uprobe_session"} | dict.fromkeys(UW_PROGS["uw_call_progs"], "uprobe_session")
        elif self.config.probes:
            functions |= {"on_call": "uprobe", "on_ret": "uprobe"} | dict.fromkeys(UW_PROGS["uw_call_progs"],
                                                                                   "uprobe")
        if self.config.off_cpu:  # tracepoint__sched__* come anyway
            functions |= dict.fromkeys(UW_PROGS["uw_off_progs"], "tracepoint")
        try:
            self._obj = bpf_object.load(program_text(self.config), self.config.cflags(), functions, MAPS,
                                        on_compile)
        except HostError as e:
            raise HostError(f"cannot load the BPF sampler: {e} (see `aiflame doctor`)") from None
        try:
            for array, progs in UW_PROGS.items():
                for i, prog in enumerate(progs):
                    if array in self._obj.maps:
                        self._obj.maps[array].update(_U32.pack(i), _U32.pack(self._obj.progs[prog]))
            if self.config.cfi:
                self._unwind = UnwindTables(self._obj)
            if self.config.probes:
                # before anything can stop a target: every stop is the watchdog's to undo if we cannot
                self._watchdog = StopWatchdog(self._obj.maps["stops"].fd, self.config.stop_deadline_ms)
            for pid in pids:
                self.add_target(pid)
            events = self._obj.maps["events"]
            self._ring = RingBuffer(events.fd, events.max_entries, self._callback)
            if "stop_events" in self._obj.maps:
                opens = self._obj.maps["stop_events"]
                self._stop_ring = RingBuffer(opens.fd, opens.max_entries, self._callback)
                self._ring.watch(opens.fd)
            self._obj.attach_tracepoints()
        except OSError as e:
            self.close()
            raise HostError(f"cannot attach the BPF sampler: {e}") from None
        choices = {"cpu-clock": [("cpu-clock", PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK)],
                   "cycles": [("cycles", PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES)]}
        choices["auto"] = choices["cycles"] + choices["cpu-clock"]
        errors = []
        for name, ev_type, ev_config in choices[self.config.event]:
            try:
                self._obj.attach_perf_event("on_sample", ev_type, ev_config, self.config.event_frequency)
                self.event_used = name
                break
            except OSError as e:
                errors.append(f"{name}: {e.strerror}")
        if not self.event_used:
            self.close()
            raise HostError("cannot open perf events: " + "; ".join(errors))

    @property
    def _bpf(self) -> BpfObject:
        if self._obj is None:
            raise HostError("the sampler is not started")
        return self._obj

    def _callback(self, buf: bytes) -> None:
        rec = decode_record(buf)
        if isinstance(rec, RawSample):
            if self._unwind is not None and rec.unwind:
                self._unwind.note_walk(rec.pid, rec.user, rec.unwind & STOP_MASK)
            self._on_sample(rec)
        elif isinstance(rec, OffCpuStack):
            if self._unwind is not None and rec.sample.unwind:
                self._unwind.note_walk(rec.sample.pid, rec.sample.user, rec.sample.unwind & STOP_MASK)
            self._off_cpu.stack(rec.sample)
        elif isinstance(rec, OffCpuEnd):
            done = self._off_cpu.end(rec)
            if done is not None:
                self._on_sample(done)
        elif isinstance(rec, ProcEvent):
            self._on_proc(rec)
        elif rec is not None and self._on_probe is not None:
            self._on_probe(rec)

    def add_target(self, pid: int, python: bool = False) -> None:
        """Sample `pid` (and its threads); `python`: its walker is already set (set_python). A full target map
        raises HostError: the map holds live processes only (BPF drops each at its exit), so it is full only
        when that many targets really run."""
        flags = TargetFlag.ON | (TargetFlag.PY if python else 0)
        try:
            self._bpf.maps["targets"].update(_U32.pack(pid), _U32.pack(flags))
        except OSError as e:
            if e.errno in (errno.E2BIG, errno.ENOMEM):
                raise HostError(f"cannot watch pid {pid}: {self.config.max_targets} targets already") from None
            raise

    def _set_target_flags(self, pid: int, flags: int) -> None:
        """Change a target's flags (one we added, or a child BPF follows); a pid that is not a target stays out."""
        for name in ("targets", "children"):
            t = self._bpf.maps[name]
            if t.lookup(_U32.pack(pid)) is not None:
                t.update(_U32.pack(pid), _U32.pack(flags))
                return

    def resumed(self, pid: int, stopped_ns: int) -> None:
        """We continued `pid`, stopped by a probe at `stopped_ns`: the watchdog need not. A later stop of it
        (a newer time) stays recorded."""
        stops = self._bpf.maps["stops"]
        seen = stops.lookup(_U32.pack(pid))
        if seen is not None and _U64.unpack(seen)[0] <= stopped_ns:
            stops.delete(_U32.pack(pid))

    @property
    def watchdog(self) -> StopWatchdog | None:
        """The stop watchdog (with probes): its pid, and the targets it had to continue."""
        return self._watchdog

    def remove_target(self, pid: int) -> None:
        self._bpf.maps["targets"].delete(_U32.pack(pid))
        self._bpf.maps["children"].delete(_U32.pack(pid))
        if self._unwind is not None:
            self._unwind.remove_process(pid)

    def _map_full(self, name: str, pid: int, e: OSError) -> None:
        """A per-process map is full (a target forked that many processes): this one goes without, counted."""
        if e.errno not in (errno.E2BIG, errno.ENOMEM):
            raise e
        self.maps_full[name] = self.maps_full.get(name, 0) + 1
        if self.maps_full[name] == 1:
            log.warning("BPF map %s full: pid %d and later ones go without it", name, pid)

    def set_mappings(self, pid: int, mappings: Iterable[Mapping], stopped: bool = False) -> None:
        """Describe `pid`'s executable mappings to the CFI unwinder, building the tables of files seen first
        (off the sampling path; a file without usable CFI is walked with frame pointers; with `stopped`, the
        target held until this returns, large tables not cached are built in the background). A full map
        leaves the process to frame pointers (counted: unwind_procs_full)."""
        if self._unwind is not None:
            try:
                self._unwind.add_process(pid, mappings, stopped)
            except OSError as e:
                self._map_full("unwind_procs", pid, e)

    def catch_up_tables(self) -> int:
        """Store the CFI tables built in the background, and load the evicted ones that walks stopped at since
        the last call; how many were loaded."""
        if self._unwind is None:
            return 0
        try:
            return self._unwind.catch_up()
        except OSError as e:
            log.warning("CFI tables could not be loaded again: %s", e)
            return 0

    @property
    def tables_building(self) -> bool:
        """Whether CFI tables are being built in the background: the next drain stores those that are done."""
        return self._unwind is not None and self._unwind.building

    @property
    def unwind_stats(self) -> UnwindStats | None:
        return self._unwind.stats if self._unwind is not None else None

    def set_python(self, pid: int, proc: PyProcRec) -> None:
        """Turn on the Python walk for `pid` with its layout (or update it). A full map leaves the process without
        Python frames (counted: py_procs_full)."""
        try:
            self._bpf.maps["py_procs"].update(_U32.pack(pid), bytes(proc))
        except OSError as e:
            self._map_full("py_procs", pid, e)
            return
        self._set_target_flags(pid, TargetFlag.ON | TargetFlag.PY)

    def clear_python(self, pid: int) -> None:
        self._set_target_flags(pid, TargetFlag.ON)
        self._bpf.maps["py_procs"].delete(_U32.pack(pid))

    def followed(self, pid: int) -> bool:
        """Whether BPF samples `pid`: added, or a child it followed at its fork (before any record of it is read)."""
        maps = self._bpf.maps
        return any(maps[name].lookup(_U32.pack(pid)) is not None for name in ("targets", "children"))

    def targets(self) -> list[int]:
        """The processes sampled now: those added, and the children BPF followed."""
        maps = self._bpf.maps
        return [_U32.unpack(k)[0] for name in ("targets", "children") for k in maps[name].keys()]

    def poll(self) -> None:
        """Drain everything in the ring buffers now (no waiting). A library open is read as soon as it is
        there, between slices of the main ring: its target waits, stopped, until it is handled, and must not
        wait behind the records queued before it (a CUDA library's constructors register ~24k kernels)."""
        ring, opens = self._ring, self._stop_ring
        if ring is None:
            return
        while True:
            if opens is not None:
                opens.consume()
            if ring.consume(DRAIN_SLICE) < DRAIN_SLICE:
                break
        if opens is not None:
            opens.consume()

    def wait(self, timeout_s: float) -> None:
        """Sleep until a record that asks for a wakeup arrives (a library open, an exit), a watched fd is
        readable or `timeout_s` passes, then drain. Samples and calls never wake us: they wait for the caller's
        timer."""
        if self._ring is not None:
            self._ring.wait(timeout_s)
            self.poll()

    def watch(self, fd: int) -> None:
        """End `wait` early when `fd` is readable (the caller reads it)."""
        if self._ring is not None:
            self._ring.watch(fd)

    # --- runtime probes -------------------------------------------------------------------------------------

    def set_probe_spec(self, probe: int, spec: ProbeSpecRec) -> None:
        self._bpf.maps["probe_specs"].update(_U32.pack(probe), bytes(spec))

    @property
    def uprobe_session(self) -> bool:
        """Whether runtime probes go in as session links (on_call runs at the returns its entry asks for)."""
        return self._session

    def prog_fd(self, ret: bool) -> int:
        """The loaded on_call (on_ret) program's fd, e.g. for run-time statistics; with session links on_call's
        for both."""
        return self._bpf.progs["on_ret" if ret and not self._session else "on_call"]

    def attach_probes(self, path: str, sites: Sequence[ProbeSite], *, ret: bool = False) -> dict[int, str]:
        """Probe `sites` of `path` in every process (one uprobe_multi link where the kernel has them); the program
        keeps target pids only. Returns, by probe id, why a site could not be probed. With session links the
        entry's link serves the return too: `ret` attaches nothing."""
        if ret and self._session:
            return {}
        done, failed = attach_sites(self.prog_fd(ret), path, sites, ret=ret, multi=self._bpf.uprobe_multi,
                                    session=self._session)
        self._uprobes += done
        return failed

    def mark_library_seen(self, path_hash: int) -> None:
        """Opens of this path (FNV-1a of its bytes, as the target passed them) no longer stop targets."""
        self._bpf.maps["libs_seen"].update(_U64.pack(path_hash), b"\x01")

    def take_unsent_calls(self) -> list[tuple[int, int, int, int]]:
        """Launches counted in BPF without a record that no later record carried, summed over CPUs and taken out
        of the map: (pid, probe, the launched thing's argument value, calls)."""
        table = self._bpf.maps.get("call_skipped")
        if table is None:
            return []
        out = []
        for key in table.keys():
            n = sum(_U64.unpack(v)[0] for v in table.lookup_percpu(key))
            table.delete(key)
            if n:
                out.append((*_SAMPLE_KEY.unpack(key), n))
        return out

    def forget_libraries_seen(self) -> None:
        """Opens of any library stop targets again (after the probes were detached to be placed anew)."""
        self._bpf.maps["libs_seen"].clear()

    def finish_off_cpu(self, end_ns: int) -> None:
        """The threads still blocked at the end of the capture (`end_ns`) become off-CPU samples, blocked until
        then; drain first, so that the ends of blocks already over are in."""
        for s in self._off_cpu.finish(end_ns):
            self._on_sample(s)

    def counters(self) -> dict[str, int]:
        table = self._bpf.maps["counters"]
        out = {c.name.lower(): sum(_U64.unpack(v)[0] for v in table.lookup_percpu(_U32.pack(c.value)))
               for c in Counter if self.config.off_cpu or not c.name.startswith("OFFCPU")}
        if self.config.off_cpu:
            out["offcpu_unpaired"] = self._off_cpu.unpaired
        if self._watchdog is not None:
            self._watchdog.poll()
            out["stops_resumed_by_watchdog"] = self._watchdog.resumed
        for name, n in self.maps_full.items():
            out[f"{name}_full"] = n
        return out

    def layouts(self) -> dict[str, tuple[list[tuple[str, int, int]], int]]:
        """The record structs as the compiler laid them out: (fields as (name, offset, size), size), by name."""
        names = LAYOUT_MAPS | (PROBE_LAYOUT_MAPS if self.config.probes else {}) | \
            (OFFCPU_LAYOUT_MAPS if self.config.off_cpu else {})
        maps = self._bpf.maps
        return {struct_name: (maps[m].fields, maps[m].value_size) for struct_name, m in names.items()}

    def detach_probes(self, background: bool = False) -> None:
        """Remove every runtime probe attached so far (the program stays loaded). Each link's detach waits out
        the kernel's uprobe grace period (~0.1 s here), so they run on parallel threads; with `background`,
        without waiting for them."""
        probes, self._uprobes = self._uprobes, []
        if not probes:
            return
        lanes = [probes[i::DETACH_THREADS] for i in range(min(DETACH_THREADS, len(probes)))]
        threads = [threading.Thread(target=_close_all, args=(lane,), daemon=True) for lane in lanes]
        for t in threads:
            t.start()
        if not background:
            for t in threads:
                t.join()

    def stop_stopping(self) -> None:
        """From now on no probe or library open stops a target. Returns once none that had started can still be
        running (detaching waits them out), so every stop record already sent is in the ring buffer."""
        self.detach_probes()
        if self._obj is not None:
            for tracepoint in OPENAT:  # the exit's too: an open entered before may return after
                self._obj.detach(":".join(tracepoint))

    def close(self) -> None:
        self.stop_stopping()
        if self._watchdog is not None:
            self._watchdog.close()  # it continues any target still recorded as stopped
            self._watchdog = None
        if self._unwind is not None:
            self._unwind.close()
            self._unwind = None
        for ring in (self._ring, self._stop_ring):
            if ring is not None:
                ring.close()
        self._ring = self._stop_ring = None
        if self._obj is not None:
            self._obj.close()
            self._obj = None
