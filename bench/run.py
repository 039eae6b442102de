"""`make bench`: every benchmark in turn; results land in bench/results/*.json (BENCHMARKS.md quotes them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = [
    ["overhead.py"],
    ["bpf_cost.py"],
    ["loss.py"],
    ["python_overhead.py"],
    ["bench_symbolize.py"],
    ["bench_uprobe.py"],
    ["bench_fatbin.py"],
    ["bench_gloo.py"],
    ["bench_daemon.py"],
    ["daemon_torch.py"],
    ["split_bias.py", "--runs", "5", "--seconds", "30"],
    ["split_bias.py", "--cost-s", "20"],
    ["bench_unwind.py"],
    ["launch_rate.py"],
    ["launch_steps.py", "--seconds", "5", "--rounds", "3"],
    ["gpu_host.py", "--device", "cpu", "--small", "--seconds", "8", "--rounds", "2"],  # the CPU side, as a proxy
    ["start_time.py"],
    ["perfetto_size.py", "--seconds", "5,20"],
    ["join_scale.py"],
    ["trigger_at.py"],
]


def main() -> int:
    failed = []
    for b in BENCHES:
        print(f"== {' '.join(b)}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / b[0]), *b[1:]], cwd=HERE.parent)
        if rc:
            failed.append(b[0])
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
