"""Python target slowdown at 99 Hz: none vs aiflame (in-kernel walker) vs py-spy (`py-spy record`, its default
blocking mode), in one run with rotated order; medians and best-of over repetitions. Also aiflame's in-kernel cost
per sample with the Python walk (kernel.bpf_stats_enabled) and its agent CPU per second.

Target: bench/py_work.py on pyenv 3.12 (2 threads sharing the GIL), started gated so the work begins only after
the profiler is attached."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    REPO,
    aiflame_cmd,
    bpf_prog_stats,
    capture_figures,
    conditions,
    run_quiet,
    save,
    set_bpf_stats,
    wait_for,
)

PY = "/root/.pyenv/versions/3.12.1/bin/python"
PY_SPY = str(Path(sys.executable).with_name("py-spy"))


def run(mode: str, rounds: int, hz: int, tmp: Path) -> dict[str, float]:
    target = subprocess.Popen([PY, str(REPO / "bench" / "py_work.py"), str(rounds)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    prof = None
    if mode == "aiflame":
        prof = run_quiet(aiflame_cmd("profile", "-q", "-p", str(target.pid), "-F", str(hz), "-o", str(tmp / "a"),
                                     "--formats", "folded"))
        assert wait_for(lambda: (tmp / "a" / "profile.aiflame.partial").exists(), 120)
    elif mode == "py-spy":
        prof = run_quiet([PY_SPY, "record", "--pid", str(target.pid), "-r", str(hz), "-f", "raw",
                          "-o", str(tmp / "pyspy.txt")])
    time.sleep(1.5)  # let the profiler settle (aiflame: detect CPython; py-spy: attach)
    assert target.stdin is not None
    target.stdin.write("g")
    target.stdin.close()
    stats = (0, 0)
    while target.poll() is None:
        if mode == "aiflame" and prof is not None:
            try:
                stats = bpf_prog_stats(prof.pid)
            except OSError:
                pass
        time.sleep(0.1)
    assert target.stdout is not None
    wall, cpu = (float(x) for x in target.stdout.read().split())
    out = {"wall_s": wall, "cpu_s": cpu}
    if prof is not None:
        prof.send_signal(signal.SIGINT)
        try:
            prof.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            prof.kill()
    if mode == "aiflame":
        figures = capture_figures(tmp / "a" / "profile.aiflame")
        out.update((k, figures[k]) for k in ("agent_cpu_pct", "py_samples", "samples"))
        if stats[1]:
            out["bpf_ns_per_run"] = stats[0] / stats[1]
        shutil.rmtree(tmp / "a", ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=6000, help="spin(2000) calls per thread (~3 s here)")
    ap.add_argument("--hz", type=int, default=99)
    args = ap.parse_args()
    modes = ["none", "aiflame", "py-spy"]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    set_bpf_stats(True)
    try:
        with tempfile.TemporaryDirectory() as td:
            for rep in range(args.reps):
                for m in modes[rep % 3:] + modes[: rep % 3]:
                    r = run(m, args.rounds, args.hz, Path(td))
                    runs[m].append(r)
                    print(f"rep {rep} {m}: {json.dumps(r)}", flush=True)
    finally:
        set_bpf_stats(False)

    def slow(m: str, key: str, f: str) -> float:
        agg = statistics.median if f == "median" else min
        return 100 * (agg(r[key] for r in runs[m]) / agg(r[key] for r in runs["none"]) - 1)

    result = {
        "conditions": {**conditions(), "interpreter": PY, "hz": args.hz, "reps": args.reps, "rounds": args.rounds},
        "slowdown_pct": {f"{m}_{k}_{f}": slow(m, k, f) for m in ("aiflame", "py-spy") for k in ("wall_s", "cpu_s")
                         for f in ("median", "min")},
        "bpf_ns_per_sample_with_walk": statistics.median(r["bpf_ns_per_run"] for r in runs["aiflame"]
                                                         if "bpf_ns_per_run" in r),
        "agent_cpu_pct_of_core": statistics.median(r["agent_cpu_pct"] for r in runs["aiflame"]),
        "python_sample_share": statistics.median(r["py_samples"] / max(1, r["samples"]) for r in runs["aiflame"]),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    print(f"saved {save('python_overhead', result)}")


if __name__ == "__main__":
    main()
