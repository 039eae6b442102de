"""NVIDIA stall sampling for targets that aiflame starts: prepare the child's environment so CUDA loads
aiflame's CUPTI injection library, then store each process's stream from its private directory in the capture as
it is (core.raw.RawStream). The stream is read and converted into stall samples and cubins on the road, by
symbolize/vendor/cupti_stream.py (the format's one reader and converter, which `aiflame import` uses too): the
agent never parses what a target wrote.

CUPTI works only inside the target and only from its CUDA initialization on, so a `--pid` target cannot be
sampled this way; `pid_target_warning` says so when such a target used CUDA.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aiflame.agent.accel.cupti_build import CuptiInstall, build_injection, find_cupti
from aiflame.agent.accel.xe_stream import XeEuStall, find_xe_devices, start_all
from aiflame.core.errors import HostError, Refused, Unreadable
from aiflame.core.raw import RawStallSample, RawStream
from aiflame.core.safe_files import OutputDir, read_regular
from aiflame.symbolize.vendor.cupti_stream import MAGIC as STREAM_MAGIC

__all__ = ["CuptiCollector", "CuptiOptions", "CuptiResult", "GpuSamples", "pid_target_warning", "prepare_cupti"]

STREAM_PREFIX = ".cupti-"  # + random: one private stream directory per capture, in its output directory
# What the injection library names a stream: cupti-PID.stream, or cupti-PID.N.stream when that one exists.
STREAM_NAME = re.compile(r"cupti-[0-9]{1,10}(\.[0-9]{1,10})?\.stream", re.ASCII)
NO_CUPTI = ("NVIDIA stall samples need NVIDIA's CUPTI: `pip install nvidia-cuda-cupti` into aiflame's "
            "environment (the CUDA program ran unsampled)")


@dataclass(frozen=True)
class CuptiOptions:
    """What the injection library is told (the CLI's --gpu-sample-period/--gpu-hw-buffer map here).

    Defaults are cautious: one sample per SM every 2^20 cycles (about 1,600 per SM per second at 1.7 GHz),
    64 MiB of device memory for CUPTI's hardware buffer (CUPTI's own default is 512 MiB), a 1 GiB stream cap.
    """

    period_log2: int = 20  # 5..31
    hw_buffer_bytes: int = 64 << 20
    scratch_bytes: int = 0  # 0: CUPTI's default (1 MiB)
    pcs_per_fetch: int = 4096
    drain_ms: int = 100
    flush_ms: int = 1000  # drains summed in the target and written once a second (0: each drain as it is)
    max_stream_bytes: int = 1 << 30

    def env(self) -> dict[str, str]:
        return {
            "AIFLAME_CUPTI_PERIOD": str(self.period_log2),
            "AIFLAME_CUPTI_HW_BUFFER": str(self.hw_buffer_bytes),
            "AIFLAME_CUPTI_SCRATCH": str(self.scratch_bytes),
            "AIFLAME_CUPTI_PCS": str(self.pcs_per_fetch),
            "AIFLAME_CUPTI_DRAIN_MS": str(self.drain_ms),
            "AIFLAME_CUPTI_FLUSH_MS": str(self.flush_ms),
            "AIFLAME_CUPTI_MAX_BYTES": str(self.max_stream_bytes),
        }


class StallWriter(Protocol):
    def add_stalls(self, samples: Iterable[RawStallSample]) -> None: ...

    def add_stream(self, st: RawStream) -> None: ...


@dataclass
class CuptiResult:
    """Streams stored (one per process that initialized CUDA), counters (footer), one-line warnings."""

    processes: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class StreamDir:
    """The directory the targets write their streams into: a fresh random name under the output directory,
    mode 1733 (targets that drop privileges still create their file; nobody else can list it or touch another's
    file). It is held by descriptor, so renaming it or swapping a symlink in does not redirect what we read or
    remove; each stream is read only as a regular file, up to the size the writer may reach."""

    def __init__(self, out_dir: Path) -> None:
        self.parent = OutputDir(out_dir)
        try:
            for _ in range(16):
                self.name = STREAM_PREFIX + secrets.token_hex(6)
                try:
                    os.mkdir(self.name, 0o700, dir_fd=self.parent.fd)
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError(f"{out_dir}: no free name for a stream directory")
            self.fd = os.open(self.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=self.parent.fd)
            os.fchmod(self.fd, 0o1733)
        except BaseException:
            self.parent.close()
            raise
        self.path = out_dir / self.name

    def streams(self) -> list[str]:
        return sorted(n for n in os.listdir(self.fd) if n.startswith("cupti-") and n.endswith(".stream"))

    def read(self, name: str, limit: int) -> bytes:
        return read_regular(name, limit, follow=False, dir_fd=self.fd)

    def remove(self) -> None:
        shutil.rmtree(self.name, ignore_errors=True, dir_fd=self.parent.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.parent.close()


class CuptiCollector:
    """One capture's NVIDIA stall sampling: `child_env` for the command, `collect` at the end."""

    def __init__(self, install: CuptiInstall, library: Path, streams: StreamDir, options: CuptiOptions) -> None:
        self.install = install
        self.library = library
        self.streams = streams
        self.stream_dir = streams.path
        self.options = options

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` plus what makes CUDA load the sampler: CUDA_INJECTION64_PATH for the driver, and LD_PRELOAD
        so a process whose CUDA never reaches a driver still reports why."""
        env = dict(base)
        lib = str(self.library)
        env["CUDA_INJECTION64_PATH"] = lib
        preload = [p for p in env.get("LD_PRELOAD", "").split() if p]
        env["LD_PRELOAD"] = " ".join([*preload, lib]) if lib not in preload else " ".join(preload)
        env["AIFLAME_CUPTI_DIR"] = str(self.stream_dir)
        env["AIFLAME_CUPTI_LIB"] = str(self.install.library)
        env.update(self.options.env())
        return env

    def collect(self, writer: StallWriter, keep_streams: bool = False) -> CuptiResult:
        """Store every process's stream in the capture through `writer`, as it is (the road reads and converts
        it: symbolize/vendor/cupti_stream.py `stream_stalls`), and remove the streams (unless `keep_streams`, or
        one could not be read)."""
        res = CuptiResult()
        unreadable = False
        # The writer stops at max_stream_bytes; its header and last record may pass that a little.
        limit = self.options.max_stream_bytes + (1 << 20)
        for name in self.streams.streams():
            why = None if STREAM_NAME.fullmatch(name) else "not the name of a stream"
            data = b""
            if why is None:
                try:
                    data = self.streams.read(name, limit)
                except (OSError, Unreadable) as e:
                    why = e.strerror if isinstance(e, OSError) else str(e)
            if why is None and not data.startswith(STREAM_MAGIC):
                why = "not an aiflame CUPTI stream (bad magic)"
            if why is not None:  # left where it is; the name is the target's: shown escaped
                res.warnings.append(f"{ascii(str(self.stream_dir / name))}: {why}")
                res.counters["cupti_streams_unreadable"] = res.counters.get("cupti_streams_unreadable", 0) + 1
                unreadable = True
                continue
            writer.add_stream(RawStream("cupti", name, data))
            res.processes += 1
        if not keep_streams and not unreadable:
            self.streams.remove()
        self.streams.close()
        return res


def prepare_cupti(out_dir: Path, options: CuptiOptions, cache_dir: Path | None = None
                  ) -> tuple[CuptiCollector | None, str | None]:
    """A collector ready for a `-- CMD` target, or None with the one-line reason (None, None: not installed,
    which is only worth a word if the target turns out to use CUDA; see `NO_CUPTI`)."""
    install = find_cupti()
    if install is None:
        return None, None
    try:
        lib = build_injection(install, cache_dir)
    except HostError as e:
        return None, f"NVIDIA stall sampling off: {e}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        streams = StreamDir(out_dir)
    except (OSError, Refused) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        return None, f"NVIDIA stall sampling off: cannot create its stream directory in {out_dir}: {why}"
    return CuptiCollector(install, lib, streams, options), None


def pid_target_warning() -> str:
    return ("NVIDIA stall samples need the target started by aiflame (`aiflame profile -- CMD`): CUPTI runs only "
            "inside a process from its CUDA initialization on")


class GpuSamples:
    """A session's GPU stall sampling (NVIDIA CUPTI, Intel EU stall), start to end, in three calls: `child_env`
    for the command it starts, `finish` once the capture ends (samples, counters, one-line warnings)."""

    def __init__(self, out_dir: Path, enabled: bool, starts_target: bool, options: CuptiOptions) -> None:
        self.enabled = enabled
        self.starts_target = starts_target
        self.collector: CuptiCollector | None = None
        self.warning: str | None = None
        if enabled and starts_target:
            self.collector, self.warning = prepare_cupti(out_dir, options)
        # Intel GPUs are sampled device-wide by the agent, for --pid targets too; silent on hosts without one.
        self.xe: list[XeEuStall] = []
        self.xe_problems: list[str] = []
        if enabled and find_xe_devices():
            self.xe, self.xe_problems = start_all()

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str] | None:
        """The command's environment, or None to leave it as the agent's."""
        if self.collector is None:
            return None
        return self.collector.child_env(os.environ if base is None else base)

    def finish(self, writer: StallWriter, used_cuda: bool, target_running: bool) -> tuple[dict[str, int], list[str]]:
        """Store what the streams hold. `used_cuda`: the probes saw CUDA calls (decides which hint to give
        when nothing could be sampled); `target_running`: keep the streams, the command may still write."""
        if not self.enabled:
            return {}, []
        xe_counters, xe_warnings = self._finish_xe(writer)
        counters, warnings = self._finish_cupti(writer, used_cuda, target_running)
        for k, v in xe_counters.items():
            counters[k] = counters.get(k, 0) + v
        return counters, warnings + xe_warnings

    def _finish_xe(self, writer: StallWriter) -> tuple[dict[str, int], list[str]]:
        counters: Counter[str] = Counter()
        warnings = list(self.xe_problems)
        for stream in self.xe:
            writer.add_stalls(stream.stop())
            counters.update(stream.counters)
            warnings += stream.warnings
        if counters.get("xe_hw_drops"):
            warnings.append(f"Intel EU stall sampling: the hardware dropped data {counters['xe_hw_drops']} times "
                            "(its buffer was full)")
        return dict(counters), warnings

    def _finish_cupti(self, writer: StallWriter, used_cuda: bool, target_running: bool
                      ) -> tuple[dict[str, int], list[str]]:
        if self.collector is None:
            if not used_cuda:
                return {}, []
            if not self.starts_target:
                return {}, [pid_target_warning()]
            return {}, [self.warning or NO_CUPTI]
        res = self.collector.collect(writer, keep_streams=target_running)
        counters = dict(res.counters)
        counters["cupti_processes"] = res.processes
        return counters, res.warnings
