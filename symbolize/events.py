"""Runtime events of a capture as model TraceEvents: named (kernels by their host stub or registered name),
placed on a rank, with the launching thread's symbolized stack. Also the launch view: a profile whose samples
are kernel launches, `<CPU stack> ; - ; <kernel>`."""

from __future__ import annotations

from collections.abc import Sequence

from aiflame.core.model import SEPARATOR, EventKind, Frame, FrameKind, Profile, Sample, Stack, TraceEvent
from aiflame.core.raw import RawEvent
from aiflame.symbolize.objfmt.demangle import demangle, short_name

_KINDS = {k.value: k for k in EventKind}


def ranks(events: Sequence[RawEvent]) -> dict[int, tuple[int, int]]:
    """pid -> (rank, world size), from the first event of the pid that says both."""
    out: dict[int, tuple[int, int]] = {}
    for e in events:
        if e.pid not in out and "rank" in e.args and e.args.get("world_size", 0) > 0:
            out[e.pid] = (e.args["rank"], e.args["world_size"])
    return out


def _registered_names(events: Sequence[RawEvent]) -> dict[tuple[int, int], str]:
    """(pid, host stub) -> device function name, from kernel registrations."""
    return {(e.pid, e.args["func"]): e.strs["name"] for e in events
            if e.kind == "meta" and "func" in e.args and "name" in e.strs}


def _demangled(name: str) -> str:
    return short_name(demangle([name]).get(name, name))


def _kernel_name(e: RawEvent, func_frame: Frame | None, registered: dict[tuple[int, int], str]) -> str:
    if "name" in e.strs:
        return _demangled(e.strs["name"])
    if func_frame is not None and not func_frame.is_unknown:
        return func_frame.name
    reg = registered.get((e.pid, e.args.get("func", 0)))
    if reg:
        return _demangled(reg)
    func = e.args.get("func") or e.args.get("function") or 0
    return f"[kernel {func:#x}]"


# Launches the probes counted in BPF after the last record of their kernel (args "stackless"): no stack was taken.
UNSAMPLED_LAUNCH = Frame("[launch stack not sampled]", FrameKind.UNKNOWN)


def trace_events(events: Sequence[RawEvent], stacks: Sequence[Stack], kernel_frames: Sequence[Frame | None]
                 ) -> list[TraceEvent]:
    """TraceEvents for a capture's non-meta `events`. `stacks[i]` is the symbolized stack of events[i],
    `kernel_frames[i]` the frame its host address "func" names (None: it has none, or it lies in no mapping)."""
    registered = _registered_names(events)
    pid_ranks = ranks(events)
    out: list[TraceEvent] = []
    for i, (e, stack, kernel_frame) in enumerate(zip(events, stacks, kernel_frames, strict=True)):
        if e.kind == "meta":
            continue
        kind = _KINDS.get(e.kind, EventKind.OTHER)
        name = _kernel_name(e, kernel_frame, registered) if kind == EventKind.COMPUTE else e.strs.get("name", e.call)
        rank = e.args.get("rank", pid_ranks.get(e.pid, (-1, 0))[0])
        args: dict[str, int | float | str] = {"runtime": e.runtime, "call": e.call}
        args.update(e.args)
        args.update(e.strs)
        if e.args.get("stackless"):
            stack = (UNSAMPLED_LAUNCH,)
        out.append(TraceEvent(
            name, kind, e.start_ns, max(e.end_ns - e.start_ns, 0) if e.end_ns else 0, e.pid, e.tid, rank,
            stack=stack, args=args, event_id=i + 1,
        ))
    return out


def launch_profile(prof: Profile) -> Profile:
    """One sample per kernel launch record, weighted by the launches it stands for: the launching stack, a
    separator, the kernel (unit: launches)."""
    out = Profile(unit="launches", meta=dict(prof.meta), counters={})
    for ev in prof.events:
        if ev.kind != EventKind.COMPUTE:
            continue
        kernel = Frame(ev.name, FrameKind.ACCEL_SOURCE, module=str(ev.args.get("runtime", "")))
        out.samples.append(Sample((*ev.stack, SEPARATOR, kernel), ev.calls, ev.pid, ev.tid, time_ns=ev.start_ns))
    return out
