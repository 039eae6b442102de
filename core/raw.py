"""Raw (unsymbolized) records as the collectors produce them and the capture file stores them.

Symbolization turns these into aiflame.core.model types. Addresses are runtime virtual addresses; stacks are
leaf first, as the kernel hands them over. This module imports nothing else from aiflame.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from collections.abc import Mapping as KeyValues
from dataclasses import dataclass, field
from typing import Protocol


class PyFlag(enum.IntFlag):
    """`py_flags` of a sample or event: how its Python walk went (PY_* in bpf/aiflame.h; a test keeps them
    equal). Defined here, not with the agent's record mirrors, because symbolization reads them too."""

    PRESENT = 1  # the process runs CPython with a verified layout
    TSTATE = 2  # the sampled thread has a Python thread state
    TRUNCATED = 4  # more frames than the walker reads (AIFLAME_MAX_PY_FRAMES)
    READ_ERR = 8  # the walk stopped on a failed read


@dataclass(frozen=True, slots=True)
class RawPyFrame:
    """A Python frame as the walker read it: code object address and instruction position."""

    code: int
    instr: int  # 3.10: f_lasti; 3.11+: instruction pointer minus code address, in bytes
    owner: int = 0
    is_entry: int = 0


class ThreadStack(Protocol):
    """A user stack taken in a thread at a time: what a CPU sample and a runtime event have in common, so that one
    piece of symbolization locates and names both (RawSample and RawEvent are each one)."""

    @property
    def pid(self) -> int: ...
    @property
    def tid(self) -> int: ...
    @property
    def time_ns(self) -> int: ...  # CLOCK_MONOTONIC: which mappings and code objects were in force
    @property
    def user(self) -> tuple[int, ...]: ...  # leaf first
    @property
    def user_err(self) -> int: ...  # negative errno when the user stack lookup failed
    @property
    def py(self) -> tuple[RawPyFrame, ...]: ...  # newest first
    @property
    def py_flags(self) -> int: ...  # PyFlag bits


@dataclass(slots=True)
class RawSample:
    time_ns: int  # CLOCK_MONOTONIC
    pid: int
    tid: int
    cpu: int
    comm: str
    user: tuple[int, ...]  # leaf first
    kern: tuple[int, ...]  # leaf first
    user_err: int = 0  # negative errno when the user stack lookup failed
    kern_err: int = 0
    weight: int = 1
    py: tuple[RawPyFrame, ...] = ()  # newest first
    py_flags: int = 0  # PyFlag bits
    unwind: int = 0  # how the user stack was walked: UW_STOP_* | UW_USED_FP (bpf/unwind.h); 0: frame pointers
    # Nonzero: not a CPU sample but an off-CPU one (`profile --off-cpu`): the thread blocked at this stack at
    # time_ns and stayed blocked this many ns (until its wakeup).
    off_cpu_ns: int = 0


@dataclass(frozen=True, slots=True)
class Mapping:
    start: int
    end: int
    file_offset: int
    path: str
    build_id: str = ""
    perms: str = "r-xp"

    def contains(self, addr: int) -> bool:
        return self.start <= addr < self.end


@dataclass(slots=True)
class ProcessSnapshot:
    """The mappings of a process as read at one time (a process can have several snapshots)."""

    pid: int
    time_ns: int
    mappings: list[Mapping]
    ppid: int = 0
    comm: str = ""
    cmdline: list[str] = field(default_factory=list)
    exe: str = ""
    exec_seq: int = 0

    def find(self, addr: int) -> Mapping | None:
        for m in self.mappings:
            if m.start <= addr < m.end:
                return m
        return None


@dataclass(frozen=True, slots=True)
class CodeInfo:
    """What a code object tells a profiler. `first_instr_offset`: offset of co_code_adaptive (3.11+), 0 on 3.10."""

    qualname: str
    filename: str
    firstlineno: int
    line_table: bytes
    version: tuple[int, int]
    first_instr_offset: int


@dataclass(frozen=True, slots=True)
class PyCode:
    """A Python code object read from a live process (at address `addr`, at `time_ns`), so exports work after
    the process exits."""

    pid: int
    addr: int
    time_ns: int
    info: CodeInfo


@dataclass(frozen=True, slots=True)
class PyRuntimeInfo:
    """A process found to run CPython: its version and the walker's layout source."""

    pid: int
    version: str
    layout_source: str
    binary: str


@dataclass(slots=True)
class RawEvent:
    """One runtime call seen by a uprobe (a launch, copy, sync, collective...), arguments already named.

    `kind` is an aiflame.core.model.EventKind value, or "meta" for calls that only inform others (registrations,
    communicator creation). `args` may hold "func" (a host address naming a kernel, symbolized at export),
    "rank" and "world_size" (the process's place in a job). Stacks are leaf first, like samples.
    """

    runtime: str
    call: str
    kind: str
    pid: int
    tid: int
    start_ns: int  # CLOCK_MONOTONIC
    end_ns: int = 0  # 0: no return probe, or the call had not returned when the capture ended
    user: tuple[int, ...] = ()
    user_err: int = 0
    py: tuple[RawPyFrame, ...] = ()
    py_flags: int = 0
    args: dict[str, int] = field(default_factory=dict)
    strs: dict[str, str] = field(default_factory=dict)

    @property
    def time_ns(self) -> int:
        """When its stack was taken (a ThreadStack's time): at the call."""
        return self.start_ns


@dataclass(frozen=True, slots=True)
class GpuCode:
    """An accelerator code object (cubin, PTX, zebin) kept by content digest, so exports work offline.

    `data` is empty when the same digest was stored earlier in the capture; `origin` says where it was found
    (a host binary's path, or "memory of pid N")."""

    digest: str
    kind: str  # "cubin", "ptx", "zebin", "fatbin"
    arch: int
    origin: str
    data: bytes


@dataclass(frozen=True, slots=True)
class RawStream:
    """A vendor's stall stream as its sampler wrote it: stored whole by the agent, read and converted into
    RawStallSample and GpuCode records on the road (symbolize/vendor/cupti_stream.py for "cupti"), so the
    format has one reader."""

    format: str  # "cupti"
    name: str  # the file it was read from (unique in a capture)
    data: bytes


@dataclass(frozen=True, slots=True)
class RawStallSample:
    """Stall samples an accelerator's sampler reported at one instruction of one kernel."""

    source: str  # "cupti", "xe", "rocprof"
    pid: int  # host process whose kernel it was (0: unknown, e.g. a device-wide stream not yet mapped)
    device: int  # device ordinal, -1 unknown
    code: str  # digest of the kernel's code object as stored in the capture's GpuCode records; "" unknown
    kernel: str  # function name as the vendor reports it (mangled), "" when only code+offset/ip is known
    offset: int  # byte offset of the instruction inside the kernel function; for Xe before mapping: the raw IP
    reason: str  # stall reason name in the vendor's vocabulary, e.g. "smsp__pcsamp_warps_issue_stalled_long_scoreboard"
    count: int  # samples
    correlation_id: int = 0  # the vendor's launch correlation id, 0 when none
    time_ns: int = 0  # CLOCK_MONOTONIC of the sample or its batch, 0 unknown
    # In these samples the warp's scheduler issued no instruction at all (CUPTI's `<reason>_not_issued`, a subset
    # of `<reason>`'s samples): a property of samples counted once under `reason`, never extra weight.
    not_issued: bool = False


@dataclass(slots=True)
class CaptureHeader:
    format_version: int
    aiflame_version: str = ""
    host: str = ""
    kernel: str = ""
    machine: str = ""
    frequency_hz: int = 0
    event: str = ""
    start_wall_ns: int = 0
    start_mono_ns: int = 0
    argv: list[str] = field(default_factory=list)
    target: str = ""
    meta: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class CaptureFooter:
    end_wall_ns: int = 0
    end_mono_ns: int = 0
    samples: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    stop_reason: str = ""
    agent_cpu_s: float = 0.0


@dataclass(slots=True)
class Capture:
    """Everything one capture file holds."""

    header: CaptureHeader
    samples: list[RawSample] = field(default_factory=list)
    processes: list[ProcessSnapshot] = field(default_factory=list)
    kernel_symbols: dict[int, str] = field(default_factory=dict)
    py_codes: list[PyCode] = field(default_factory=list)
    py_runtimes: list[PyRuntimeInfo] = field(default_factory=list)
    events: list[RawEvent] = field(default_factory=list)
    gpu_code: list[GpuCode] = field(default_factory=list)
    stalls: list[RawStallSample] = field(default_factory=list)
    footer: CaptureFooter | None = None
    streams: list[RawStream] = field(default_factory=list)  # not yet converted into `stalls` and `gpu_code`

    def converted(self, stalls: Iterable[RawStallSample], code: Iterable[GpuCode], counters: KeyValues[str, int],
                  left: Iterable[RawStream] = ()) -> Capture:
        """This capture with its streams replaced by what was read from them: their stall samples, their code
        objects (each digest once) and their counters (added to the footer's; a capture read as cut short has
        no footer to add them to); `left`: the streams that could not be converted, kept as they are."""
        have = {c.digest for c in self.gpu_code}
        new = []
        for c in code:
            if c.digest not in have:
                have.add(c.digest)
                new.append(c)
        footer = self.footer
        if footer is not None and counters:
            merged = dict(footer.counters)
            for k, v in counters.items():
                merged[k] = merged.get(k, 0) + v
            footer = dataclasses.replace(footer, counters=merged)
        return dataclasses.replace(self, gpu_code=[*self.gpu_code, *new], stalls=[*self.stalls, *stalls],
                                   footer=footer, streams=list(left))
