"""What aiflame costs a launch-bound training loop (issue #25's steps/s targets, CPU proxy): steps of 100 kernel
launches, each after some microseconds of Python work as a step's dispatch is (bench/gpu/launch_py.py steps: the
-shared build of tests/cuda/launch_loop.cu through ctypes, 20 Python calls deep; no GPU, so every launch fails at
once but is made and probed). The job runs pinned to one CPU and aiflame to another, as on a GPU host where the
agent does not share the training thread's core: what is left is what the job itself pays (BPF at its samples and
probes, the kernel's uprobe traps). Rounds interleave: alone, `profile` with CPU sampling only, with the runtime
probes, and with the daemon's defaults (19 Hz, 20 launch stacks a second); the ratios are medians over rounds of
each profiled run's steps/s against the alone run of its round, and the same for steps per second of the job's
own CPU time (`process_time`: what the job paid, interrupts and uprobe traps included, less sensitive to the VM's
speed swings). Results: bench/results/launch_steps.json.

    python bench/launch_steps.py [--seconds 10] [--rounds 5] [--work-us 90] [--python PY] [--attach WINDOWS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from common import PROFILE_MODES, REPO, aiflame_cmd, conditions, save
from launch_rate import PY_DRIVER, _build

MODES = {m: PROFILE_MODES[m] for m in ("cpu", "probes", "daemon")}
# for comparison (--modes): profile's launch stacks at the daemon's rate, and each call's return probed on its own
# (as before uprobe session links)
MORE_MODES = {"probes_19hz": ["--no-gpu-samples", "-F", "19"], "probes_separate": PROFILE_MODES["probes_separate"],
              "probes_19hz_separate": ["--no-gpu-samples", "-F", "19", "--separate-return-probes"]}
ALL_MODES = MODES | MORE_MODES
# with --attach: a window with nothing attached, measured like the others (the bench's own bias and spread)
NONE = "none"


def _result(stdout: str) -> dict[str, float]:
    line = next((ln for ln in stdout.splitlines() if ln.startswith('{"hot"')), "")  # the job's own line
    if not line:
        raise SystemExit(f"the loop printed no result:\n{stdout[-2000:]}")
    return dict(json.loads(line))


def run(job: list[str], mode: str, out: Path, job_cpu: int, agent_cpu: int) -> dict[str, float]:
    pinned = ["taskset", "-c", str(job_cpu), *job]
    if mode == "alone":
        proc = subprocess.run(pinned, capture_output=True, text=True, check=True)
        return _result(proc.stdout)
    from aiflame.core.capture import read_capture

    cmd = ["taskset", "-c", str(agent_cpu), *aiflame_cmd("profile", "-q", "--force", "-o", str(out), "--formats",
                                                        "folded", *ALL_MODES[mode], "--", *pinned)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"aiflame profile ({mode}) failed ({proc.returncode}):\n{proc.stdout[-1500:]}"
                         f"{proc.stderr[-1500:]}")
    res = _result(proc.stdout)
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    c = cap.footer.counters
    res.update({"calls_counted": c.get("calls_counted", 0), "calls_lost": c.get("call_lost", 0),
                "samples": len(cap.samples), "agent_cpu_s": cap.footer.agent_cpu_s})
    return res


def _rate(log: list[tuple[int, int]], a: int, b: int) -> float:
    """Steps a second between CLOCK_MONOTONIC times `a` and `b`, from the job's (time, steps) lines."""
    inside = [(t, n) for t, n in log if a <= t <= b]
    if len(inside) < 2:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / ((inside[-1][0] - inside[0][0]) / 1e9)


def attach(job: list[str], modes: list[str], windows: int, seconds: float, tmp: Path,
           settle_s: float = 0.5) -> dict[str, object]:
    """One job for the whole bench; `aiflame profile --pid` attaches for `seconds` at a time, each mode in turn,
    with as long a gap between captures. Each window's rate (from `settle_s` after the capture began to its end) is
    compared with the gaps on either side of it: the VM's speed drifts over tens of seconds, and the windows
    are compared with their neighbours only."""
    from aiflame.core.capture import read_capture

    total = windows * len(modes) * (2 * seconds + 4) + 2 * seconds
    proc = subprocess.Popen(["taskset", "-c", "1", *job[:3], str(total), "log", job[5]], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    spans: list[tuple[str, int, int]] = []
    done = False
    try:
        time.sleep(seconds)
        for w in range(windows):
            for m in modes:
                if m == NONE:
                    t0 = time.monotonic_ns()
                    time.sleep(seconds)
                    spans.append((m, t0, time.monotonic_ns()))
                    time.sleep(seconds)
                    continue
                out = tmp / f"attach{w}{m}"
                subprocess.run(["taskset", "-c", "0", *aiflame_cmd(
                    "profile", "-q", "--force", "-o", str(out), "--formats", "folded", *ALL_MODES[m],
                    "--pid", str(proc.pid), "-d", str(seconds))], cwd=REPO, check=True, capture_output=True)
                cap = read_capture(out / "profile.aiflame")
                assert cap.footer is not None
                spans.append((m, cap.header.start_mono_ns, cap.footer.end_mono_ns))
                time.sleep(seconds)
        done = True
    finally:
        if not done:
            proc.kill()  # a failed window: not the job's whole run to wait out
        lines = proc.communicate()[0].splitlines()
    log = [(int(t), int(n)) for t, n in (ln.split() for ln in lines if ln and ln[0].isdigit())]
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for i, (m, a, b) in enumerate(spans):
        before = _rate(log, (spans[i - 1][2] if i else log[0][0]) + 500_000_000, a)
        after = _rate(log, b + 500_000_000, spans[i + 1][1] if i + 1 < len(spans) else log[-1][0])
        inside = _rate(log, a + int(settle_s * 1e9), b)
        if before and after and inside:
            ratios[m].append(inside / ((before + after) / 2))
    for m, rs in ratios.items():
        print(f"{m} (attached, {len(rs)} windows of {seconds:.0f} s): steps/s "
              f"{statistics.median(rs):.3f}x its neighbours (median; windows {min(rs):.3f}-{max(rs):.3f})")
    return {m: {"ratio_median": statistics.median(rs), "ratios": rs} for m, rs in ratios.items() if rs}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10, help="steps timed per run (10)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work-us", type=float, default=90, help="Python work before each launch, in us (90)")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs the loop")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, of {', '.join(ALL_MODES)} (default {','.join(MODES)}); with "
                         f"--attach also {NONE} (a window with nothing attached)")
    ap.add_argument("--settle", type=float, default=0.5, metavar="S",
                    help="with --attach: each window's rate from S seconds after its capture began (0.5)")
    ap.add_argument("--attach", type=int, default=0, metavar="WINDOWS",
                    help="instead of a job per run, one job and `profile --pid` attached WINDOWS times per mode for "
                         "--seconds each, each window against the gaps beside it")
    a = ap.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        print("launch_steps: skipped, needs two CPUs (the job pinned to one, aiflame to the other)")
        return 0
    modes = a.modes.split(",")
    if unknown := set(modes) - set(ALL_MODES) - ({NONE} if a.attach else set()):
        raise SystemExit(f"launch_steps: unknown mode(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(ALL_MODES)})")
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="aiflame-launch-steps-") as tmp:
        lib = _build(Path(tmp), shared=True)
        cal = subprocess.run([a.python, str(PY_DRIVER), str(lib), "0", "calibrate", str(a.work_us)],
                             capture_output=True, text=True, check=True)
        spin = int(json.loads(cal.stdout)["spin"])
        job = [a.python, str(PY_DRIVER), str(lib), str(a.seconds), "steps", str(spin)]
        if a.attach:
            found = attach(job, modes, a.attach, a.seconds, Path(tmp), a.settle)
            save("launch_steps_attach", {"bench": "launch_steps --attach", "seconds": a.seconds, "settle_s": a.settle,
                                         "spin": spin, "work_us": a.work_us, "modes": found, **conditions()})
            return 0
        for r in range(a.rounds):
            row = {m: run(job, m, Path(tmp) / f"{m}{r}", 1, 0) for m in ("alone", *modes)}
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{m} {v['steps_per_s']:.1f} steps/s ({v['steps_per_cpu_s']:.1f} a "
                                             "CPU second)" for m, v in row.items()) +
                  "; " + ", ".join(f"{m} {v['calls_counted']:.0f} launches counted, {v['calls_lost']:.0f} lost"
                                   for m, v in row.items() if m != "alone" and m != "cpu"), flush=True)
    summary: dict[str, object] = {}
    alone = statistics.median(r["alone"]["steps_per_s"] for r in rounds)
    print(f"alone: {alone:.1f} steps/s ({alone * 100:.0f} launches/s) median of {a.rounds}")
    for m in modes:
        ratio = statistics.median(r[m]["steps_per_s"] / r["alone"]["steps_per_s"] for r in rounds)
        per_cpu = statistics.median(r[m]["steps_per_cpu_s"] / r["alone"]["steps_per_cpu_s"] for r in rounds)
        cpu = statistics.median(r[m]["agent_cpu_s"] for r in rounds)
        summary[m] = {"steps_per_s_ratio": ratio, "steps_per_job_cpu_s_ratio": per_cpu, "agent_cpu_s": cpu}
        print(f"{m}: steps/s {ratio:.3f}x alone, steps per second of the job's CPU {per_cpu:.3f}x (medians of "
              f"{a.rounds} rounds); agent CPU {cpu:.2f} s a run")
    save("launch_steps", {"bench": "launch_steps", "seconds": a.seconds, "work_us": a.work_us, "spin": spin,
                          "alone_steps_per_s": alone, "modes": summary, "rounds": rounds,
                          "method": "job pinned to CPU 1, aiflame to CPU 0; rounds interleave alone and each mode; "
                                    "ratio = median over rounds of profiled / alone of the same round",
                          **conditions()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
