"""What each rank of a capture did over time, as intervals: the communication it made (collectives, and sends and
receives up to the end of their waits), the compute between them, and its kernel launches, copies and syncs.

The Chakra traces (exporters/chakra.py), the Perfetto timeline (exporters/perfetto.py) and the simulation report
(exporters/sim_report.py) are all made from these intervals, so what a user sees is what the simulator is given,
and what the report measures is what the simulator replays.

The window. A rank's timeline starts when the last rank to arrive made its first communication call: before
that the ranks were starting up at their own pace, and charging that stretch to the first collective would make
it absorb their start-up skew. It ends when the rank's last communication (or device operation) ended.

Compute. The window is cut at every start and end of a communication call. A piece during which no communication
of the rank was in flight is time the rank's compute threads were running or ready to run: all of it is compute,
less the stretches in which those threads were blocked, found as gaps between their CPU samples far longer than
the sampling could leave by chance (a thread that is ready to run keeps being sampled). A piece during which
communication was in flight is compute only as far as the compute threads were seen on the CPU: their samples
there, at the capture's rate, scaled by the share of the CPU those threads got when they were known to be ready
(on a busy host a ready thread waits for a CPU, and that waiting was also part of its compute outside
communication). Time inside a send, receive or wait call on a compute thread is never compute.

So the measured figures of a rank add up: window = compute + exposed communication (communication in flight and
the compute threads not computing) + idle (blocked outside any communication).
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from aiflame.core.model import EventKind, Frame, FrameKind, Profile, TraceEvent

SENDS, RECVS = frozenset({"send", "ncclSend"}), frozenset({"recv", "ncclRecv"})
P2P_WAITS = frozenset({"send_wait", "recv_wait"})  # gloo: the completion of a posted send/recv
MIN_BLOCKED_NS = 100_000_000  # a sample gap shorter than this is never taken for blocking
BLOCKED_SPACINGS = 25  # ... nor one shorter than this many mean sample spacings (chance: e^-25)
MIN_RUN_FRACTION = 0.05
MIN_EXPECTED_SAMPLES = 20  # fewer expected samples outside communication: assume the threads had a CPU to themselves


def _int(ev: TraceEvent, key: str, default: int = 0) -> int:
    v = ev.args.get(key, default)
    return int(v) if isinstance(v, int | float) else default


def call_name(ev: TraceEvent) -> str:
    """The runtime call an event stands for (gloo's algorithm name, `ncclAllReduce`, `send`, ...)."""
    return str(ev.args.get("call", ev.name))


@dataclass(slots=True)
class CommOp:
    """One communication call of a rank: a collective, or a send/recv up to the end of its wait."""

    event: TraceEvent
    call: str
    kind: str  # "collective", "send" or "recv"
    start_ns: int  # not before the rank's window
    end_ns: int
    bytes: int  # this rank's size as the runtime reported it; -1 when unknown
    peer: int = -1  # send/recv
    tag: int = -1  # send/recv, when the runtime has tags
    root: int = -1
    seq: int = -1  # collectives: the position in the job's collective order, the same on every rank
    wait: tuple[int, int] | None = None  # send/recv: the wait call (start, end), on the posting thread
    post_end_ns: int = 0  # send/recv: when the post call returned

    @property
    def tid(self) -> int:
        return self.event.tid

    @property
    def duration_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 0)


@dataclass(slots=True)
class Compute:
    """A piece of the window between communication boundaries, and how much of it the rank computed."""

    start_ns: int
    end_ns: int
    compute_ns: int
    samples: int  # CPU samples of the compute threads in it
    name: str  # the frame most of those samples were in
    in_comm: bool  # communication was in flight

    @property
    def wall_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class Measured:
    """A rank's window and how it divides: window = compute + exposed + idle (ns)."""

    window_ns: int = 0
    compute_ns: int = 0
    comm_ns: int = 0  # communication in flight (union of the calls)
    exposed_ns: int = 0  # communication in flight while the compute threads did not compute
    idle_ns: int = 0  # blocked outside communication
    run_fraction: float = 1.0  # share of a CPU the compute threads got when ready to run
    samples: int = 0


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


def dominant_frame(stacks: Iterable[tuple[Frame, ...]]) -> tuple[str, int]:
    """The frame most samples were in, and how many: each sample counts its innermost Python frame, else its
    innermost user-space native frame (kernel, separator and process frames never name compute)."""
    counts: Counter[str] = Counter()
    n = 0
    for stack in stacks:
        n += 1
        pick = next((f for f in reversed(stack) if f.kind == FrameKind.PYTHON), None)
        if pick is None:
            pick = next((f for f in reversed(stack) if f.kind in (FrameKind.NATIVE, FrameKind.NATIVE_CPP)), None)
        if pick is not None:
            counts[f"{pick.name} ({pick.file})" if pick.kind == FrameKind.PYTHON and pick.file else pick.name] += 1
    if not counts:
        return ("compute" if not n else "[unknown]"), n
    return counts.most_common(1)[0][0], n


# --- communication calls -------------------------------------------------------------------------------------------


def comm_ops(events: Sequence[TraceEvent]) -> list[CommOp]:
    """A rank's communication calls by start: collectives, and sends/recvs ending at their waits."""
    # a Work's address is reused by later sends/recvs: each post takes the first wait on it that follows
    waits: dict[tuple[int, int], list[TraceEvent]] = defaultdict(list)
    for ev in sorted(events, key=lambda e: (e.start_ns, e.event_id)):
        if call_name(ev) in P2P_WAITS and _int(ev, "work"):
            waits[(ev.pid, _int(ev, "work"))].append(ev)
    out = []
    for ev in sorted(events, key=lambda e: (e.start_ns, e.event_id)):
        if ev.kind != EventKind.COLLECTIVE:
            continue
        call = call_name(ev)
        end = ev.start_ns + ev.duration_ns
        kind = "send" if call in SENDS else "recv" if call in RECVS else "collective"
        op = CommOp(ev, call, kind, ev.start_ns, end, _int(ev, "bytes", -1) if "bytes" in ev.args else -1,
                    root=_int(ev, "root", -1))
        if kind != "collective":
            op.peer = _int(ev, "peer", -1)
            op.tag = _int(ev, "tag", -1) if "tag" in ev.args else -1
            op.post_end_ns = end
            queue = waits.get((ev.pid, _int(ev, "work")), []) if "work" in ev.args else []
            while queue and queue[0].start_ns < ev.start_ns:
                queue.pop(0)  # a wait before this post belongs to an earlier one
            w = queue.pop(0) if queue else None
            if w is not None:
                op.wait = (w.start_ns, w.start_ns + w.duration_ns)
                op.end_ns = max(end, op.wait[1])
        out.append(op)
    return out


def match_collectives(per_rank: dict[int, list[CommOp]], warnings: list[str]) -> None:
    """Number every rank's collectives in the job's order (`seq`). The k-th collective of each rank is the same
    call; a rank whose k-th and (k+1)-th disagree with the others' but agree swapped (two worker threads started
    them microseconds apart in the other order) is swapped back. Collectives past the first disagreement that no
    swap explains, or past the shortest rank's last one, get no number, with a warning."""
    seqs = {r: [op for op in ops if op.kind == "collective"] for r, ops in per_rank.items()}
    if not seqs:
        return
    if len(seqs) == 1:
        for k, op in enumerate(next(iter(seqs.values()))):
            op.seq = k
        return
    n = min(len(s) for s in seqs.values())
    ref = min(seqs)
    k = 0
    while k < n:
        want = seqs[ref][k].call
        bad = [r for r, s in seqs.items() if s[k].call != want]
        if bad:
            # the majority call at k decides; a swap with k+1 fixes a rank whose order differs by a race
            calls = Counter(s[k].call for s in seqs.values())
            want = calls.most_common(1)[0][0]
            for s in seqs.values():
                if s[k].call != want and k + 1 < len(s) and s[k + 1].call == want:
                    s[k], s[k + 1] = s[k + 1], s[k]
            bad = [r for r, s in seqs.items() if s[k].call != want]
            if bad:
                calls_at = ", ".join(f"rank {r} {s[k].call}" for r, s in sorted(seqs.items()))
                warnings.append(f"collective #{k} differs across ranks ({calls_at}): it and the later ones are "
                                "left unmatched")
                n = k
                break
        for s in seqs.values():
            s[k].seq = k
        k += 1
    longest = max(len(s) for s in seqs.values())
    if longest > n:
        short = ", ".join(f"rank {r}: {len(s) - n}" for r, s in sorted(seqs.items()) if len(s) > n)
        warnings.append(f"collectives without a counterpart on every rank ({short}): left out of the matching")


# --- compute -----------------------------------------------------------------------------------------------------


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(union: list[tuple[int, int]], starts: list[int], a: int, b: int) -> int:
    """How much of [a, b) the sorted disjoint intervals cover."""
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    total = 0
    while i < len(union) and union[i][0] < b:
        lo, hi = max(union[i][0], a), min(union[i][1], b)
        if hi > lo:
            total += hi - lo
        i += 1
    return total


@dataclass(slots=True)
class _Piece:
    start: int
    end: int
    in_comm: bool
    own: int  # time inside a communication call on a compute thread
    blocked: int  # outside communication: time the compute threads were found blocked
    samples: list[tuple[int, tuple[Frame, ...]]]


def _pieces(start: int, end: int, ops: Sequence[CommOp], device: Sequence[TraceEvent],
            samples: list[tuple[int, tuple[Frame, ...]]], threads: set[tuple[int, int]],
            blocked: list[tuple[int, int]]) -> list[_Piece]:
    cuts = {start, end}
    for op in ops:
        cuts.update(t for t in (op.start_ns, op.end_ns) if start < t < end)
    for ev in device:
        cuts.update(t for t in (ev.start_ns, ev.start_ns + ev.duration_ns) if start < t < end)
    comm = _union((op.start_ns, op.end_ns) for op in ops)
    comm_starts = [a for a, _ in comm]
    # the compute threads' own time in communication calls (posts and waits) and in host syncs
    own_iv = [(op.start_ns, op.post_end_ns) for op in ops if op.kind != "collective"
              and (op.event.pid, op.event.tid) in threads]
    own_iv += [op.wait for op in ops if op.wait is not None]
    own_iv += [(ev.start_ns, ev.start_ns + ev.duration_ns) for ev in device if ev.kind == EventKind.SYNC]
    own = _union(own_iv)
    own_starts = [a for a, _ in own]
    blocked_starts = [a for a, _ in blocked]
    times = [t for t, _ in samples]
    out = []
    edges = sorted(cuts)
    for a, b in zip(edges, edges[1:], strict=False):
        in_comm = _overlap(comm, comm_starts, a, b) * 2 > b - a
        own_ns = _overlap(own, own_starts, a, b)
        lo, hi = bisect.bisect_left(times, a), bisect.bisect_left(times, b)
        mine = [s for s in samples[lo:hi] if _overlap(own, own_starts, s[0], s[0] + 1) == 0]
        blocked_ns = 0 if in_comm else _overlap(blocked, blocked_starts, a, b)
        out.append(_Piece(a, b, in_comm, own_ns, blocked_ns, mine))
    return out


def _blocked(times: list[int], spacing_ns: float) -> list[tuple[int, int]]:
    """Stretches between consecutive samples of the compute threads too long for a thread that was ready to run."""
    gap = max(MIN_BLOCKED_NS, BLOCKED_SPACINGS * spacing_ns)
    out = []
    for t1, t2 in zip(times, times[1:], strict=False):
        if t2 - t1 > gap:
            out.append((int(t1 + spacing_ns), int(t2 - spacing_ns)))
    return out


def _rank_compute(start: int, end: int, ops: Sequence[CommOp], device: Sequence[TraceEvent],
                  samples: list[tuple[int, tuple[Frame, ...]]], threads: set[tuple[int, int]],
                  freq: int) -> tuple[list[Compute], Measured]:
    times = [t for t, _ in samples]
    # first pass: the run fraction outside communication without blocking, then blocking, then again
    run = 1.0
    blocked: list[tuple[int, int]] = []
    pieces: list[_Piece] = []
    for _ in range(2):
        if freq > 0 and times:
            blocked = _blocked(times, 1e9 / (freq * run))
        pieces = _pieces(start, end, ops, device, samples, threads, blocked)
        ready = sum(p.end - p.start - p.own - p.blocked for p in pieces if not p.in_comm)
        seen = sum(len(p.samples) for p in pieces if not p.in_comm)
        expected = ready * freq / 1e9
        run = min(max(seen / expected, MIN_RUN_FRACTION), 1.0) if expected >= MIN_EXPECTED_SAMPLES else 1.0
    per_sample = 1e9 / (freq * run) if freq > 0 else 0.0
    out: list[Compute] = []
    m = Measured(window_ns=end - start, run_fraction=run)
    carry = 0.0  # sampling's rounding carried from one piece in communication to the next
    for p in pieces:
        avail = max(p.end - p.start - p.own, 0)
        if p.in_comm:
            est = len(p.samples) * per_sample + carry
            ns = int(min(avail, est))
            carry = est - ns
            m.comm_ns += p.end - p.start
            m.exposed_ns += p.end - p.start - ns
        else:
            ns = max(avail - p.blocked, 0)  # `own` here is a host sync: waiting for the device, not compute
            m.idle_ns += p.end - p.start - ns
        m.compute_ns += ns
        m.samples += len(p.samples)
        name, n = dominant_frame(st for _, st in p.samples)
        out.append(Compute(p.start, p.end, ns, n, name, p.in_comm))
    return out, m


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
