"""The daemon's collector: the capture pipeline (agent.pipeline: sampler, Python walker, runtime probes, mapping
snapshots, drain) run over a changing set of targets and cut into consecutive capture files.

What a process that never ends adds to the pipeline: targets added and forgotten while it runs, one capture
file per window with everything a window must hold to stand alone (each live target's mappings and Python
runtime, re-written at every rotation), and state that stays bounded whatever the number of process lifetimes
(per-pid tables dropped at exit, probe libraries re-placed past a limit, events kept only as far as GPU code
lookup needs them).
"""

from __future__ import annotations

import logging
import mmap
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiflame.agent.kernel.bpf_sys import cpu_list
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
from aiflame.agent.pipeline import CapturePipeline, SessionStats, mono_ns
from aiflame.agent.procmaps import BuildIdCache
from aiflame.agent.procs import own_cpu_s
from aiflame.core.capture import CaptureWriter, new_header
from aiflame.core.errors import HostError
from aiflame.core.raw import CaptureFooter

log = logging.getLogger("aiflame.daemon")

# Probes stay in a library while targets may call it; with no target left for this long they are removed.
PROBE_IDLE_S = 300.0
WORST_SAMPLE_BYTES = 2048  # a sample with deep native and Python stacks
MAX_FATBIN_BYTES = 256 << 20  # fatbins copied from target memory, kept for later windows' cubin lookups
MAX_WARNINGS = 20  # each warning list keeps its last this many


@dataclass
class WindowResult:
    """A finished capture file and what went into it."""

    path: Path
    samples: int
    events: int
    counters: dict[str, int] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # new in this window (probes, Python walker, GPU code)


class Collector:
    """Samples a set of processes at one rate and writes one capture per window.

    Use: `start()`, then `open_window(path)`, `add_target(pid)` as targets appear, `tick(seconds)` in a loop,
    `close_window()` / `open_window()` to rotate, and `close()` at the end.
    """

    def __init__(self, sampler: SamplerConfig, runtimes: bool, label: str, max_probed_libraries: int = 64) -> None:
        self.sampler_config = sampler
        self.label = label
        self.max_probed_libraries = max_probed_libraries
        self.pipeline = CapturePipeline(runtimes, bounded=True)
        self.exited: list[int] = []  # pids whose exit was seen since the caller last looked
        self.targets_refused = 0  # add_target calls BPF had no room for
        self.windows_written = 0
        self.code_warnings: list[str] = []  # the GPU code lookup's, last MAX_WARNINGS
        self._window_samples0 = 0
        self._window_events0 = 0
        self._counters0: dict[str, int] = {}
        self._cpu0 = 0.0
        self._idle_since = time.monotonic()
        self._reported: set[str] = set()  # warnings already handed out in a WindowResult

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Compile and attach the BPF program (seconds: once per collector, never per window or target)."""
        self.pipeline.start(self.sampler_config, [])
        self.pipeline.kernel.table()  # now, with the compile: every window close names kernel addresses from it

    @property
    def sampler(self) -> CpuSampler:
        assert self.pipeline.sampler is not None, "start() first"
        return self.pipeline.sampler

    @property
    def stats(self) -> SessionStats:
        return self.pipeline.stats

    @property
    def targets(self) -> list[int]:
        return sorted(self.pipeline.processes.snaps)

    @property
    def window_samples(self) -> int:
        """Samples in the window open now."""
        return self.stats.samples - self._window_samples0

    @property
    def probed_libraries(self) -> int:
        probes = self.pipeline.probes
        return len(probes.attached) if probes else 0

    def samples(self, pid: int) -> bool:
        """Whether `pid` is sampled already (added, or a child followed since its parent was): known here, or in
        BPF's maps, which take a child at its fork, before its records are drained (a fork flood on a busy host)."""
        return pid in self.pipeline.processes.snaps or self.sampler.followed(pid)

    def add_target(self, pid: int) -> bool:
        """Start sampling `pid` (and the children it forks from now on); False when BPF has no room for it (its
        target map full: counted in `targets_refused`, logged, and the collector goes on)."""
        if pid in self.pipeline.processes.snaps:
            return True
        try:
            self.sampler.add_target(pid)
        except HostError as e:
            self.targets_refused += 1
            if self.targets_refused in (1, 10, 100) or self.targets_refused % 1000 == 0:
                log.warning("target refused pid=%d refused=%d: %s", pid, self.targets_refused, e)
            return False
        if self.pipeline.writer is not None:
            self.pipeline.snapshot(pid)
        return True

    def remove_target(self, pid: int) -> None:
        self.sampler.remove_target(pid)
        self.pipeline.forget(pid)

    def drain_interval(self, longest_s: float) -> float:
        """How long records may wait in the ring buffer: `longest_s`, or less where every online CPU running a
        target at the sampling rate, with deep stacks, could fill a quarter of the ring sooner."""
        cfg = self.sampler_config
        worst = cfg.frequency * len(cpu_list("online")) * WORST_SAMPLE_BYTES
        return max(min(longest_s, cfg.ringbuf_pages * mmap.PAGESIZE / 4 / worst), 0.05)

    def tick(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` (a library open by a target wakes us early), then drain into the window."""
        assert self.pipeline.writer is not None
        self.sampler.wait(timeout_s)
        self._drain()

    def close(self) -> None:
        pipe = self.pipeline
        if pipe.sampler is not None and pipe.probes:
            pipe.release_targets()
            pipe.sampler.poll()  # the stop records already sent are answered; close() continues the rest
        pipe.close()

    # --- windows --------------------------------------------------------------------------------------------

    def _probe_counters(self) -> dict[str, int]:
        """The probes' own counts since the collector started (targets held past the deadline among them)."""
        probes = self.pipeline.probes
        if probes is None:
            return {}
        return {"returns_lost": probes.returns_lost, "stops_late": probes.stops_late,
                "libs_seen_full": probes.libs_seen_full}

    def open_window(self, path: Path, target: str = "") -> None:
        """Start a capture file; the live targets' mappings and Python runtimes go in first."""
        assert self.pipeline.writer is None
        header = new_header(self.sampler_config.frequency, self.sampler.event_used, sys.argv, target or self.label,
                            {"aiflame.mode": self.label,
                             "sampling": self.sampler_config.describe(self.sampler.event_used)})
        self._counters0 = self.sampler.counters() | self._probe_counters()
        self._window_samples0 = self.stats.samples
        self._window_events0 = self.stats.events
        self._cpu0 = own_cpu_s()
        self.pipeline.open_file(CaptureWriter(path, header))

    def close_window(self, stop_reason: str) -> WindowResult:
        """Drain, finish the capture file (GPU code, kernel symbols, counters of this window) and close it."""
        pipe = self.pipeline
        writer = pipe.writer
        assert writer is not None
        self._drain()
        warnings = pipe.write_gpu_code()
        self.code_warnings.extend(w for w in warnings if w not in self.code_warnings)
        del self.code_warnings[:-MAX_WARNINGS]
        pipe.write_kernel_names()
        now_counters = self.sampler.counters() | self._probe_counters()
        # this window's share of each (the status adds the windows' counters up)
        counters = {k: v - self._counters0.get(k, 0) for k, v in now_counters.items()}
        self.stats.counters = now_counters
        result = WindowResult(writer.path, self.stats.samples - self._window_samples0,
                              self.stats.events - self._window_events0, counters, self.targets, self._new_warnings())
        writer.close(CaptureFooter(time.time_ns(), mono_ns(), 0, counters, stop_reason, own_cpu_s() - self._cpu0))
        pipe.writer = None
        pipe.launches.end_file()
        self.windows_written += 1
        self._bound_state()
        return result

    def discard_window(self) -> None:
        """Drop the open window's file (an aborted capture)."""
        w, self.pipeline.writer = self.pipeline.writer, None
        if w is not None:
            w.close(CaptureFooter(stop_reason="aborted"))
            w.path.unlink(missing_ok=True)

    def _new_warnings(self) -> list[str]:
        """Warnings not reported before (each once; the lists they come from keep their last MAX_WARNINGS)."""
        probes = self.pipeline.probes
        every = [*(probes.warnings if probes else []), *self.pipeline.python.warnings, *self.code_warnings]
        new = [w for w in dict.fromkeys(every) if w not in self._reported]
        if len(self._reported) > 4096:
            self._reported.clear()  # bounded: a warning may then be reported once more
        self._reported.update(new)
        return new

    # --- bounded state --------------------------------------------------------------------------------------

    def _drain(self) -> None:
        exited = self.pipeline.drain()
        for pid in exited:  # after the drain: the exited process's last samples needed its tables
            self.pipeline.forget(pid)
        self.exited.extend(exited)

    def _bound_state(self) -> None:
        """Between windows: caches that grow with distinct files are capped, and probes are re-placed when they
        sit in too many libraries or no target is left to use them."""
        pipe = self.pipeline
        if self.windows_written % 16 == 0:
            pipe.processes.build_ids = BuildIdCache()  # one entry per library file ever seen: start over now and then
        while pipe.memory_fatbins and sum(map(len, pipe.memory_fatbins.values())) > MAX_FATBIN_BYTES:
            del pipe.memory_fatbins[next(iter(pipe.memory_fatbins))]
        del pipe.python.warnings[:-MAX_WARNINGS]
        if pipe.probes:
            del pipe.probes.warnings[:-MAX_WARNINGS]
        now = time.monotonic()
        if pipe.processes.snaps:
            self._idle_since = now
        if pipe.probes and (len(pipe.probes.attached) > self.max_probed_libraries
                            or (pipe.probes.attached and now - self._idle_since > PROBE_IDLE_S)):
            self.reset_probes()

    def reset_probes(self) -> None:
        """Detach every runtime probe and place them again for the live targets only."""
        pipe = self.pipeline
        old = pipe.probes
        if not old:
            return
        old.finish(unsent=False)  # launches counted in BPF stay there for the next records
        self.sampler.detach_probes(background=True)  # seconds of kernel grace periods: not on our thread
        self.sampler.forget_libraries_seen()
        pipe.probes = pipe.new_probes()
        pipe.probes.calls_seen, pipe.probes.returns_lost = old.calls_seen, old.returns_lost
        pipe.probes.calls_counted = old.calls_counted
        for pid, snap in pipe.processes.snaps.items():
            pipe.probes.consider_process(pid, [m.path for m in snap.mappings])
