"""How long `aiflame profile -q -d 1 -- CMD` takes to start CMD and to finish, with the BPF compile cache off (every
run compiles, as before the cache), cold (an empty cache: compile and store) and warm (loaded from the cache).

CMD is `sh -c 'date +%s.%N > FILE; exec sleep 5'`: the launcher holds it until the sampler runs, so the time it
writes, less the time aiflame was started, is when the command really started. Each mode runs --runs times
(cold with a fresh cache directory each time, warm with one directory primed by a run first); medians, min and
max go to bench/results/start_time.json. Run as root; another busy process on the host shows in every figure
(the kernel's verifier, most of a warm start, is CPU-bound)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, aiflame_cmd, conditions, save

from aiflame.agent.kernel.bpf_cache import ENV


def one_run(cache: str, tmp: Path, i: int) -> tuple[float, float]:
    """(seconds until CMD started, seconds until aiflame exited)."""
    stamp = tmp / f"started.{i}"
    cmd = aiflame_cmd("profile", "-q", "-d", "1", "-o", str(tmp / f"out.{i}"), "--",
                      "sh", "-c", f"date +%s.%N > {stamp}; exec sleep 5")
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, env={**os.environ, ENV: cache}, check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    return float(stamp.read_text()) - t0, wall


def figures(runs: list[tuple[float, float]]) -> dict[str, float]:
    starts, walls = [r[0] for r in runs], [r[1] for r in runs]
    return {"start_median_s": statistics.median(starts), "start_min_s": min(starts), "start_max_s": max(starts),
            "wall_median_s": statistics.median(walls), "wall_min_s": min(walls), "wall_max_s": max(walls),
            "runs": len(runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("start_time.py needs root (BPF)", file=sys.stderr)
        return 1
    results: dict[str, object] = {"conditions": conditions(), "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="aiflame-start-") as d:
        tmp = Path(d)
        modes: dict[str, list[tuple[float, float]]] = {"off": [], "cold": [], "warm": []}
        one_run(str(tmp / "warm-cache"), tmp, -1)  # primes the warm cache
        # Interleaved, so a change in the host's load falls on every mode alike.
        for i in range(args.runs):
            modes["off"].append(one_run("off", tmp, 3 * i))
            cold = tmp / f"cold-cache.{i}"
            modes["cold"].append(one_run(str(cold), tmp, 3 * i + 1))
            shutil.rmtree(cold)
            modes["warm"].append(one_run(str(tmp / "warm-cache"), tmp, 3 * i + 2))
        for mode, runs in modes.items():
            results[mode] = figures(runs)
            f = results[mode]
            assert isinstance(f, dict)
            print(f"{mode:5}: command started after {f['start_median_s']:.2f} s "
                  f"({f['start_min_s']:.2f}-{f['start_max_s']:.2f}), done after {f['wall_median_s']:.2f} s "
                  f"({f['wall_min_s']:.2f}-{f['wall_max_s']:.2f}), median of {f['runs']}", flush=True)
    results["load_after"] = os.getloadavg()[0]
    print(f"saved {save('start_time', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
