"""Captures of one job taken on several hosts, joined into one profile (issue #29): every host's times on the first
host's clock, pids kept apart, ranks checked.

Clocks. Samples and events carry CLOCK_MONOTONIC times, which mean nothing across hosts. Each capture's header
holds the pair (CLOCK_REALTIME, CLOCK_MONOTONIC) read together at its start, so a host's times map onto the first
host's monotonic clock through the two realtime clocks: good to what NTP/PTP keeps them to (milliseconds). The join
then refines each host's offset from the collectives themselves: a collective ends at nearly the same instant on
every rank (it cannot end before its last member arrives, and all of them are released together), so the median,
over collectives, of the difference between the two hosts' end times is what remains of the clock offset. Each
host's refinement is reported (its residual offset).

Ranks. Each capture's ranks come from its runtime probes or its launcher's environment, as within one host. A rank
found in two captures makes no job (an error naming both); ranks missing from the world size are named, one line
each, and the join goes on."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from aiflame.core.errors import BadInput
from aiflame.core.model import EventKind, Profile

PID_SPAN = 1 << 22  # pid_max: host i's pids become pid + i * PID_SPAN where two hosts' pids collide


@dataclass
class HostClock:
    """How one capture's times were moved onto the joined clock."""

    name: str
    host: str
    clock_ns: int = 0  # from the realtime clocks (header pairs)
    residual_ns: int = 0  # then from the collectives (0 without any in common)
    matched: int = 0  # collectives the residual was taken from


@dataclass
class Joined:
    profile: Profile
    clocks: list[HostClock] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _ints(meta: dict[str, str], key: str) -> int | None:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        return None


def _collective_ends(prof: Profile) -> dict[int, int]:
    """k -> the median end time of every rank's k-th collective (each rank's in call order)."""
    per_rank: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in prof.events:
        if e.kind == EventKind.COLLECTIVE and e.rank >= 0 and e.duration_ns > 0:
            per_rank[e.rank].append((e.start_ns, e.start_ns + e.duration_ns))
    ends: dict[int, list[int]] = defaultdict(list)
    for calls in per_rank.values():
        for k, (_, end) in enumerate(sorted(calls)):
            ends[k].append(end)
    return {k: int(statistics.median(v)) for k, v in ends.items()}


def _residual(a: dict[int, int], b: dict[int, int]) -> tuple[int, int]:
    """The median over collectives k of a[k] - b[k] (the two hosts' median ends of their k-th collective), and
    over how many."""
    diffs = [a[k] - b[k] for k in a.keys() & b.keys()]
    return (int(statistics.median(diffs)), len(diffs)) if diffs else (0, 0)


def _shift(prof: Profile, delta: int, pid_add: int) -> Profile:
    def pid(p: int) -> int:
        return p + pid_add if p > 0 else p

    return replace(
        prof,
        samples=[replace(s, time_ns=s.time_ns + delta if s.time_ns else 0, pid=pid(s.pid), tid=pid(s.tid))
                 for s in prof.samples],
        events=[replace(e, start_ns=e.start_ns + delta, pid=pid(e.pid), tid=pid(e.tid)) for e in prof.events],
        start_ns=prof.start_ns + delta if prof.start_ns else 0, end_ns=prof.end_ns + delta if prof.end_ns else 0,
    )


def _ranks(names: Sequence[str], profiles: Sequence[Profile]) -> list[str]:
    """Notes on the ranks of the world size in none of the captures; BadInput for a rank in two captures."""
    owner: dict[int, str] = {}
    world = 0
    for name, prof in zip(names, profiles, strict=True):
        for r in sorted({e.rank for e in prof.events if e.rank >= 0}):
            if r in owner and owner[r] != name:
                raise BadInput(f"rank {r} is in two captures: {owner[r]} and {name} (one capture per host)")
            owner[r] = name
        for e in prof.events:
            w = e.args.get("world_size")
            if isinstance(w, int) and w > world:
                world = w
    return [f"rank {r} is in none of the captures (world size {world})" for r in range(world) if r not in owner]


def join(names: Sequence[str], profiles: Sequence[Profile]) -> Joined:
    """The captures `profiles` (named `names`, one per host) as one job on the first one's clock."""
    if len(profiles) < 2:
        return Joined(profiles[0] if profiles else Profile())
    notes = _ranks(names, profiles)
    ref = profiles[0]
    ref_wall = _ints(ref.meta, "start_wall_ns")
    seen_pids: set[int] = set()
    shifted: list[Profile] = []
    clocks: list[HostClock] = []
    for i, (name, prof) in enumerate(zip(names, profiles, strict=True)):
        clock = HostClock(name, prof.meta.get("host", ""))
        wall = _ints(prof.meta, "start_wall_ns")
        if i and (wall is None or ref_wall is None):
            raise BadInput(f"{name}: the capture has no clock pair (written by an older aiflame): cannot join it")
        if i:
            # host time t is wall - start_mono + t on the realtime clock; on the reference's monotonic clock:
            clock.clock_ns = (wall or 0) - prof.start_ns - ((ref_wall or 0) - ref.start_ns)
        pids = {s.pid for s in prof.samples} | {e.pid for e in prof.events}
        pid_add = i * PID_SPAN if pids & seen_pids else 0
        seen_pids |= {p + pid_add for p in pids}
        coll_ends = _collective_ends(prof)
        if not i:
            ref_ends = coll_ends
        else:
            clock.residual_ns, clock.matched = _residual(ref_ends, {k: t + clock.clock_ns
                                                                    for k, t in coll_ends.items()})
        shifted.append(_shift(prof, clock.clock_ns + clock.residual_ns, pid_add))
        clocks.append(clock)
        if prof.meta.get("boot_id") and i and prof.meta.get("boot_id") == ref.meta.get("boot_id") and \
                clock.host == clocks[0].host:
            notes.append(f"{name} was taken on the same host and boot as {names[0]}")
    out = Profile(unit=ref.unit, meta={**ref.meta, "hosts": ",".join(c.host or c.name for c in clocks)})
    for p in shifted:
        out.samples += p.samples
        out.events += p.events
        for k, v in p.counters.items():
            out.counters[k] = out.counters.get(k, 0) + v
    starts = [p.start_ns for p in shifted if p.start_ns]
    ends = [p.end_ns for p in shifted if p.end_ns]
    out.start_ns, out.end_ns = (min(starts) if starts else 0), (max(ends) if ends else 0)
    return Joined(out, clocks, notes)
