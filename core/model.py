"""The one data model every collector produces and every exporter consumes.

Stacks are tuples of frames ordered root -> leaf. Samples carry a weight in the profile's unit.
Timed events (kernel launches, collectives, copies, syncs) share the same frames for their stacks.
This module imports nothing else from aiflame.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


class FrameKind(enum.IntEnum):
    """What a frame stands for; decides colour and folded annotation."""

    UNKNOWN = 0
    KERNEL = 1
    NATIVE = 2  # C or other native code
    NATIVE_CPP = 3  # demangled C++ symbol
    PYTHON = 4
    ACCEL_SOURCE = 5  # accelerator kernel / source line
    ACCEL_INSTR = 6  # accelerator instruction / offset
    STALL = 7  # accelerator stall reason
    SEPARATOR = 8  # the '-' frame between layers
    PROCESS = 9  # synthetic root frames: process / thread names
    OFF_CPU = 10  # the leaf of an off-CPU stack: the thread was blocked here ("[off-cpu: cuda sync]")


@dataclass(frozen=True, slots=True)
class Frame:
    """One stack frame. `module` is the binary (or interpreter file) it came from."""

    name: str
    kind: FrameKind = FrameKind.NATIVE
    module: str = ""
    file: str = ""
    line: int = 0

    @property
    def is_unknown(self) -> bool:
        return self.kind == FrameKind.UNKNOWN


Stack = tuple[Frame, ...]
SEPARATOR = Frame("-", FrameKind.SEPARATOR)


@dataclass(slots=True)
class Sample:
    """A weighted stack observed in one thread at one time (time_ns 0 = aggregated)."""

    stack: Stack
    weight: int = 1
    pid: int = 0
    tid: int = 0
    comm: str = ""
    cpu: int = -1
    time_ns: int = 0


class EventKind(enum.Enum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    COPY = "copy"
    SYNC = "sync"
    OTHER = "other"


@dataclass(slots=True)
class TraceEvent:
    """A timed operation; later collectors fill these (launches, collectives, copies, syncs)."""

    name: str
    kind: EventKind
    start_ns: int
    duration_ns: int = 0
    pid: int = 0
    tid: int = 0
    rank: int = -1
    device: int = -1
    stack: Stack = ()
    args: dict[str, int | float | str] = field(default_factory=dict)
    event_id: int = 0
    deps: tuple[int, ...] = ()

    @property
    def calls(self) -> int:
        """The calls this event stands for: 1, or more for a launch recorded for the launches of its kernel that
        the probes only counted (past their record budget: args["calls"])."""
        n = self.args.get("calls", 1)
        return n if isinstance(n, int) and n > 1 else 1


@dataclass(slots=True)
class Profile:
    """Samples and events of one capture, plus its metadata and loss counters.

    `off_cpu` holds where threads blocked (`profile --off-cpu`), apart from the samples: each weighs the ns its
    thread stayed blocked and its stack ends in an OFF_CPU frame. Views that show them put them in `samples`
    (symbolize/offcpu.py)."""

    samples: list[Sample] = field(default_factory=list)
    events: list[TraceEvent] = field(default_factory=list)
    unit: str = "samples"
    meta: dict[str, str] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    start_ns: int = 0
    end_ns: int = 0
    off_cpu: list[Sample] = field(default_factory=list)

    @property
    def total_weight(self) -> int:
        return sum(s.weight for s in self.samples)

    def aggregate(self) -> Counter[Stack]:
        """Total weight per distinct stack."""
        out: Counter[Stack] = Counter()
        for s in self.samples:
            out[s.stack] += s.weight
        return out

    def self_weights(self) -> Counter[Frame]:
        """Weight of each leaf frame (time spent in the function itself)."""
        out: Counter[Frame] = Counter()
        for s in self.samples:
            if s.stack:
                out[s.stack[-1]] += s.weight
        return out

    def inclusive_weights(self) -> Counter[str]:
        """Weight of samples whose stack contains a function name at least once."""
        out: Counter[str] = Counter()
        for s in self.samples:
            for name in {f.name for f in s.stack}:
                out[name] += s.weight
        return out


def iter_stacks(samples: Iterable[Sample]) -> Iterator[tuple[Stack, int]]:
    """Stacks with weights, merged and in a stable (sorted by names) order."""
    agg: Counter[Stack] = Counter()
    for s in samples:
        agg[s.stack] += s.weight
    for stack in sorted(agg, key=lambda st: tuple(f.name for f in st)):
        yield stack, agg[stack]
