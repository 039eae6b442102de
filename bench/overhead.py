"""Target slowdown at 99 Hz: no profiler vs aiflame vs bcc's `profile`, in one run, as ratios (medians over
repetitions, order rotated). Also the in-kernel cost per sample (kernel.bpf_stats_enabled) of both programs
and aiflame's own CPU per second of capture.

The target (examples/bench_work, 2 threads on a 2-CPU host) waits until the profiler is attached, then does a
fixed amount of work and prints its wall and CPU time. CPU time is the steadier figure on a shared VM (a
neighbour's steal shows in wall time only)."""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import (
    EXAMPLES,
    aiflame_cmd,
    bpf_prog_stats,
    capture_figures,
    conditions,
    holds_perf_prog,
    run_quiet,
    save,
    set_bpf_stats,
    wait_for,
)

BCC_PROFILE = "/usr/sbin/profile-bpfcc"


def steal_ticks() -> int:
    """Ticks stolen from this VM by its host (noise the slowdown figures cannot see otherwise)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def run_target(mode: str, threads: int, iters: int, delay: float, hz: int, tmp: Path) -> dict[str, float]:
    target = subprocess.Popen([str(EXAMPLES / "bench_work"), str(threads), str(iters), "-1"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    prof = None
    out: dict[str, float] = {}
    if mode == "aiflame":
        prof = run_quiet(aiflame_cmd("profile", "-q", "-p", str(target.pid), "-F", str(hz), "-o", str(tmp / "a"),
                                     "--formats", "folded"))
    elif mode == "bcc":
        prof = run_quiet([BCC_PROFILE, "-F", str(hz), "-p", str(target.pid), "-f", "600"])
    # Start the work only once the profiler is sampling (compiling BPF takes seconds of CPU).
    if mode == "aiflame":
        ready = wait_for(lambda: (tmp / "a" / "profile.aiflame.partial").exists(), 120)
    elif mode == "bcc":
        assert prof is not None
        ready = wait_for(lambda: holds_perf_prog(prof.pid), 120)
    else:
        ready = True
    assert ready, f"{mode} did not start"
    time.sleep(delay)
    steal0 = steal_ticks()
    assert target.stdin is not None
    target.stdin.write("g")
    target.stdin.close()
    # Sample the BPF program counters just before the target finishes.
    stats = (0, 0)
    while target.poll() is None:
        if prof is not None:
            try:
                stats = bpf_prog_stats(prof.pid)
            except OSError:
                pass
        time.sleep(0.2)
    wall, cpu = (float(x) for x in target.stdout.read().split()) if target.stdout else (0.0, 0.0)
    out["work_s"] = wall
    out["cpu_s"] = cpu
    out["steal_ticks"] = steal_ticks() - steal0
    if prof is not None:
        prof.send_signal(signal.SIGINT)
        try:
            prof.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            prof.kill()
        if stats[1]:
            out["bpf_ns_per_run"] = stats[0] / stats[1]
            out["bpf_runs"] = stats[1]
    if mode == "aiflame":
        figures = capture_figures(tmp / "a" / "profile.aiflame")
        out.update((k, figures[k]) for k in ("agent_cpu_pct", "samples", "lost"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=1200, help="thousands of rounds per thread (~6 s here)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--delay", type=float, default=1.0, help="settle time after attach")
    ap.add_argument("--hz", type=int, default=99)
    args = ap.parse_args()
    modes = ["none", "aiflame", "bcc"]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    set_bpf_stats(True)
    try:
        with tempfile.TemporaryDirectory() as td:
            for rep in range(args.reps):
                order = modes[rep % 3:] + modes[: rep % 3]
                for m in order:
                    r = run_target(m, args.threads, args.iters, args.delay, args.hz, Path(td))
                    runs[m].append(r)
                    print(f"rep {rep} {m}: {json.dumps(r)}", flush=True)
    finally:
        set_bpf_stats(False)
    def slow(m: str, key: str = "work_s", stat: str = "median") -> float:
        f = statistics.median if stat == "median" else min
        return 100 * (f(r[key] for r in runs[m]) / f(r[key] for r in runs["none"]) - 1)

    def med(m: str, key: str) -> float:
        vals = [r[key] for r in runs[m] if key in r]
        return statistics.median(vals) if vals else float("nan")

    result = {
        "conditions": {**conditions(), "threads": args.threads, "hz": args.hz, "reps": args.reps,
                       "baseline_work_s_median": statistics.median(r["work_s"] for r in runs["none"])},
        "slowdown_pct": {
            f"{m}_{key}_{stat}": slow(m, key, stat)
            for m in ("aiflame", "bcc") for key in ("work_s", "cpu_s") for stat in ("median", "min")
        },
        "slowdown_vs_bcc_points": {
            f"{key}_{stat}": slow("aiflame", key, stat) - slow("bcc", key, stat)
            for key in ("work_s", "cpu_s") for stat in ("median", "min")
        },
        "steal_ticks_total": sum(r["steal_ticks"] for rs in runs.values() for r in rs),
        "bpf_ns_per_sample": {"aiflame": med("aiflame", "bpf_ns_per_run"), "bcc_profile": med("bcc", "bpf_ns_per_run")},
        "agent_cpu_pct_of_core": med("aiflame", "agent_cpu_pct"),
        "aiflame_lost": sum(r.get("lost", 0) for r in runs["aiflame"]),
        "runs": runs,
    }
    path = save("overhead", result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
