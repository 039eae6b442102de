"""Captures of several hosts joined into one job (exporters/job_join.py, issue #29): the clocks aligned by each
capture's clock pair and refined from the collectives (a 37 ms error of the realtime clocks is recovered within
100 µs), pids kept apart, a rank in two captures refused, a missing rank named, and the joined job exported as one
Chakra set that passes the simulator's input rules (our validator)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from aiflame.core.errors import BadInput
from aiflame.core.model import Profile
from aiflame.exporters.chakra import write_traces
from aiflame.exporters.job_join import join
from tests.unit.test_chakra import MS, ev, samples

D = 123_456_789_012  # host B's monotonic clock is this far behind host A's (another boot)
WALL = 1_790_000_000_000_000_000  # host A's realtime clock at its start


def host(ranks: tuple[int, ...], world: int, clock: int, seed: int) -> Profile:
    """A host's capture of a data-parallel job: 20 all-reduces that every rank joins at its own time and that end
    together (within ±20 µs), compute between them; times on the host's clock (true time - `clock`)."""
    rng = random.Random(seed)
    prof = Profile(meta={"frequency_hz": "1000", "host": f"node{seed}"})
    for r in ranks:
        for k in range(20):
            start = k * 10 * MS + rng.randrange(0, 2 * MS)
            end = k * 10 * MS + 5 * MS + rng.randrange(-20_000, 20_000)
            prof.events.append(ev(r, "allreduce", start - clock, end - start, tid=7, bytes=4096, world_size=world))
        prof.samples += samples(r, [k * 10 * MS + 6 * MS + j * MS - clock for k in range(20) for j in range(3)])
    prof.start_ns = 1000 - clock
    prof.end_ns = 200 * MS - clock
    prof.meta["start_wall_ns"] = str(WALL + prof.start_ns + clock)  # a perfect realtime clock
    return prof


def test_a_clock_error_is_recovered_from_the_collectives() -> None:
    # Oracle: by construction — host B's clock set D ahead and its wall clock 37 ms off, here
    a = host((0, 1), 4, 0, 1)
    b = host((2, 3), 4, D, 2)
    b.meta["start_wall_ns"] = str(int(b.meta["start_wall_ns"]) + 37 * MS)  # NTP kept B 37 ms off
    done = join(["a", "b"], [a, b])
    clock = done.clocks[1]
    assert clock.clock_ns == D + 37 * MS and clock.matched == 20
    assert abs(clock.clock_ns + clock.residual_ns - D) < 100_000, clock  # within 100 µs of the truth
    ends: dict[int, list[int]] = {}
    for e in done.profile.events:
        ends.setdefault(e.rank, []).append(e.start_ns + e.duration_ns)
    assert sorted(ends) == [0, 1, 2, 3]
    for k in range(20):  # every rank's k-th all-reduce ends at the same instant, up to the jitter put in
        kth = [sorted(v)[k] for v in ends.values()]
        assert max(kth) - min(kth) < 200_000
    assert done.notes == []


def test_pids_of_two_hosts_stay_apart() -> None:
    # Oracle: by construction — both hosts' ranks given the same pids here
    a = host((0, 1), 4, 0, 1)
    b = host((2, 3), 4, D, 2)
    for e in b.events:  # host B's ranks run as the same pids as host A's
        e.pid = e.tid = 100 + e.rank - 2
    b.samples = [s.__class__(s.stack, s.weight, s.pid - 2, s.tid - 2, s.comm, s.cpu, s.time_ns) for s in b.samples]
    done = join(["a", "b"], [a, b])
    pids = {e.rank: e.pid for e in done.profile.events}
    assert len(set(pids.values())) == 4 and pids[0] == 100 and pids[2] != 100
    assert {s.pid for s in done.profile.samples} == set(pids.values())


def test_a_rank_in_two_captures_is_refused_and_a_missing_rank_named() -> None:
    a = host((0, 1), 4, 0, 1)
    with pytest.raises(BadInput, match="rank 1 is in two captures: a and b"):
        join(["a", "b"], [a, host((1, 2), 4, D, 2)])
    done = join(["a", "b"], [a, host((2,), 4, D, 2)])
    assert done.notes == ["rank 3 is in none of the captures (world size 4)"]


def test_a_capture_without_a_clock_pair_is_refused() -> None:
    b = host((2, 3), 4, D, 2)
    del b.meta["start_wall_ns"]
    with pytest.raises(BadInput, match="b: the capture has no clock pair"):
        join(["a", "b"], [host((0, 1), 4, 0, 1), b])


def test_the_joined_job_is_one_chakra_set(tmp_path: Path) -> None:
    done = join(["a", "b"], [host((0, 1), 4, 0, 1), host((2, 3), 4, D, 2)])
    files, traces = write_traces(done.profile, tmp_path / "job")
    assert sorted(p.name for p in files if p.name.endswith(".et")) == [f"job.{r}.et" for r in range(4)]
    assert traces.problems == []  # ASTRA-sim's input rules (exporters/chakra_rules.py)
