"""What each rank of a capture did over time, as intervals: the communication it made (collectives, and sends and
receives up to the end of their waits), the compute between them, and its kernel launches, copies and syncs.

The Chakra traces (exporters/chakra.py), the Perfetto timeline (exporters/perfetto.py) and the simulation report
(exporters/sim_report.py) are all made from these intervals, so what a user sees is what the simulator is given,
and what the report measures is what the simulator replays.

The window. A rank's timeline starts when the last rank to arrive made its first communication call: before
that the ranks were starting up at their own pace, and charging that stretch to the first collective would make
it absorb their start-up skew. It ends when the rank's last communication (or device operation) ended.

How compute is measured is exporters/rank_compute.py's subject; the communication calls and their matching
across ranks are exporters/rank_comm.py's. Both are re-exported here.

So the measured figures of a rank add up: window = compute + exposed communication (communication in flight and
the compute threads not computing) + idle (blocked outside any communication).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from aiflame.core.model import EventKind, Frame, FrameKind, Profile, TraceEvent

from .rank_comm import P2P_WAITS, RECVS, SENDS, CommOp, _int, call_name, comm_ops, match_collectives
from .rank_compute import Compute, Measured, _rank_compute, dominant_frame

__all__ = ["P2P_WAITS", "RECVS", "SENDS", "CommOp", "Compute", "JobTimeline", "Measured", "RankTimeline",
           "assign_ranks", "build_timeline", "call_name", "comm_ops", "compute_threads", "dominant_frame",
           "match_collectives"]


@dataclass(slots=True)
class RankTimeline:
    rank: int
    pids: list[int]
    start_ns: int
    end_ns: int
    ops: list[CommOp]  # by start
    compute: list[Compute]  # every piece of the window between communication boundaries, by start
    device: list[TraceEvent]  # kernel launches, copies and syncs, by start
    compute_threads: list[tuple[int, int]]
    measured: Measured
    arrived_ns: int = 0  # when its first communication call started (before start_ns on early ranks)


@dataclass(slots=True)
class JobTimeline:
    ranks: dict[int, RankTimeline]
    world: int
    start_ns: int  # the earliest window start
    frequency_hz: int
    warnings: list[str] = field(default_factory=list)

    def collectives(self) -> dict[int, dict[int, CommOp]]:
        """seq -> rank -> the rank's part of that collective."""
        out: dict[int, dict[int, CommOp]] = defaultdict(dict)
        for r, t in self.ranks.items():
            for op in t.ops:
                if op.seq >= 0:
                    out[op.seq][r] = op
        return dict(out)


# --- ranks and threads -------------------------------------------------------------------------------------------


def assign_ranks(prof: Profile, warnings: list[str]) -> tuple[dict[int, int], int]:
    """pid -> rank for every pid with events, and the world size. Ranks come from the events (runtimes or the
    environment); pids with none get the ranks after the known ones, with a warning."""
    pid_rank: dict[int, int] = {}
    world = 0
    for ev in prof.events:
        if ev.rank >= 0:
            pid_rank.setdefault(ev.pid, ev.rank)
        world = max(world, _int(ev, "world_size"))
    unranked = sorted({ev.pid for ev in prof.events} - pid_rank.keys())
    if unranked:
        nxt = max(pid_rank.values(), default=-1) + 1
        for pid in unranked:
            pid_rank[pid] = nxt
            nxt += 1
        warnings.append(f"no rank known for pid(s) {', '.join(map(str, unranked))}: numbered after the known ranks")
    by_rank: dict[int, list[int]] = defaultdict(list)
    for pid, r in pid_rank.items():
        by_rank[r].append(pid)
    for r, pids in by_rank.items():
        if len(pids) > 1:
            warnings.append(f"rank {r} is held by several processes ({', '.join(map(str, sorted(pids)))}): merged")
    world = max(world, max(pid_rank.values(), default=-1) + 1)
    return pid_rank, world


def compute_threads(prof: Profile) -> set[tuple[int, int]]:
    """The (pid, tid) that compute: threads that ran Python, else every sampled thread but those that ran
    collectives (a communication library's workers)."""
    threads = {(s.pid, s.tid) for s in prof.samples}
    python = {(s.pid, s.tid) for s in prof.samples if any(f.kind == FrameKind.PYTHON for f in s.stack)}
    python_pids = {pid for pid, _ in python}
    comm = {(e.pid, e.tid) for e in prof.events if e.kind == EventKind.COLLECTIVE and e.tid != e.pid
            and call_name(e) not in SENDS | RECVS}
    return {t for t in threads if (t in python if t[0] in python_pids else t not in comm)}


# --- the job -------------------------------------------------------------------------------------------------


def build_timeline(prof: Profile) -> JobTimeline:
    """Every rank's intervals, with its collectives numbered in the job's order."""
    warnings: list[str] = []
    pid_rank, world = assign_ranks(prof, warnings)
    events: dict[int, list[TraceEvent]] = defaultdict(list)
    for ev in prof.events:
        events[pid_rank[ev.pid]].append(ev)
    freq = int(prof.meta.get("frequency_hz", "0") or 0)
    threads = compute_threads(prof)
    samples: dict[int, list[tuple[int, tuple[Frame, ...]]]] = defaultdict(list)
    for s in prof.samples:
        r = pid_rank.get(s.pid)
        if r is not None and s.time_ns and (s.pid, s.tid) in threads:
            samples[r].append((s.time_ns, s.stack))
    ops = {r: comm_ops(evs) for r, evs in events.items()}
    match_collectives(ops, warnings)
    device = {r: sorted((e for e in evs if e.kind in (EventKind.COMPUTE, EventKind.COPY, EventKind.SYNC)
                         and call_name(e) not in P2P_WAITS), key=lambda e: (e.start_ns, e.event_id))
              for r, evs in events.items()}
    arrived = {r: min([*(o.start_ns for o in ops[r]), *(e.start_ns for e in device[r])], default=0)
               for r in events}
    communicating = [arrived[r] for r in events if ops[r]]
    common = max(communicating) if len(communicating) > 1 else None
    out: dict[int, RankTimeline] = {}
    for r in sorted(events):
        start = common if common is not None and ops[r] else arrived[r]
        end = max([start, *(o.end_ns for o in ops[r]), *(e.start_ns + e.duration_ns for e in device[r])])
        for op in ops[r]:
            op.start_ns = min(max(op.start_ns, start), op.end_ns)
            if op.wait is not None:
                op.wait = (max(op.wait[0], start), max(op.wait[1], start))
        rank_samples = sorted((s for s in samples[r] if start <= s[0] < end), key=lambda s: s[0])
        rank_threads = {t for t in threads if pid_rank.get(t[0]) == r}
        compute, measured = _rank_compute(start, end, ops[r], device[r], rank_samples, rank_threads, freq)
        pids = sorted(p for p, rr in pid_rank.items() if rr == r)
        out[r] = RankTimeline(r, pids, start, end, ops[r], compute, device[r], sorted(rank_threads), measured,
                              arrived[r])
    if freq <= 0 and prof.samples:
        warnings.append("the capture does not say its sampling rate: compute during communication is not counted")
    first = min((t.start_ns for t in out.values()), default=0)
    return JobTimeline(out, world, first, freq, warnings)
