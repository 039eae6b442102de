"""Joining a large job's captures (issue #29's target: 16 nodes of 8 ranks in <= 30 s and <= 1 GB): synthetic
per-node profiles of a data-parallel job (all-reduces every 10 ms that every rank joins at its own time and that
end together, 99 Hz samples), each node on its own monotonic clock with a realtime error of up to 50 ms; joined
(exporters/job_join.py) and exported as Chakra traces. Prints the time of each step, the peak RSS and the worst
clock error left; results in bench/results/join_scale.json.

    python bench/join_scale.py [--nodes 16] [--ranks 8] [--steps 500]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

from common import RESULTS

from aiflame.core.model import EventKind, Frame, FrameKind, Profile, Sample, TraceEvent
from aiflame.exporters.chakra import write_traces
from aiflame.exporters.job_join import join

MS = 1_000_000
WALL = 1_790_000_000_000_000_000


def node(i: int, ranks: int, world: int, steps: int, rng: random.Random) -> tuple[Profile, int]:
    """Node i's profile on its own clock (true time - clock), and that clock."""
    clock = rng.randrange(10**9, 10**12)
    prof = Profile(meta={"frequency_hz": "99", "host": f"node{i}"})
    frames = (Frame("python3", FrameKind.PROCESS), Frame("train.py:step", FrameKind.PYTHON))
    for r in range(i * ranks, (i + 1) * ranks):
        pid = 1000 + r % ranks
        for k in range(steps):
            start = k * 10 * MS + rng.randrange(0, 3 * MS)
            end = k * 10 * MS + 6 * MS + rng.randrange(-20_000, 20_000)
            prof.events.append(TraceEvent("allreduce", EventKind.COLLECTIVE, start - clock, end - start, pid, pid,
                                          r, -1, (), {"runtime": "nccl", "call": "allreduce", "rank": r,
                                                      "world_size": world, "bytes": 1 << 22}))
        prof.samples += [Sample(frames, 1, pid, pid, "python3", 0, t - clock)
                         for t in range(0, steps * 10 * MS, 1_000_000_000 // 99)]
    prof.start_ns, prof.end_ns = 1 - clock, steps * 10 * MS - clock
    prof.meta["start_wall_ns"] = str(WALL + 1 + rng.randrange(-50 * MS, 50 * MS))
    return prof, clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--steps", type=int, default=500, help="all-reduces per rank (one per 10 ms)")
    args = ap.parse_args()
    rng = random.Random(7)
    world = args.nodes * args.ranks
    nodes = [node(i, args.ranks, world, args.steps, rng) for i in range(args.nodes)]
    t0 = time.perf_counter()
    done = join([f"node{i}" for i in range(args.nodes)], [p for p, _ in nodes])
    t1 = time.perf_counter()
    # the error left per node: its total move against the truth (its clock minus the first node's)
    errors = [abs(c.clock_ns + c.residual_ns - (clock - nodes[0][1])) for c, (_, clock) in zip(done.clocks, nodes,
                                                                                             strict=True)]
    with tempfile.TemporaryDirectory() as d:
        files, traces = write_traces(done.profile, Path(d) / "job")
        t2 = time.perf_counter()
        ets = sum(1 for f in files if f.name.endswith(".et"))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {"nodes": args.nodes, "ranks_per_node": args.ranks, "steps": args.steps,
           "events": len(done.profile.events), "join_s": round(t1 - t0, 2), "chakra_s": round(t2 - t1, 2),
           "peak_rss_mb": round(rss_mb), "worst_clock_error_us": round(max(errors) / 1000, 1), "et_files": ets,
           "rule_problems": len(traces.problems)}
    print(json.dumps(row))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "join_scale.json").write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
