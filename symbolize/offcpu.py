"""Off-CPU time (`profile --off-cpu`): what a blocked thread's stack waited on, and the views that weigh stacks
by time: `offcpu` (blocked time alone) and `wall` (CPU samples weighted by the sampling period, and blocked time,
in one flame graph of nanoseconds).

An off-CPU stack ends in one marker frame naming what it waited for: `[off-cpu: cuda sync]` when the blocking
call is a CUDA synchronization, `[off-cpu: nccl]` inside NCCL, else `[off-cpu]`. Where both appear, the rootward
one (the call the program made) names it: a NCCL call waiting on a CUDA stream is `nccl`."""

from __future__ import annotations

import re
from collections.abc import Sequence

from aiflame.core.errors import NothingToShow, Unreadable
from aiflame.core.model import Frame, FrameKind, Profile, Sample, Stack

__all__ = ["CUDA_SYNC", "NCCL", "OFF_CPU", "OFF_CPU_UNIT", "off_cpu_marker", "offcpu_profile", "sample_period_ns",
           "wall_profile", "with_marker"]

OFF_CPU = Frame("[off-cpu]", FrameKind.OFF_CPU)
CUDA_SYNC = Frame("[off-cpu: cuda sync]", FrameKind.OFF_CPU)
NCCL = Frame("[off-cpu: nccl]", FrameKind.OFF_CPU)
OFF_CPU_UNIT = "ns"

# The runtime and driver API calls that wait for the device (with their per-thread-stream `_ptsz` and versioned
# `_v2` entry points), and NCCL's API and internals (`ncclAllReduce`, its `pnccl*` profiling aliases).
_CUDA_SYNC_RE = re.compile(r"(?:cuda|cu)(?:Stream|Device|Ctx|Event)Synchronize(?:_v\d+)?(?:_ptsz)?\b")
_NCCL_RE = re.compile(r"p?nccl[A-Z]")


def _runtime(frame: Frame) -> Frame | None:
    """The marker a frame's function names, if it is a CUDA synchronization or NCCL."""
    if frame.kind in (FrameKind.PROCESS, FrameKind.SEPARATOR, FrameKind.KERNEL, FrameKind.OFF_CPU):
        return None
    if _CUDA_SYNC_RE.match(frame.name):
        return CUDA_SYNC
    if _NCCL_RE.match(frame.name) or frame.module.startswith("libnccl"):
        return NCCL
    return None


def off_cpu_marker(frames: Sequence[Frame]) -> Frame:
    """The leaf frame of a blocked stack (root -> leaf): what its rootward-most CUDA sync or NCCL frame names."""
    for f in frames:
        marker = _runtime(f)
        if marker is not None:
            return marker
    return OFF_CPU


def sample_period_ns(prof: Profile) -> int:
    """The CPU time one CPU sample stands for: one period of the per-CPU sampling frequency, in ns."""
    try:
        hz = int(prof.meta.get("frequency_hz", "0"))
    except ValueError:
        hz = 0
    if hz <= 0:
        raise Unreadable("the capture does not say its sampling frequency: CPU samples cannot be weighted by time")
    return round(1e9 / hz)


def _view(prof: Profile, samples: list[Sample]) -> Profile:
    return Profile(samples=samples, events=prof.events, unit=OFF_CPU_UNIT, meta=dict(prof.meta),
                   counters=dict(prof.counters), start_ns=prof.start_ns, end_ns=prof.end_ns)


def _require(prof: Profile, view: str) -> None:
    if not prof.off_cpu:
        raise NothingToShow(f"no off-CPU samples in this capture (the {view} view needs a capture recorded with "
                            "`aiflame profile --off-cpu`)")


def offcpu_profile(prof: Profile) -> Profile:
    """Where the threads blocked, weighted by the ns they stayed blocked (unit: ns)."""
    _require(prof, "offcpu")
    return _view(prof, list(prof.off_cpu))


def wall_profile(prof: Profile) -> Profile:
    """CPU and off-CPU time in one view (unit: ns): each CPU sample weighs one sampling period, each blocked
    stack the ns it stayed blocked. Time a thread spent runnable, waiting for a CPU, is in neither."""
    _require(prof, "wall")
    period = sample_period_ns(prof)
    cpu = [Sample(s.stack, s.weight * period, s.pid, s.tid, s.comm, s.cpu, s.time_ns) for s in prof.samples]
    return _view(prof, cpu + prof.off_cpu)


def with_marker(stack: Stack, native: Sequence[Frame]) -> Stack:
    """`stack` ending in the marker `native` (the sample's whole native stack, which a Python-only view drops
    from `stack`) and `stack` name."""
    marker = off_cpu_marker(native)
    if marker is OFF_CPU:
        marker = off_cpu_marker(stack)
    return (*stack, marker)
