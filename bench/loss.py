"""Lost samples at 999 Hz with every CPU busy in the target for DURATION seconds (goal: 0)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from common import EXAMPLES, aiflame_cmd, conditions, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--hz", type=int, default=999)
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "loss"
        # Enough work to outlast the capture; the capture stops at -d and the target is then killed.
        iters = int(200 * (args.duration + 30))
        proc = subprocess.run(
            aiflame_cmd("profile", "-q", "-F", str(args.hz), "-d", str(args.duration), "-o", str(out),
                        "--formats", "folded", "--", str(EXAMPLES / "bench_work"), str(cpus), str(iters), "0"),
            capture_output=True, text=True,
        )
        subprocess.run(["pkill", "-f", "bench_work"], check=False)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        from aiflame.core.capture import read_capture

        cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    expected = args.hz * cpus * args.duration
    result = {
        "conditions": {**conditions(), "hz": args.hz, "duration_s": args.duration, "target_threads": cpus},
        "samples": len(cap.samples),
        "expected_samples_if_always_on_cpu": expected,
        "lost": cap.footer.counters.get("lost", 0),
        "user_stack_errors": cap.footer.counters.get("ustack_err", 0),
        "kernel_stack_errors": cap.footer.counters.get("kstack_err", 0),
        "agent_cpu_pct_of_core": 100 * cap.footer.agent_cpu_s / args.duration,
    }
    print(json.dumps(result, indent=2))
    print(f"saved {save('loss', result)}")


if __name__ == "__main__":
    main()
