"""How much of a rank's window its compute threads computed (`_rank_compute`, for exporters/rank_timeline.py, which
says what the window is), from their CPU samples.

Compute. The window is cut at every start and end of a communication call. A piece during which no communication
of the rank was in flight is time the rank's compute threads were running or ready to run: all of it is compute,
less the stretches in which those threads were blocked, found as gaps between their CPU samples far longer than
the sampling could leave by chance (a thread that is ready to run keeps being sampled). A piece during which
communication was in flight is compute only as far as the compute threads were seen on the CPU: their samples
there, at the capture's rate, scaled by the share of the CPU those threads got when they were known to be ready
(on a busy host a ready thread waits for a CPU, and that waiting was also part of its compute outside
communication). Time inside a send, receive or wait call on a compute thread is never compute.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aiflame.core.model import EventKind, Frame, FrameKind, TraceEvent

from .rank_comm import CommOp

MIN_BLOCKED_NS = 100_000_000  # a sample gap shorter than this is never taken for blocking
BLOCKED_SPACINGS = 25  # ... nor one shorter than this many mean sample spacings (chance: e^-25)
MIN_RUN_FRACTION = 0.05
MIN_EXPECTED_SAMPLES = 20  # fewer expected samples outside communication: assume the threads had a CPU to themselves


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

