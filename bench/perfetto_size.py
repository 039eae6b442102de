"""How large and how slow the timeline of a long job is (issue #25: 107 MB of JSON for one rank's 77 s): a
synthetic GPT-style rank at 10,000 kernel launches a second with an all-reduce every 20 ms and 99 Hz CPU samples,
exported as `perfetto` (Perfetto's protobuf) and `perfetto-json` (Chrome's trace-event JSON), for a few lengths.
Prints size, bytes per launch and export time per format; results in bench/results/perfetto_size.json.

    python bench/perfetto_size.py [--seconds 5,20] [--launch-rate 10000]
"""

from __future__ import annotations

import argparse
import json
import time

from common import RESULTS

from aiflame.core.model import EventKind, Frame, FrameKind, Profile, Sample, TraceEvent
from aiflame.exporters import get_exporter

KERNELS = [f"void at::native::kernel_{i}<float>(at::native::Args)" for i in range(40)]


def job(seconds: float, launch_rate: int) -> Profile:
    prof = Profile(meta={"frequency_hz": "99"})
    pid, tid = 4242, 4242
    frames = (Frame("python3", FrameKind.PROCESS), Frame("train.py:step", FrameKind.PYTHON),
              Frame("at::native::launch", FrameKind.NATIVE))
    step = 1_000_000_000 // launch_rate
    end = int(seconds * 1e9)
    for i, t in enumerate(range(0, end, step)):
        prof.events.append(TraceEvent("cudaLaunchKernel", EventKind.COMPUTE, t, 3000, pid, tid, 0, 0, frames,
                                      {"runtime": "cuda", "call": "cudaLaunchKernel", "stream": 7,
                                       "kernel": KERNELS[i % len(KERNELS)]}))
    for t in range(0, end, 20_000_000):
        prof.events.append(TraceEvent("ncclAllReduce", EventKind.COLLECTIVE, t + 15_000_000, 2_000_000, pid, tid + 1,
                                      0, 0, frames, {"runtime": "nccl", "call": "ncclAllReduce", "bytes": 1 << 24,
                                                     "rank": 0, "world_size": 1}))
    prof.samples += [Sample(frames, 1, pid, tid, "python3", 0, t) for t in range(0, end, 1_000_000_000 // 99)]
    return prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", default="5,20", help="job lengths to export, comma-separated (default 5,20)")
    ap.add_argument("--launch-rate", type=int, default=10_000, help="kernel launches per second (default 10000)")
    args = ap.parse_args()
    rows = []
    for seconds in (float(s) for s in args.seconds.split(",")):
        prof = job(seconds, args.launch_rate)
        launches = sum(1 for e in prof.events if e.kind == EventKind.COMPUTE)
        for fmt in ("perfetto", "perfetto-json"):
            t0 = time.perf_counter()
            data = get_exporter(fmt).render(prof)
            took = time.perf_counter() - t0
            rows.append({"seconds": seconds, "format": fmt, "launches": launches, "bytes": len(data),
                         "bytes_per_launch": round(len(data) / launches, 1), "export_s": round(took, 2)})
            print(f"{seconds:5.0f} s  {fmt:14} {len(data) / 1e6:8.1f} MB  {len(data) / launches:6.1f} B/launch  "
                  f"{took:6.2f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "perfetto_size.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
