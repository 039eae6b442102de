"""One capture (`aiflame profile`): start or attach to the target, run the capture pipeline (agent.pipeline) into
one capture file, stop on duration / target exit / signal, and keep everything collected."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from aiflame.agent.accel.cupti import CuptiOptions, GpuSamples
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
from aiflame.agent.launcher import Launcher
from aiflame.agent.pipeline import FIRST_COLLECTIVE, CapturePipeline, SessionStats, mono_ns
from aiflame.agent.preflight import check_out_dir, check_pid, check_root, check_tracefs
from aiflame.agent.procs import alive, descendants, own_cpu_s
from aiflame.agent.runtimes.manager import Attached
from aiflame.core.capture import CaptureWriter, new_header
from aiflame.core.errors import BadInput
from aiflame.core.raw import CaptureFooter, CaptureHeader

__all__ = ["Session", "SessionConfig", "SessionResult", "SessionStats", "check_pid", "check_root"]

POLL_S = 0.1


@dataclass
class SessionResult:
    capture: Path
    stop_reason: str
    stats: SessionStats
    agent_cpu_s: float
    exit_code: int | None = None  # of the command, with `-- CMD`
    warnings: list[str] = field(default_factory=list)
    probed: list[Attached] = field(default_factory=list)  # libraries whose runtime calls were probed


@dataclass
class SessionConfig:
    out_dir: Path
    pid: int | None = None
    command: list[str] = field(default_factory=list)
    duration_s: float | None = None
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    prefix: str = "profile"
    argv: list[str] = field(default_factory=list)
    runtimes: bool = True  # probe accelerator runtimes (CUDA, NCCL, gloo, Level Zero) in the targets
    gpu_samples: bool = True  # NVIDIA stall sampling (CUPTI, in targets started with -- CMD)
    cupti: CuptiOptions = field(default_factory=CuptiOptions)  # its rate and buffer limits
    # CPU samples from the first `delay_s` seconds are left out (start-up, imports); the targets are followed and
    # their runtime calls recorded from the start, so kernel names and collectives stay whole.
    delay_s: float = 0.0
    from_first_collective: bool = False  # instead: CPU samples from the first collective call a target makes
    all_processes: bool = False  # the whole host (`profile -a`): no target; sampler.all_processes goes with it
    keep_running: bool = False  # with -- CMD: leave the command running when we end (else it gets SIGTERM)


class Session:
    """Runs one capture. `on_progress` is called about every POLL_S with live stats; `on_status` with a line
    on what start-up waits for (starting the sampler, compiling the BPF program)."""

    def __init__(self, config: SessionConfig, on_progress: Callable[[SessionStats], None] | None = None,
                 on_status: Callable[[str], None] | None = None) -> None:
        if config.all_processes:
            if config.pid is not None or config.command or not config.sampler.all_processes:
                raise BadInput("the whole host (-a) takes no --pid or command, and samples every process")
        elif (config.pid is None) == (not config.command):
            raise BadInput("give either --pid PID or -- CMD ARGS")
        self.cfg = config
        self.on_progress = on_progress
        self.on_status = on_status
        # With --pid, the target's own exit record leaves it a target (its end is seen by polling it).
        self.pipeline = CapturePipeline(config.runtimes, keep_target=config.pid)
        self._stop_reason = ""

    @property
    def stats(self) -> SessionStats:
        return self.pipeline.stats

    def _signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stop_reason = "interrupted" if signum == signal.SIGINT else "terminated"

    def run(self) -> SessionResult:
        cfg = self.cfg
        check_root()
        check_tracefs()
        if cfg.pid is not None:
            check_pid(cfg.pid)
        check_out_dir(cfg.out_dir)
        self.gpu = GpuSamples(cfg.out_dir, cfg.gpu_samples, bool(cfg.command), cfg.cupti)
        launcher = (Launcher(cfg.command, self.gpu.child_env(), end_with_us=not cfg.keep_running) if cfg.command
                    else None)
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
        root_pid = launcher.pid if launcher else cfg.pid
        assert root_pid is not None or cfg.all_processes
        try:
            try:
                # children are followed with --pid too: a launcher's (torchrun's) workers are the job; the whole
                # host has no targets (every process is sampled, each described at its first sample)
                initial = ([] if root_pid is None else [root_pid] if launcher
                           else [root_pid, *descendants(root_pid)])
                # A running process becomes a target only once its Python walker is set (_capture): until then
                # its samples would lack their Python frames. A launched command is held until released.
                if self.on_status:
                    self.on_status("starting BPF sampler")
                sampler = self.pipeline.start(cfg.sampler, initial if launcher else [], self.on_status)
            except BaseException:
                if launcher:
                    launcher.abort()
                raise
            if launcher and self.pipeline.probes:
                self.pipeline.probes.consider(launcher.exe)  # static cudart in the program itself
            if not launcher and root_pid is not None and not alive(root_pid):
                raise BadInput(f"process {root_pid} exited before the sampler attached")
            return self._capture(sampler, launcher, root_pid, initial)
        finally:
            self.pipeline.close()
            for s, h in old.items():
                signal.signal(s, h)

    def _capture(self, sampler: CpuSampler, launcher: Launcher | None, root_pid: int | None,
                 initial: list[int]) -> SessionResult:
        cfg, pipe = self.cfg, self.pipeline
        path = cfg.out_dir / f"{cfg.prefix}.aiflame"
        writer = CaptureWriter(path, self._header(sampler))
        pipe.open_file(writer)
        if launcher:
            launcher.release()
            time.sleep(0.05)  # let the dynamic loader map the program's libraries
        for pid in initial:
            pipe.snapshot(pid)
            if not launcher:
                sampler.add_target(pid, python=pid in pipe.python.procs)
        cpu0, t0 = own_cpu_s(), time.monotonic()
        if cfg.from_first_collective:
            pipe.samples_from_ns = FIRST_COLLECTIVE
        elif cfg.delay_s:
            pipe.samples_from_ns = mono_ns() + int(cfg.delay_s * 1e9)
        deadline = t0 + cfg.delay_s + cfg.duration_s if cfg.duration_s else None
        self._poll(sampler, launcher, root_pid, t0, deadline)
        stop_ns = mono_ns()
        pipe.release_targets()
        pipe.drain()  # answers the stops already sent; finish() continues any still held
        pipe.finish_off_cpu(stop_ns)
        if pipe.probes:
            pipe.probes.finish(mono_ns())
        code_warnings = pipe.write_gpu_code()
        agent_cpu = own_cpu_s() - cpu0
        pipe.write_kernel_names()
        table_warnings = self._final_counters(sampler)
        gpu_counters, gpu_warnings = self.gpu.finish(writer, pipe.launches.saw_runtime("cuda"),
                                                     bool(launcher and not launcher.poll()))
        self.stats.counters.update(gpu_counters)
        writer.close(CaptureFooter(
            time.time_ns(), mono_ns(), 0, dict(self.stats.counters), self._stop_reason, agent_cpu,
        ))
        exit_code = None
        if launcher:
            if self._stop_reason in ("interrupted", "terminated"):
                launcher.stop(signal.SIGINT if self._stop_reason == "interrupted" else signal.SIGTERM)
            exit_code = launcher.exit_code
        warnings = list(pipe.python.warnings) + (pipe.probes.warnings if pipe.probes else []) + code_warnings
        warnings += gpu_warnings + table_warnings
        probed = pipe.probes.probed_files() if pipe.probes else []
        return SessionResult(path, self._stop_reason, self.stats, agent_cpu, exit_code, warnings, probed)

    def _header(self, sampler: CpuSampler) -> CaptureHeader:
        cfg = self.cfg
        return new_header(cfg.sampler.frequency, sampler.event_used, cfg.argv or sys.argv,
                          " ".join(cfg.command) if cfg.command else
                          "all processes" if cfg.all_processes else f"pid {cfg.pid}",
                          {"sampling": cfg.sampler.describe(sampler.event_used)}, off_cpu=cfg.sampler.off_cpu)

    def _poll(self, sampler: CpuSampler, launcher: Launcher | None, root_pid: int | None, t0: float,
              deadline: float | None) -> None:
        """Drain the pipeline about every POLL_S until a stop reason: a signal, the duration, the target's end."""
        pipe = self.pipeline
        while not self._stop_reason:
            tick = time.monotonic() + POLL_S
            # Library opens wake us at once (their process waits, stopped, for its probes).
            while not self._stop_reason and (left := tick - time.monotonic()) > 0:
                sampler.wait(left)
            pipe.drain()
            now = time.monotonic()
            self.stats.elapsed_s = now - t0
            if self.on_progress:
                self.on_progress(self.stats)
            if deadline and now >= deadline:
                self._stop_reason = "duration"
            elif launcher and launcher.poll():
                self._stop_reason = f"command exited ({launcher.exit_code})"
            elif not launcher and root_pid is not None and not alive(root_pid):
                self._stop_reason = "target exited"

    def _final_counters(self, sampler: CpuSampler) -> list[str]:
        """The sampler's, the unwind tables' and the runtime probes' counters into the stats; the warnings on
        files whose CFI table failed."""
        pipe = self.pipeline
        self.stats.counters = sampler.counters()
        if pipe.before_delay:
            self.stats.counters["before_delay"] = pipe.before_delay
        uw = sampler.unwind_stats
        table_warnings: list[str] = []
        if uw is not None:  # what the CFI tables cost and lost: loads, evictions, files left to frame pointers
            self.stats.counters.update({"unwind_tables": uw.tables, "unwind_tables_loaded": uw.loaded,
                                        "unwind_tables_evicted": uw.evicted, "unwind_table_errors": len(uw.errors),
                                        "unwind_tables_reloaded": uw.reloaded, "unwind_tables_deferred": uw.deferred,
                                        "unwind_tables_evicted_again": uw.evicted_again,
                                        "unwind_tables_background": uw.background, "unwind_rows": uw.rows_used})
            table_warnings = [f"no CFI table, frame pointers only: {e}" for e in list(uw.errors.values())[:5]]
        if pipe.probes:
            self.stats.counters["calls"] = pipe.probes.calls_seen
            self.stats.counters["calls_counted"] = pipe.probes.calls_counted
            self.stats.counters["calls_unsent"] = pipe.probes.calls_unsent
            self.stats.counters["returns_lost"] = pipe.probes.returns_lost
            self.stats.counters["stops_late"] = pipe.probes.stops_late
            self.stats.counters["stops"] = pipe.probes.stops
            self.stats.counters["stopped_ms"] = pipe.probes.stopped_ns // 1_000_000
            self.stats.counters["libs_seen_full"] = pipe.probes.libs_seen_full
        return table_warnings
