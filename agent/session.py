"""One capture: start or attach to the target, run the sampler, stream records into the capture file, stop
on duration / target exit / signal, and keep everything collected."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from aiflame import __version__
from aiflame.agent.accel.cupti import CuptiOptions, GpuSamples
from aiflame.agent.gpu_code import launched_cubins
from aiflame.agent.kernel.records import RecKind
from aiflame.agent.kernel.sampler import CpuSampler, ProbeRecord, ProcEvent, SamplerConfig
from aiflame.agent.procmaps import BuildIdCache, read_maps, read_process, stat_fields
from aiflame.agent.python.runtime import PythonPlugin, proc_rec
from aiflame.agent.rank_env import rank_event
from aiflame.agent.runtimes import all_runtimes
from aiflame.agent.runtimes.manager import Attached, ProbeManager
from aiflame.core.capture import FORMAT_VERSION, CaptureWriter
from aiflame.core.errors import BadInput
from aiflame.core.raw import CaptureFooter, CaptureHeader, ProcessSnapshot, RawEvent, RawSample
from aiflame.symbolize.objfmt.kallsyms import KernelSymbols

POLL_S = 0.1
REMAP_MIN_S = 0.5  # re-read a process's maps at most this often when addresses fall outside them


class SessionError(BadInput):
    """The capture cannot start; one user-facing line."""


@dataclass
class SessionStats:
    samples: int = 0
    events: int = 0
    elapsed_s: float = 0.0
    pids: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return self.counters.get("lost", 0)


@dataclass
class SessionResult:
    capture: Path
    stop_reason: str
    stats: SessionStats
    agent_cpu_s: float
    exit_code: int | None = None  # of the command, with `-- CMD`
    warnings: list[str] = field(default_factory=list)
    probed: list[Attached] = field(default_factory=list)  # libraries whose runtime calls were probed


INIT_PID_NS = "pid:[4026531836]"  # the kernel's fixed inode of the initial PID namespace (PROC_PID_INIT_INO)


def check_root() -> None:
    """Root, and a /proc that numbers processes as BPF does (the host's PID namespace)."""
    if os.geteuid() != 0:
        raise SessionError("must run as root (BPF and perf events need it); try sudo")
    try:
        ns = os.readlink("/proc/1/ns/pid")  # pid 1 of the namespace this /proc shows
    except OSError:
        return
    if ns != INIT_PID_NS:
        raise SessionError("runs in a PID namespace other than the host's: BPF reports host pids, which this /proc "
                           "does not show; run it in the host's (docker run --pid=host, Kubernetes hostPID: true)")


def _proc_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, Z, ...), None when there is no such process."""
    fields = stat_fields(pid) if pid > 0 else None
    return fields[0] if fields else None


def _alive(pid: int) -> bool:
    return _proc_state(pid) not in (None, "Z", "X")


def check_pid(pid: int) -> None:
    state = _proc_state(pid)
    if state is None:
        raise SessionError(f"no such process: {pid}")
    if state in ("Z", "X"):
        raise SessionError(f"process {pid} has already exited")


def check_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SessionError(f"cannot create output directory {out_dir}: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise SessionError(f"output directory not writable: {out_dir}")


class _Launcher:
    """Forks the command held at a gate so the sampler targets it before its first instruction."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        exe = shutil.which(argv[0])
        if exe is None:
            raise SessionError(f"command not found: {argv[0]}")
        gate_r, gate_w = os.pipe()
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # child: wait for the go byte, then exec
            try:
                os.close(gate_w)
                os.close(err_r)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                if os.read(gate_r, 1) != b"g":
                    os._exit(126)
                os.close(gate_r)
                os.execv(exe, argv) if env is None else os.execve(exe, argv, env)
            except OSError as e:
                os.write(err_w, str(e.strerror).encode())
            os._exit(127)
        os.close(gate_r)
        os.close(err_w)
        self.pid = pid
        self.exe = exe
        self._gate, self._err = gate_w, err_r
        self.exit_code: int | None = None

    def release(self) -> None:
        os.write(self._gate, b"g")
        os.close(self._gate)
        msg = os.read(self._err, 512)  # EOF once exec succeeded (close-on-exec)
        os.close(self._err)
        if msg:
            self.wait()
            raise SessionError(f"cannot run command: {msg.decode(errors='replace')}")

    def abort(self) -> None:
        try:
            os.close(self._gate)  # the child reads EOF and exits
        except OSError:
            pass
        self.wait()

    def poll(self) -> bool:
        """True once the command has exited."""
        if self.exit_code is not None:
            return True
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.exit_code = os.waitstatus_to_exitcode(status)
        return True

    def stop(self, signum: int, grace_s: float = 2.0) -> None:
        """Pass our interruption on to the command (a terminal's Ctrl-C reaches both anyway)."""
        if self.poll():
            return
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            if self.poll():
                return
            time.sleep(0.02)

    def wait(self) -> None:
        if self.exit_code is None:
            _, status = os.waitpid(self.pid, 0)
            self.exit_code = os.waitstatus_to_exitcode(status)


def _mono_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


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


class Session:
    """Runs one capture. `on_progress` is called about every POLL_S with live stats."""

    def __init__(self, config: SessionConfig, on_progress: Callable[[SessionStats], None] | None = None) -> None:
        if (config.pid is None) == (not config.command):
            raise SessionError("give either --pid PID or -- CMD ARGS")
        self.cfg = config
        self.on_progress = on_progress
        self.stats = SessionStats()
        self._stop_reason = ""
        self._pending: list[RawSample] = []
        self._procs: list[ProcEvent] = []
        self._snaps: dict[int, ProcessSnapshot] = {}
        self._known: dict[int, set[int]] = {}  # pid -> user addresses already inside its mappings
        self._remap_at: dict[int, float] = {}
        self._exec_seq: dict[int, int] = {}
        self._kaddrs: set[int] = set()
        self._ksyms: KernelSymbols | None = None
        self._ksyms_modules = b""
        self._build_ids = BuildIdCache()
        self.python = PythonPlugin()
        self._sampler: CpuSampler | None = None
        self.probes: ProbeManager | None = None
        self._writer: CaptureWriter | None = None
        self._events: list[RawEvent] = []  # kept for the end: which kernels were launched
        self._memory_fatbins: dict[str, bytes] = {}
        self._code_warnings: list[str] = []
        self._initial: list[int] = []  # the target and, with --pid, the descendants it already had
        self._env_ranked: set[int] = set()  # pids whose rank was read from their environment

    def _signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stop_reason = "interrupted" if signum == signal.SIGINT else "terminated"

    def run(self) -> SessionResult:
        cfg = self.cfg
        check_root()
        if cfg.pid is not None:
            check_pid(cfg.pid)
        check_out_dir(cfg.out_dir)
        self.gpu = GpuSamples(cfg.out_dir, cfg.gpu_samples, bool(cfg.command), cfg.cupti)
        launcher = _Launcher(cfg.command, self.gpu.child_env()) if cfg.command else None
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
        sampler_cfg = cfg.sampler
        # children are followed with --pid too: a launcher's (torchrun's) workers are the job
        sampler_cfg = SamplerConfig(**{**sampler_cfg.__dict__, "follow_children": True})
        if cfg.runtimes:
            sampler_cfg = SamplerConfig(**{**sampler_cfg.__dict__, "probes": True})
        sampler = CpuSampler(sampler_cfg, self._pending.append, self._procs.append, self._on_probe)
        root_pid = launcher.pid if launcher else cfg.pid
        assert root_pid is not None
        try:
            try:
                self._initial = [root_pid] if launcher else [root_pid, *_descendants(root_pid)]
                sampler.start(self._initial)
            except BaseException:
                if launcher:
                    launcher.abort()
                raise
            if cfg.runtimes:
                self.probes = ProbeManager(all_runtimes(), sampler, on_stop=self._on_target_stop)
                if launcher:
                    self.probes.consider(launcher.exe)  # static cudart in the program itself
            if not launcher and not _alive(root_pid):
                raise SessionError(f"process {root_pid} exited before the sampler attached")
            return self._capture(sampler, launcher, root_pid)
        finally:
            if self.probes:
                self.probes.finish()  # never leave a target stopped
            sampler.close()
            self.python.close()
            for s, h in old.items():
                signal.signal(s, h)

    def _capture(self, sampler: CpuSampler, launcher: _Launcher | None, root_pid: int) -> SessionResult:
        cfg = self.cfg
        path = cfg.out_dir / f"{cfg.prefix}.aiflame"
        header = CaptureHeader(
            FORMAT_VERSION, __version__, socket.gethostname(), platform.release(), platform.machine(),
            cfg.sampler.frequency, sampler.event_used, time.time_ns(), _mono_ns(), cfg.argv or sys.argv,
            " ".join(cfg.command) if cfg.command else f"pid {cfg.pid}",
            {"sampling": cfg.sampler.describe(sampler.event_used)},
        )
        writer = CaptureWriter(path, header)
        self._writer = writer
        self._sampler = sampler
        if launcher:
            launcher.release()
            time.sleep(0.05)  # let the dynamic loader map the program's libraries
        for pid in self._initial:
            self._snapshot(pid, writer)
        cpu0, t0 = _cpu_s(), time.monotonic()
        deadline = t0 + cfg.duration_s if cfg.duration_s else None
        while not self._stop_reason:
            tick = time.monotonic() + POLL_S
            # Library opens wake us at once (their process waits, stopped, for its probes).
            while not self._stop_reason and (left := tick - time.monotonic()) > 0:
                sampler.wait(left)
            self._drain(sampler, writer)
            now = time.monotonic()
            self.stats.elapsed_s = now - t0
            if self.on_progress:
                self.on_progress(self.stats)
            if deadline and now >= deadline:
                self._stop_reason = "duration"
            elif launcher and launcher.poll():
                self._stop_reason = f"command exited ({launcher.exit_code})"
            elif not launcher and not _alive(root_pid):
                self._stop_reason = "target exited"
        # Never leave a target stopped: with no process a target any more and the stopping probes detached (which
        # waits out any still running), every stop already sent is in the ring; the drain answers them and
        # finish() continues any still held.
        for pid in sampler.targets():
            sampler.remove_target(pid)
        if self.probes:
            sampler.stop_stopping()
        self._drain(sampler, writer)
        if self.probes:
            self.probes.finish()
            self._write_probe_output(writer)
            cubins, self._code_warnings = launched_cubins(self._events, self._memory_fatbins)
            for c in cubins:
                writer.add_gpu_code(c)
        agent_cpu = _cpu_s() - cpu0
        writer.add_kernel_symbols(self._kernel_symbols())
        self.stats.counters = sampler.counters()
        if self.probes:
            self.stats.counters["calls"] = self.probes.calls_seen
            self.stats.counters["returns_lost"] = self.probes.returns_lost
        gpu_counters, gpu_warnings = self.gpu.finish(writer, any(e.runtime == "cuda" for e in self._events),
                                                     bool(launcher and not launcher.poll()))
        self.stats.counters.update(gpu_counters)
        writer.close(CaptureFooter(
            time.time_ns(), _mono_ns(), 0, dict(self.stats.counters), self._stop_reason, agent_cpu,
        ))
        exit_code = None
        if launcher:
            if self._stop_reason in ("interrupted", "terminated"):
                launcher.stop(signal.SIGINT if self._stop_reason == "interrupted" else signal.SIGTERM)
            exit_code = launcher.exit_code
        warnings = list(self.python.warnings) + (self.probes.warnings if self.probes else []) + self._code_warnings
        warnings += gpu_warnings
        probed = self.probes.probed_files() if self.probes else []
        return SessionResult(path, self._stop_reason, self.stats, agent_cpu, exit_code, warnings, probed)

    def _on_target_stop(self, pid: int) -> None:
        """A target waits, stopped, at a library open or at exit: read its mappings now if they changed."""
        if self._writer is None:
            return
        snap = self._snaps.get(pid)
        if snap is None or not _maps_unchanged(pid, snap):
            self._snapshot(pid, self._writer)
        # The library being opened is mapped only after this stop: the first sample that runs in it must
        # re-read the maps at once, not REMAP_MIN_S later (the last library the loader opens, libc, would
        # otherwise stay unknown to the unwinder for the first half second of every command).
        self._remap_at[pid] = 0.0
        if pid not in self.python.procs:
            self._attach_python(pid, self._writer, force=True)  # before the calls it is about to make
        # Python code objects named so far must be read while the process lives (it may be about to exit).
        self._write_probe_output(self._writer)
        for code in self.python.codes([s for s in self._pending if s.pid == pid], _mono_ns()):
            self._writer.add_py_code(code)

    def _on_probe(self, rec: ProbeRecord) -> None:
        if self.probes:
            self.probes.on_record(rec)

    def _write_probe_output(self, writer: CaptureWriter) -> None:
        if not self.probes:
            return
        events, code = self.probes.take()
        # A probed call runs in a library mapped just before (its target was stopped at the open): a shorter
        # wait than for samples, and only the call and its caller need to be inside the mappings.
        self._refresh_mappings(((e.pid, e.user[:2]) for e in events), writer, REMAP_MIN_S / 5)
        for py_code in self.python.codes(events, _mono_ns()):
            writer.add_py_code(py_code)
        writer.add_events(events)
        self._events.extend(events)
        self.stats.events += len(events)
        for c in code:
            writer.add_gpu_code(c)
            if c.kind == "fatbin":
                self._memory_fatbins[c.digest] = c.data

    def _refresh_mappings(self, stacks: Iterable[tuple[int, Sequence[int]]], writer: CaptureWriter,
                          min_age_s: float) -> None:
        """Re-read the mappings of processes whose user addresses fall outside them (dlopen, late libraries),
        at most once per `min_age_s` each; a process without a snapshot gets one at once."""
        stale: set[int] = set()
        for pid, user in stacks:
            known = self._known.get(pid)
            if known is None:
                stale.add(pid)
                continue
            snap = self._snaps[pid]
            for a in user:
                if a not in known:
                    if snap.find(a) is None:
                        stale.add(pid)
                        break
                    known.add(a)
        now = time.monotonic()
        for pid in stale:
            if now - self._remap_at.get(pid, 0.0) >= min_age_s or pid not in self._snaps:
                self._snapshot(pid, writer)

    def _snapshot(self, pid: int, writer: CaptureWriter) -> None:
        snap = read_process(pid, _mono_ns(), self._build_ids, self._exec_seq.get(pid, 0))
        self._remap_at[pid] = time.monotonic()
        if snap is None or (not snap.mappings and pid in self._snaps):
            return  # gone (a zombie's maps are empty): keep what was read while it lived
        self._snaps[pid] = snap
        self._known[pid] = set()
        writer.add_process(snap)
        if self._sampler:
            self._sampler.set_mappings(pid, snap.mappings)
        if pid not in self._env_ranked and (env := rank_event(pid, _mono_ns())) is not None:
            self._env_ranked.add(pid)  # after exec: a fork still has its launcher's environment
            writer.add_events([env])
        self.stats.pids = len(self._snaps)
        self._attach_python(pid, writer)  # first: every sample until then lacks its Python frames
        if self.probes:
            self.probes.consider_process(pid, [m.path for m in snap.mappings])

    def _attach_python(self, pid: int, writer: CaptureWriter, force: bool = False) -> None:
        found = self.python.attach(pid, self._exec_seq.get(pid, 0), force) if self._sampler else None
        if found and self._sampler:
            target, info = found
            self._sampler.set_python(pid, proc_rec(target))
            writer.add_py_runtime(info)

    def _drain(self, sampler: CpuSampler, writer: CaptureWriter) -> None:
        sampler.poll()
        for ev in self._procs:
            if ev.kind == RecKind.FORK:
                if _is_thread(ev.child):
                    sampler.remove_target(ev.child)
                else:
                    self._snapshot(ev.child, writer)
            elif ev.kind == RecKind.EXEC:
                self._exec_seq[ev.pid] = self._exec_seq.get(ev.pid, 0) + 1
                sampler.clear_python(ev.pid)
                self.python.forget(ev.pid)
                if self.probes:
                    self.probes.forget(ev.pid)
                self._snapshot(ev.pid, writer)
            elif ev.kind == RecKind.EXIT and ev.pid != self.cfg.pid:
                sampler.remove_target(ev.pid)
        self._procs.clear()
        self._write_probe_output(writer)
        if not self._pending:
            writer.flush()
            return
        for s in self._pending:
            self._kaddrs.update(s.kern)
        self._refresh_mappings(((s.pid, s.user) for s in self._pending), writer, REMAP_MIN_S)
        self.stats.samples += len(self._pending)
        for pid in {s.pid for s in self._pending} - self.python.procs.keys():
            self._attach_python(pid, writer)
        for code in self.python.codes(self._pending, _mono_ns()):
            writer.add_py_code(code)
        writer.add_samples(self._pending)
        self._pending.clear()
        writer.flush()

    def _kernel_table(self) -> KernelSymbols | None:
        """The kernel's symbol table, read once and kept (reading /proc/kallsyms costs ~0.3 s of CPU, and a
        daemon names kernel addresses for every window); read again only when the modules change."""
        modules = _read_bytes("/proc/modules")
        if self._ksyms is None or modules != self._ksyms_modules:
            try:
                self._ksyms = KernelSymbols.load()
            except OSError:
                return None
            self._ksyms_modules = modules
        return self._ksyms

    def _kernel_symbols(self) -> dict[int, str]:
        """Names of the kernel addresses sampled so far."""
        ksyms = self._kernel_table() if self._kaddrs else None
        if ksyms is None:
            return {}
        out = {}
        for a in self._kaddrs:
            name = ksyms.lookup(a)
            if name:
                out[a] = name
        return out


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _maps_unchanged(pid: int, snap: ProcessSnapshot) -> bool:
    """True when every executable mapping of `pid` is already in `snap` (cheap: no build ids read)."""
    known = {(m.start, m.end) for m in snap.mappings}
    return all((lo, hi) in known for lo, hi, perms, *_ in read_maps(pid) or [] if "x" in perms)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` now (parents before children), from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        fields = stat_fields(int(d)) if d.isdigit() else None
        if fields and len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(d))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo.extend(children.get(c, []))
    return out


def _is_thread(tid: int) -> bool:
    """True when `tid` is a thread of another process (its Tgid differs)."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1]) != tid
    except (OSError, ValueError):
        pass
    return False
