"""The capture pipeline that `aiflame profile` (agent.session) and the daemon (agent.daemon.collector) both run:
a sampler's records drained into a capture file, resolving on the way whatever dies with a process: its
mappings (agent.process_table), Python code objects (agent.python), runtime calls and the GPU code they load
(agent.runtimes), its rank from its environment, and the names of the kernel addresses sampled."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from aiflame.agent.gpu_code import LaunchLog
from aiflame.agent.kernel.records import RecKind
from aiflame.agent.kernel.sampler import CpuSampler, ProbeRecord, ProcEvent, SamplerConfig
from aiflame.agent.process_table import ProcessTable
from aiflame.agent.procs import is_thread
from aiflame.agent.python.runtime import PythonPlugin, proc_rec
from aiflame.agent.rank_env import rank_event
from aiflame.agent.runtimes import all_runtimes
from aiflame.agent.runtimes.manager import ProbeManager
from aiflame.core.capture import CaptureWriter
from aiflame.core.model import EventKind
from aiflame.core.raw import PyRuntimeInfo, RawEvent, RawSample
from aiflame.symbolize.objfmt.kallsyms import KernelSymbols

FIRST_COLLECTIVE = -1  # samples_from_ns: wait for the first collective call
REMAP_MIN_S = 0.5  # re-read a process's maps at most this often when addresses fall outside them


def mono_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def named_codes(items: Iterable[RawSample | RawEvent]) -> list[tuple[int, int]]:
    """The (pid, code address) of every Python frame of `items`, in order, each once: what the Python plug-in
    resolves (it never needs the samples themselves)."""
    return list(dict.fromkeys((s.pid, f.code) for s in items for f in s.py))


@dataclass
class SessionStats:
    """What a capture has collected so far."""

    samples: int = 0  # CPU samples
    blocks: int = 0  # off-CPU samples (--off-cpu): a thread blocked, at a stack, for a time
    events: int = 0
    elapsed_s: float = 0.0
    pids: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return self.counters.get("lost", 0)


class KernelNames:
    """Names for the kernel addresses a capture file's samples hold. The kernel's symbol table is read once and
    kept (reading /proc/kallsyms costs ~0.3 s of CPU, and a daemon names kernel addresses for every window); it
    is read again only when the modules change."""

    def __init__(self) -> None:
        self.addrs: set[int] = set()  # sampled in the current file
        self._table: KernelSymbols | None = None
        self._modules = b""

    def table(self) -> KernelSymbols | None:
        modules = _read_bytes("/proc/modules")
        if self._table is None or modules != self._modules:
            try:
                self._table = KernelSymbols.load()
            except OSError:
                return None
            self._modules = modules
        return self._table

    def names(self) -> dict[int, str]:
        """Names of the addresses sampled so far."""
        table = self.table() if self.addrs else None
        if table is None:
            return {}
        out = {}
        for a in self.addrs:
            name = table.lookup(a)
            if name:
                out[a] = name
        return out


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


class CapturePipeline:
    """A sampler and everything that turns its records into a capture file.

    Use: `start(config, pids)`, `open_file(writer)`, `drain()` as often as records may wait (it returns the
    pids whose exit it saw), `write_gpu_code()` and `write_kernel_names()` before the file's footer,
    `release_targets()` and a last drain before `close()`.

    `keep_target`: a pid that stays a target after its exit record (`aiflame profile --pid`'s own target).
    `bounded`: keep only what a capture that never ends may keep (see LaunchLog).
    """

    def __init__(self, runtimes: bool, keep_target: int | None = None, bounded: bool = False) -> None:
        self.runtimes = runtimes
        self.keep_target = keep_target
        self.stats = SessionStats()
        self.processes = ProcessTable()
        self.python = PythonPlugin()
        self.kernel = KernelNames()
        self.launches = LaunchLog(bounded)
        self.memory_fatbins: dict[str, bytes] = {}  # fatbins copied from target memory, by digest
        self.sampler: CpuSampler | None = None
        self.probes: ProbeManager | None = None
        self.writer: CaptureWriter | None = None
        self._samples: list[RawSample] = []  # drained from the ring, not yet written
        # CPU samples before this CLOCK_MONOTONIC time are left out (--delay); FIRST_COLLECTIVE: until a target
        # makes its first collective call (training has started), then from its start
        self.samples_from_ns = 0
        self.before_delay = 0  # samples left out so far
        self._procs: list[ProcEvent] = []
        self._env_ranked: set[int] = set()  # pids whose rank was read from their environment
        self._loader_stops: set[int] = set()  # pids whose image has stopped in the loader (Loader probe)

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self, config: SamplerConfig, pids: list[int],
              on_compile: Callable[[str], None] | None = None) -> CpuSampler:
        """Compile (or load from the compile cache) and attach the BPF program with `pids` as its first targets,
        children followed (a launcher's, torchrun's, workers are the job); the runtime probes with it when
        `runtimes`. `on_compile` is told (one line) when the program is compiled."""
        cfg = replace(config, follow_children=True, probes=config.probes or self.runtimes)
        self.sampler = CpuSampler(cfg, self._samples.append, self._procs.append, self._on_probe)
        self.sampler.start(pids, on_compile)
        if self.runtimes:
            self.probes = self.new_probes()
        return self.sampler

    def new_probes(self) -> ProbeManager:
        assert self.sampler is not None
        return ProbeManager(all_runtimes(), self.sampler, on_stop=self._on_target_stop)

    def open_file(self, writer: CaptureWriter) -> None:
        """Write into `writer` from now on; the live processes' mappings and Python runtimes go in first, so that
        the file stands alone."""
        self.writer = writer
        self.kernel.addrs = set()
        for snap in self.processes.snaps.values():
            writer.add_process(snap)
        for pid, proc in self.python.procs.items():
            t = proc.target
            writer.add_py_runtime(PyRuntimeInfo(pid, ".".join(map(str, t.version)), t.layout.source, t.binary))
            proc.written.clear()  # code objects are re-read for this file as its samples name them
        self.processes.restart_known()

    def release_targets(self) -> None:
        """Never leave a target stopped: no process is a target any more (no new stops) and the stopping probes
        and library-open tracepoint are gone (their programs have finished). Every stop already sent is then in
        the ring, where the next drain answers it, and `close()` continues any still held."""
        assert self.sampler is not None
        for pid in self.sampler.targets():
            self.sampler.remove_target(pid)
        if self.probes:
            self.sampler.stop_stopping()

    def close(self) -> None:
        if self.probes:
            self.probes.finish()  # never leave a target stopped
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        self.python.close()

    # --- records --------------------------------------------------------------------------------------------

    def drain(self) -> list[int]:
        """Everything in the ring buffer into the capture file; returns the pids whose exit it saw."""
        sampler, writer = self.sampler, self.writer
        assert sampler is not None and writer is not None
        sampler.poll()
        sampler.catch_up_tables()  # tables built in the background, or walks stopped at since they were evicted
        exited = []
        for ev in self._procs:
            if ev.kind == RecKind.FORK:
                if is_thread(ev.child):
                    sampler.remove_target(ev.child)
                else:
                    self.snapshot(ev.child)
            elif ev.kind == RecKind.EXEC:
                self.processes.exec_seen(ev.pid)
                self._loader_stops.discard(ev.pid)  # a new image, maybe with a loader we do not probe
                sampler.clear_python(ev.pid)
                self.python.forget(ev.pid)
                if self.probes:
                    self.probes.forget(ev.pid)
                self.snapshot(ev.pid)
            elif ev.kind == RecKind.EXIT:
                exited.append(ev.pid)
                if ev.pid != self.keep_target:
                    sampler.remove_target(ev.pid)
        self._procs.clear()
        self.write_probe_output()
        if not self._samples:
            writer.flush()
            return exited
        for s in self._samples:
            self.kernel.addrs.update(s.kern)
        self._refresh_mappings(((s.pid, s.user) for s in self._samples), REMAP_MIN_S)
        for pid in {s.pid for s in self._samples} - self.python.procs.keys():
            self._attach_python(pid)
        if self.samples_from_ns:  # --delay: the walker is attached meanwhile, the samples are left out
            kept = [] if self.samples_from_ns == FIRST_COLLECTIVE else \
                [s for s in self._samples if s.time_ns >= self.samples_from_ns]
            self.before_delay += len(self._samples) - len(kept)
            self._samples[:] = kept
        blocked = sum(1 for s in self._samples if s.off_cpu_ns)
        self.stats.samples += len(self._samples) - blocked
        self.stats.blocks += blocked
        for code in self.python.codes(named_codes(self._samples), mono_ns()):
            writer.add_py_code(code)
        writer.add_samples(self._samples)
        self._samples.clear()
        writer.flush()
        return exited

    def finish_off_cpu(self, end_ns: int) -> None:
        """Threads still blocked when the capture ends (`end_ns`, before the targets were released) go into the
        file as blocked until then. After the last drain."""
        if self.sampler is not None and self.sampler.config.off_cpu:
            self.sampler.finish_off_cpu(end_ns)
            self.drain()

    def write_probe_output(self) -> None:
        """The runtime calls decoded so far, and the GPU code they loaded, into the file."""
        writer = self.writer
        if not self.probes or writer is None:
            return
        events, code = self.probes.take()
        # A probed call runs in a library mapped just before (its target was stopped at the open): a shorter
        # wait than for samples, and only the call and its caller need to be inside the mappings.
        self._refresh_mappings(((e.pid, e.user[:2]) for e in events), REMAP_MIN_S / 5)
        for py_code in self.python.codes(named_codes(events), mono_ns()):
            writer.add_py_code(py_code)
        if self.samples_from_ns == FIRST_COLLECTIVE:
            starts = [e.start_ns for e in events if e.kind == EventKind.COLLECTIVE.value]
            if starts:
                self.samples_from_ns = min(starts)
        writer.add_events(events)
        self.launches.add(events)
        self.stats.events += len(events)
        for c in code:
            writer.add_gpu_code(c)
            if c.kind == "fatbin":
                self.memory_fatbins[c.digest] = c.data

    def write_gpu_code(self) -> list[str]:
        """The pending runtime calls, then the cubins that define the kernels launched, into the file; returns
        one line per fatbin that could not be read."""
        if not self.probes:
            return []
        assert self.writer is not None
        self.write_probe_output()
        cubins, warnings = self.launches.cubins(self.memory_fatbins)
        for c in cubins:
            self.writer.add_gpu_code(c)
        return warnings

    def write_kernel_names(self) -> None:
        assert self.writer is not None
        self.writer.add_kernel_symbols(self.kernel.names())

    # --- processes ------------------------------------------------------------------------------------------

    def snapshot(self, pid: int, stopped: bool = False) -> None:
        """Read `pid`'s mappings into the file, with its rank and Python runtime when it has them, and let the
        runtime probes look at its libraries. `stopped`: the target is held stopped until this returns."""
        writer = self.writer
        assert writer is not None
        # The Python walker first: samples are taken from the moment a pid is a target, and reading the maps
        # with their build ids can take a while (every library of a torch process); until then they lack
        # their Python frames.
        self._attach_python(pid)
        snap = self.processes.read(pid, mono_ns())
        if snap is None:
            return
        writer.add_process(snap)
        if pid not in self._env_ranked and (env := rank_event(pid, mono_ns())) is not None:
            self._env_ranked.add(pid)  # after exec: a fork still has its launcher's environment
            writer.add_events([env])
        self.stats.pids = len(self.processes.snaps)
        if self.sampler:  # the CFI tables (a file seen first is built: up to ~0.5 s for libtorch, in the background
            # when the target is held for it)
            self.sampler.set_mappings(pid, snap.mappings, stopped)
        if self.probes:
            self.probes.consider_process(pid, [m.path for m in snap.mappings])

    def forget(self, pid: int) -> None:
        """Everything kept about a process that is gone (BPF map entries, fds, per-pid tables)."""
        if self.sampler is not None:
            self.sampler.clear_python(pid)
        self.python.forget(pid)
        if self.probes:
            self.probes.forget(pid)
            self.probes.drop_open_calls(pid)
        self.processes.forget(pid)
        self.launches.forget(pid)
        self._env_ranked.discard(pid)
        self._loader_stops.discard(pid)
        self.stats.pids = len(self.processes.snaps)

    def _refresh_mappings(self, stacks: Iterable[tuple[int, Sequence[int]]], min_age_s: float) -> None:
        for pid in self.processes.stale(stacks, min_age_s):
            self.snapshot(pid)

    def _attach_python(self, pid: int, force: bool = False) -> None:
        found = self.python.attach(pid, self.processes.exec_seq(pid), force) if self.sampler else None
        if found and self.sampler:
            assert self.writer is not None
            target, info = found
            self.sampler.set_python(pid, proc_rec(target))
            self.writer.add_py_runtime(info)

    def _on_target_stop(self, pid: int, why: str) -> None:
        """A target waits, stopped, at a library open, in the loader once it has mapped what it opened, or in
        exit(): read its mappings now if they changed. At an open, only until the loader's stop has come once:
        from then on that stop reads them, once per dlopen instead of once per library."""
        writer = self.writer
        if writer is None:
            return
        if why == "loader":
            self._loader_stops.add(pid)
        if (why != "open" or pid not in self._loader_stops) and not self.processes.unchanged(pid):
            self.snapshot(pid, stopped=True)
        # The library being opened is mapped only after this stop: the first sample that runs in it must read
        # the maps again at once (the last library the loader opens, libc, would otherwise stay unknown to the
        # CFI unwinder for the first half second of every command).
        self.processes.read_soon(pid)
        if pid not in self.python.procs:
            self._attach_python(pid, force=True)  # before the calls it is about to make
        if why != "process":
            return  # the rest can wait for the drain, the target running
        # Python code objects named so far must be read while the process lives.
        self.write_probe_output()
        for code in self.python.codes(named_codes(s for s in self._samples if s.pid == pid), mono_ns()):
            writer.add_py_code(code)

    def _on_probe(self, rec: ProbeRecord) -> None:
        if self.probes:
            self.probes.on_record(rec)
