"""How long `aiflame profile -q -d 1 -- CMD` takes to start CMD and to finish, with the BPF compile cache off (every
run compiles, as before the cache), cold (an empty cache: compile and store) and warm (loaded from the cache).

CMD is `sh -c 'date +%s.%N > FILE; exec sleep 5'`: the launcher holds it until the sampler runs, so the time it
writes, less the time aiflame was started, is when the command really started. Each mode runs --runs times
(cold with a fresh cache directory each time, warm with one directory primed by a run first); medians, min and
max go to bench/results/start_time.json. Run as root; another busy process on the host shows in every figure
(the kernel's verifier, most of a warm start, is CPU-bound).

--against CHECKOUT runs the same modes with another checkout's aiflame (e.g. `git worktree add /tmp/base main`),
interleaved with this one's, run by run, so that the host's load falls on both alike; the ratios of the medians
(this / against) are printed and saved with both sets of figures."""

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


def one_run(cache: str, tmp: Path, i: int, checkout: Path = REPO) -> tuple[float, float]:
    """(seconds until CMD started, seconds until aiflame exited), with the aiflame of `checkout` (`python -m
    aiflame` run in its root imports that one)."""
    stamp = tmp / f"started.{i}"
    cmd = aiflame_cmd("profile", "-q", "-d", "1", "-o", str(tmp / f"out.{i}"), "--",
                      "sh", "-c", f"date +%s.%N > {stamp}; exec sleep 5")
    t0 = time.time()
    subprocess.run(cmd, cwd=checkout, env={**os.environ, ENV: cache}, check=True, stdout=subprocess.DEVNULL)
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
    ap.add_argument("--modes", default="off,cold,warm", help="which of off, cold, warm to run (comma-separated)")
    ap.add_argument("--against", type=Path, metavar="CHECKOUT",
                    help="another checkout's root: its aiflame runs too, interleaved, and the ratios are printed")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("start_time.py needs root (BPF)", file=sys.stderr)
        return 1
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"off", "cold", "warm"}:
        ap.error("--modes takes off, cold and warm")
    checkouts = {"this": REPO} | ({"against": args.against.resolve()} if args.against else {})
    results: dict[str, object] = {"conditions": conditions(), "load_before": os.getloadavg()[0]}
    if args.against:
        results["checkouts"] = {k: str(v) for k, v in checkouts.items()}
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {(c, m): [] for c in checkouts for m in modes}
    with tempfile.TemporaryDirectory(prefix="aiflame-start-") as d:
        tmp = Path(d)
        k = 0
        for c, checkout in checkouts.items():
            if "warm" in modes:
                one_run(str(tmp / f"warm-cache-{c}"), tmp, k, checkout)  # primes the warm cache
                k += 1
        # Interleaved, so a change in the host's load falls on every mode (and checkout) alike; the checkouts
        # take turns going first.
        for i in range(args.runs):
            order = list(checkouts.items())
            for c, checkout in (order if i % 2 == 0 else order[::-1]):
                for mode in modes:
                    if mode == "warm":
                        runs[(c, mode)].append(one_run(str(tmp / f"warm-cache-{c}"), tmp, k, checkout))
                    elif mode == "cold":
                        cold = tmp / f"cold-cache-{c}.{i}"
                        runs[(c, mode)].append(one_run(str(cold), tmp, k, checkout))
                        shutil.rmtree(cold)
                    else:
                        runs[(c, mode)].append(one_run("off", tmp, k, checkout))
                    k += 1
    per_checkout: dict[str, dict[str, dict[str, float]]] = {c: {} for c in checkouts}
    for (c, mode), rs in runs.items():
        f = figures(rs)
        per_checkout[c][mode] = f
        if not args.against:
            results[mode] = f
        print(f"{c + ' ' if args.against else ''}{mode:5}: command started after {f['start_median_s']:.2f} s "
              f"({f['start_min_s']:.2f}-{f['start_max_s']:.2f}), done after {f['wall_median_s']:.2f} s "
              f"({f['wall_min_s']:.2f}-{f['wall_max_s']:.2f}), median of {f['runs']}", flush=True)
    if args.against:
        results |= per_checkout
        ratios = {}
        for mode in modes:
            this, other = per_checkout["this"][mode], per_checkout["against"][mode]
            ratios[mode] = {"start": this["start_median_s"] / other["start_median_s"],
                            "done": this["wall_median_s"] / other["wall_median_s"]}
            print(f"{mode:5}: this / against: started {ratios[mode]['start']:.2f}x, done {ratios[mode]['done']:.2f}x")
        results["ratios"] = ratios
    results["load_after"] = os.getloadavg()[0]
    print(f"saved {save('start_time', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
