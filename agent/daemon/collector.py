"""The daemon's collector: the capture session's machinery (sampler, Python walker, runtime probes, mapping
snapshots, drain) run over a changing set of targets and cut into consecutive capture files.

`Session` (agent/session.py) owns the per-sample work; this subclass adds what a process that never ends
needs: targets added and forgotten while it runs, one capture file per window with everything a window must
hold to stand alone (each live target's mappings and Python runtime, re-written at every rotation), and state
that stays bounded whatever the number of process lifetimes (per-pid tables dropped at exit, probe libraries
re-placed past a limit, events kept only as far as GPU code lookup needs them).
"""

from __future__ import annotations

import mmap
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiflame.agent.gpu_code import launched_cubins
from aiflame.agent.kernel.bpf_sys import cpu_list
from aiflame.agent.kernel.records import RecKind
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
from aiflame.agent.procmaps import BuildIdCache
from aiflame.agent.runtimes import all_runtimes
from aiflame.agent.runtimes.manager import ProbeManager
from aiflame.agent.session import Session, SessionConfig, _cpu_s, _mono_ns
from aiflame.core.capture import CaptureWriter, new_header
from aiflame.core.raw import CaptureFooter, PyRuntimeInfo, RawEvent

_REGISTRATIONS = ("__cudaRegisterFatBinary", "__cudaRegisterFunction")
# Probes stay in a library while targets may call it; with no target left for this long they are removed.
PROBE_IDLE_S = 300.0
WORST_SAMPLE_BYTES = 2048  # a sample with deep native and Python stacks
MAX_FATBIN_BYTES = 256 << 20  # fatbins copied from target memory, kept for later windows' cubin lookups


@dataclass
class WindowResult:
    """A finished capture file and what went into it."""

    path: Path
    samples: int
    events: int
    counters: dict[str, int] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # new in this window (probes, Python walker, GPU code)


class Collector(Session):
    """Samples a set of processes at one rate and writes one capture per window.

    Use: `start()`, then `open_window(path)`, `add_target(pid)` as targets appear, `tick(seconds)` in a loop,
    `close_window()` / `open_window()` to rotate, and `close()` at the end.
    """

    def __init__(self, sampler: SamplerConfig, runtimes: bool, label: str, max_probed_libraries: int = 64) -> None:
        # pid 0 is never a process: every target that exits is dropped (Session keeps a --pid target's entry).
        super().__init__(SessionConfig(out_dir=Path("."), pid=0, sampler=sampler, runtimes=runtimes))
        self.label = label
        self.max_probed_libraries = max_probed_libraries
        self.exited: list[int] = []  # pids whose exit was seen since the caller last looked
        self._window_samples0 = 0
        self._window_events0 = 0
        self._counters0: dict[str, int] = {}
        self._cpu0 = 0.0
        self._registrations: dict[int, list[RawEvent]] = {}  # pid -> fatbin/function registrations
        self.windows_written = 0
        self._idle_since = time.monotonic()
        self._reported: set[str] = set()  # warnings already handed out in a WindowResult

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Compile and attach the BPF program (seconds: once per collector, never per window or target)."""
        cfg = SamplerConfig(**{**self.cfg.sampler.__dict__, "follow_children": True, "probes": self.cfg.runtimes})
        sampler = CpuSampler(cfg, self._pending.append, self._procs.append, self._on_probe)
        sampler.start([])
        self._sampler = sampler
        self._kernel_table()  # now, with the compile: every window close names kernel addresses from it
        if self.cfg.runtimes:
            self.probes = ProbeManager(all_runtimes(), sampler, on_stop=self._on_target_stop)

    @property
    def sampler(self) -> CpuSampler:
        assert self._sampler is not None, "start() first"
        return self._sampler

    @property
    def targets(self) -> list[int]:
        return sorted(self._snaps)

    def add_target(self, pid: int) -> None:
        """Start sampling `pid` (and the children it forks from now on)."""
        if pid in self._snaps:
            return
        self.sampler.add_target(pid)
        if self._writer is not None:
            self._snapshot(pid, self._writer)

    def remove_target(self, pid: int) -> None:
        self.sampler.remove_target(pid)
        self._forget(pid)

    def drain_interval(self, longest_s: float) -> float:
        """How long records may wait in the ring buffer: `longest_s`, or less where every online CPU running a
        target at the sampling rate, with deep stacks, could fill a quarter of the ring sooner."""
        cfg = self.cfg.sampler
        worst = cfg.frequency * len(cpu_list("online")) * WORST_SAMPLE_BYTES
        return max(min(longest_s, cfg.ringbuf_pages * mmap.PAGESIZE / 4 / worst), 0.05)

    def tick(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` (a library open by a target wakes us early), then drain into the window."""
        assert self._writer is not None
        self.sampler.wait(timeout_s)
        self._drain(self.sampler, self._writer)

    def close(self) -> None:
        if self._sampler is not None and self.probes:
            # Never leave a target stopped: no process is a target any more (no new stops), the stopping probes
            # and the library-open tracepoint are gone (their programs have finished), and the stop records
            # already sent are drained and answered. As at the end of Session._capture.
            for pid in self._sampler.targets():
                self._sampler.remove_target(pid)
            self._sampler.stop_stopping()
            self._sampler.poll()
        if self.probes:
            self.probes.finish()
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self.python.close()

    # --- windows --------------------------------------------------------------------------------------------

    def open_window(self, path: Path, target: str = "") -> None:
        """Start a capture file; the live targets' mappings and Python runtimes go in first."""
        assert self._writer is None
        header = new_header(self.cfg.sampler.frequency, self.sampler.event_used, sys.argv, target or self.label,
                            {"aiflame.mode": self.label,
                             "sampling": self.cfg.sampler.describe(self.sampler.event_used)})
        writer = CaptureWriter(path, header)
        self._writer = writer
        self._kaddrs = set()
        self._counters0 = self.sampler.counters()
        self._window_samples0 = self.stats.samples
        self._window_events0 = self.stats.events
        self._cpu0 = _cpu_s()
        for snap in self._snaps.values():
            writer.add_process(snap)
        for pid, proc in self.python.procs.items():
            t = proc.target
            writer.add_py_runtime(PyRuntimeInfo(pid, ".".join(map(str, t.version)), t.layout.source, t.binary))
            proc.written.clear()  # code objects are re-read for this file as its samples name them
        for pid in self._snaps:
            self._known[pid] = set()

    def close_window(self, stop_reason: str) -> WindowResult:
        """Drain, finish the capture file (GPU code, kernel symbols, counters of this window) and close it."""
        writer = self._writer
        assert writer is not None
        self._drain(self.sampler, writer)
        if self.probes:
            self._write_probe_output(writer)
            regs = [e for evs in self._registrations.values() for e in evs]
            cubins, warnings = launched_cubins([*regs, *self._events], self._memory_fatbins)
            self._code_warnings.extend(w for w in warnings if w not in self._code_warnings)
            del self._code_warnings[:-20]
            for c in cubins:
                writer.add_gpu_code(c)
        writer.add_kernel_symbols(self._kernel_symbols())
        now_counters = self.sampler.counters()
        counters = {k: v - self._counters0.get(k, 0) for k, v in now_counters.items()}
        if self.probes:
            counters["returns_lost"] = self.probes.returns_lost
        self.stats.counters = now_counters
        result = WindowResult(writer.path, self.stats.samples - self._window_samples0,
                              self.stats.events - self._window_events0, counters, self.targets, self._new_warnings())
        writer.close(CaptureFooter(time.time_ns(), _mono_ns(), 0, counters, stop_reason, _cpu_s() - self._cpu0))
        self._writer = None
        self._events.clear()
        self.windows_written += 1
        self._bound_state()
        return result

    def discard_window(self) -> None:
        """Drop the open window's file (an aborted capture)."""
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.close(CaptureFooter(stop_reason="aborted"))
            w.path.unlink(missing_ok=True)

    def _new_warnings(self) -> list[str]:
        """Warnings not reported before (each once; the lists they come from keep their last 20)."""
        every = [*(self.probes.warnings if self.probes else []), *self.python.warnings, *self._code_warnings]
        new = [w for w in dict.fromkeys(every) if w not in self._reported]
        if len(self._reported) > 4096:
            self._reported.clear()  # bounded: a warning may then be reported once more
        self._reported.update(new)
        return new

    # --- bounded state --------------------------------------------------------------------------------------

    def _drain(self, sampler: CpuSampler, writer: CaptureWriter) -> None:
        exited = [ev.pid for ev in self._procs if ev.kind == RecKind.EXIT]
        super()._drain(sampler, writer)
        for pid in exited:  # after the drain: the exited process's last samples needed its tables
            self._forget(pid)
        self.exited.extend(exited)

    def _write_probe_output(self, writer: CaptureWriter) -> None:
        super()._write_probe_output(writer)
        # Keep only what the end of the window needs to find launched kernels' cubins: registrations (for as
        # long as their process lives) and one launch per kernel.
        keep: dict[tuple[int, int, str], RawEvent] = {}
        for e in self._events:
            if e.call in _REGISTRATIONS:
                self._registrations.setdefault(e.pid, []).append(e)
            elif e.kind == "compute":
                keep.setdefault((e.pid, e.args.get("func", 0), e.strs.get("name", "")), e)
        self._events[:] = keep.values()

    def _forget(self, pid: int) -> None:
        """Everything kept about a process that is gone (BPF map entries, fds, per-pid tables)."""
        if self._sampler is not None:
            self._sampler.clear_python(pid)
        self.python.forget(pid)
        if self.probes:
            self.probes.forget(pid)
            _drop_open_calls(self.probes, pid)
        for table in (self._snaps, self._known, self._remap_at, self._exec_seq, self._registrations):
            table.pop(pid, None)
        self.stats.pids = len(self._snaps)

    def _bound_state(self) -> None:
        """Between windows: caches that grow with distinct files are capped, and probes are re-placed when they
        sit in too many libraries or no target is left to use them."""
        if self.windows_written % 16 == 0:
            self._build_ids = BuildIdCache()  # one entry per library file ever seen: start over now and then
        while self._memory_fatbins and sum(map(len, self._memory_fatbins.values())) > MAX_FATBIN_BYTES:
            del self._memory_fatbins[next(iter(self._memory_fatbins))]
        del self.python.warnings[:-20]
        if self.probes:
            del self.probes.warnings[:-20]
        now = time.monotonic()
        if self._snaps:
            self._idle_since = now
        if self.probes and (len(self.probes.attached) > self.max_probed_libraries
                            or (self.probes.attached and now - self._idle_since > PROBE_IDLE_S)):
            self.reset_probes()

    def reset_probes(self) -> None:
        """Detach every runtime probe and place them again for the live targets only."""
        if not self.probes:
            return
        self.probes.finish()
        self.sampler.detach_probes(background=True)  # seconds of kernel grace periods: not on our thread
        self.sampler.forget_libraries_seen()
        old = self.probes
        self.probes = ProbeManager(all_runtimes(), self.sampler, on_stop=self._on_target_stop)
        self.probes.calls_seen, self.probes.returns_lost = old.calls_seen, old.returns_lost
        for pid, snap in self._snaps.items():
            self.probes.consider_process(pid, [m.path for m in snap.mappings])

    @property
    def probed_libraries(self) -> int:
        return len(self.probes.attached) if self.probes else 0


def _drop_open_calls(probes: ProbeManager, pid: int) -> None:
    """Calls of an exited process that never returned (ProbeManager keys them by thread id)."""
    open_calls = probes._open
    for tid in [t for t, stack in open_calls.items() if stack and stack[0].pid == pid]:
        del open_calls[tid]
