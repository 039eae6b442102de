"""A timeline to open in Perfetto (ui.perfetto.dev) or chrome://tracing, laid out as Chrome's trace-event list (the
model PyTorch's profiler writes) and written as Perfetto's protobuf (`perfetto`, exporters/perfetto_trace.py) or as
that JSON (`perfetto-json`). One process per rank; per rank a track "NPU compute" with the compute intervals the Chakra
COMP nodes are made of (and, after each, what the rest of that piece was: waiting for communication, or blocked),
and one track per thread with its collectives and sends/receives (type, bytes, peer, the simulated type and size),
their waits, and its kernel launches, copies and syncs. Flow arrows join each send to its receive. All of it comes
from exporters/rank_timeline.py, like the Chakra traces, so this is what the simulator is given, to the
microsecond. Times are microseconds from the capture's start."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from aiflame.core.model import EventKind, Profile

from .base import Exporter
from .chakra_nodes import COMM_TYPE_NAMES, pair_messages, plan_collective
from .rank_timeline import CommOp, JobTimeline, build_timeline, call_name

NPU_TID = 1 << 30  # the synthetic thread id of a rank's "NPU compute" track
LANE_TID = 1 << 29  # synthetic thread ids for slices that would overlap on their thread without nesting


def _us(ns: int, base: int) -> float:
    return round((ns - base) / 1000, 3)


class _Tracks:
    """Places slices so each track's slices nest (the format requires it): a slice that would cross one already
    on its thread goes to an extra lane of that thread."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, int], list[list[int]]] = defaultdict(list)  # (pid, tid) -> lanes' stacks of ends
        self.lanes: dict[tuple[int, int], int] = {}

    def place(self, pid: int, tid: int, start: int, end: int) -> int:
        lanes = self.open[(pid, tid)]
        for i, stack in enumerate(lanes):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                return tid if i == 0 else self._lane(pid, tid, i)
        lanes.append([end])
        return tid if len(lanes) == 1 else self._lane(pid, tid, len(lanes) - 1)

    def _lane(self, pid: int, tid: int, i: int) -> int:
        key = (pid, LANE_TID + (tid % LANE_TID) * 8 + i)
        self.lanes[key] = tid
        return key[1]


def _rank_label(rank: int, pids: list[int]) -> str:
    """Process track name: viewers add the track's pid themselves; a rank that ran as more processes lists them."""
    return f"rank {rank}" if len(pids) == 1 else f"rank {rank} (pids {', '.join(map(str, pids))})"


def trace_events(prof: Profile, tl: JobTimeline) -> list[dict[str, Any]]:
    """The trace-event list of a capture's timeline."""
    base = prof.start_ns or tl.start_ns
    out: list[dict[str, Any]] = []
    tracks = _Tracks()
    thread_names = {(s.pid, s.tid): s.comm for s in prof.samples if s.comm}
    plan = {seq: plan_collective(parts, tl.world) for seq, parts in tl.collectives().items()}
    messages = pair_messages(tl, [])
    named: set[tuple[int, int]] = set()

    slices: list[tuple[int, int, int, int, str, str, dict[str, Any]]] = []
    flows: list[tuple[int, str, int]] = []  # (index in slices, phase, flow id)

    def slice_(pid: int, tid: int, name: str, cat: str, start: int, end: int, args: dict[str, Any]) -> int:
        slices.append((pid, tid, start, max(end, start), name, cat, args))
        return len(slices) - 1

    for r, t in sorted(tl.ranks.items()):
        pid = t.pids[0]
        out.append({"ph": "M", "pid": pid, "name": "process_name",
                    "args": {"name": _rank_label(r, t.pids)}})
        out.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": r}})
        out.append({"ph": "M", "pid": pid, "tid": NPU_TID, "name": "thread_name",
                    "args": {"name": "NPU compute (the Chakra COMP nodes)"}})
        out.append({"ph": "M", "pid": pid, "tid": NPU_TID, "name": "thread_sort_index", "args": {"sort_index": -1}})
        out.append({"ph": "i", "s": "p", "pid": pid, "tid": NPU_TID, "name": "window start (simulator time 0)",
                    "ts": _us(t.start_ns, base), "args": {"arrived_early_us": round((t.start_ns - t.arrived_ns) / 1e3,
                                                                                   3)}})
        for c in t.compute:
            slice_(pid, NPU_TID, c.name, "compute", c.start_ns, c.start_ns + c.compute_ns,
                   {"compute_us": round(c.compute_ns / 1e3, 3), "piece_us": round(c.wall_ns / 1e3, 3),
                    "cpu_samples": c.samples, "communication_in_flight": c.in_comm})
        for a, b, what in _gaps(t):
            slice_(pid, NPU_TID, what, "wait", a, b, {})
        for op in t.ops:
            i = slice_(op.event.pid, op.tid, op.call, "collective" if op.kind == "collective" else "p2p",
                       op.start_ns, op.end_ns, _op_args(op, plan, messages))
            if op.wait is not None and op.wait[1] > op.wait[0]:
                slice_(op.event.pid, op.tid, call_name(op.event) + " wait", "wait", op.wait[0], op.wait[1],
                       {"peer": op.peer})
            if op.kind in ("send", "recv") and id(op) in messages:
                flows.append((i, "s" if op.kind == "send" else "f", messages[id(op)][2] + 1))
        for dev in t.device:
            cat = {EventKind.COMPUTE: "launch", EventKind.COPY: "copy", EventKind.SYNC: "sync"}[dev.kind]
            args: dict[str, Any] = {k: v for k, v in dev.args.items() if k in ("stream", "bytes", "direction",
                                                                                "gpu_ns", "call", "calls")}
            slice_(dev.pid, dev.tid, dev.name, cat, dev.start_ns, dev.start_ns + dev.duration_ns, args)
    # placed in time order (outer slices first), so each track's slices nest
    lanes: dict[int, int] = {}
    for i in sorted(range(len(slices)), key=lambda i: (slices[i][2], -slices[i][3])):
        pid, tid, start, end, name, cat, args = slices[i]
        lane = lanes[i] = tracks.place(pid, tid, start, end)
        named.add((pid, lane))
        out.append({"ph": "X", "pid": pid, "tid": lane, "name": name, "cat": cat, "ts": _us(start, base),
                    "dur": round((end - start) / 1000, 3), "args": args})
    # Flow events bind to the slice open on their own track at their ts ("bp": "e" for the end), so each goes on the
    # track its slice went to: the send's start and the receive's end (a receive is often posted before the send).
    for i, ph, fid in flows:
        pid, _, start, end, _, cat, _ = slices[i]
        flow = {"ph": ph, "id": fid, "pid": pid, "tid": lanes[i], "name": "message", "cat": cat,
                "ts": _us(start if ph == "s" else end, base)}
        if ph == "f":
            flow["bp"] = "e"
        out.append(flow)
    for pid, tid in sorted(named):
        if tid == NPU_TID:
            continue
        real = tracks.lanes.get((pid, tid), tid)
        name = thread_names.get((pid, real), "")
        # viewers show each track's pid and tid beside its name themselves; an overlap lane's tid is not the thread's
        label = name or "thread"
        if real != tid:
            label += f" ({real}, overlapping)"
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": label}})
    return out


def _gaps(t: Any) -> list[tuple[int, int, str]]:
    """After each compute interval, the rest of its piece: waiting for communication, or blocked."""
    out = []
    for c in t.compute:
        if c.wall_ns - c.compute_ns >= 1000:
            out.append((c.start_ns + c.compute_ns, c.end_ns,
                        "waiting (communication in flight)" if c.in_comm else "blocked"))
    return out


def _op_args(op: CommOp, plan: dict[int, Any], messages: dict[int, tuple[int, int, int]]) -> dict[str, Any]:
    args: dict[str, Any] = {"bytes": op.bytes, "runtime": str(op.event.args.get("runtime", ""))}
    if op.kind == "collective":
        args["seq"] = op.seq
        p = plan.get(op.seq)
        if p is not None:
            args["simulated_as"] = COMM_TYPE_NAMES.get(p.comm_type, str(p.comm_type))
            args["comm_size"] = p.comm_size
            if p.note:
                args["mapped"] = p.note
        if op.root >= 0:
            args["root"] = op.root
        for key in ("wire_sent", "wire_recv"):
            if key in op.event.args:
                args[key] = op.event.args[key]
    else:
        args["peer"] = op.peer
        if op.tag >= 0:
            args["tag"] = op.tag
        if id(op) in messages:
            args["comm_size"] = messages[id(op)][1]
    return args


def _other_data(tl: JobTimeline) -> dict[str, Any]:
    return {"producer": "aiflame", "sampling_hz": tl.frequency_hz, "world_size": tl.world, "warnings": tl.warnings}


class PerfettoExporter(Exporter):
    """Perfetto's protobuf trace of the capture's timeline (compute, communication, waits, launches per rank)."""

    name = "perfetto"
    extension = ".pftrace"
    description = "timeline for ui.perfetto.dev (Perfetto's protobuf format): compute, collectives, waits, launches"

    def render(self, profile: Profile) -> bytes:
        from . import perfetto_trace  # Perfetto's schema takes 70 ms to import: only when this format is asked for

        tl = build_timeline(profile)
        return perfetto_trace.encode(trace_events(profile, tl), _other_data(tl), LANE_TID)


class PerfettoJsonExporter(Exporter):
    """The same timeline as Chrome trace-event JSON (chrome://tracing, scripts that read PyTorch's traces)."""

    name = "perfetto-json"
    extension = ".perfetto.json"
    text = True
    description = "the perfetto timeline as Chrome trace-event JSON (chrome://tracing); several times larger"

    def render(self, profile: Profile) -> bytes:
        tl = build_timeline(profile)
        doc = {"traceEvents": trace_events(profile, tl), "displayTimeUnit": "ms", "otherData": _other_data(tl)}
        return json.dumps(doc, separators=(",", ":")).encode()
