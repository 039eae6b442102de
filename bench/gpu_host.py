"""What aiflame costs a GPT-style training loop, and what it sees of it (issue #25): bench/gpu/gpt_loop.py run
alone and under `aiflame profile -- CMD` in each mode, alternating, printing for each mode the steps/s ratio
against the alone runs next to it, the job's wall time, runtime calls recorded / counted / lost, the share of CPU
samples whose walk reached the outermost frame, the share of launches under a Python frame, the agent's CPU (the
whole run's, and over the loop's timed steps alone) and peak RSS.

Modes: `cpu` (CPU sampling only, --no-runtimes --no-gpu-samples), `probes` (CPU sampling and runtime probes, no
CUPTI), `full` (the defaults: CUPTI too, with a GPU), `probes_separate` (returns probed on their own), `daemon`
(the daemon's defaults). On a GPU host: `bash .gpu/host.sh python3 bench/gpu_host.py`.
Without a GPU, `--device cpu` runs the same loop on the CPU with the CPU build of torch (no launches: a proxy for
the CPU side only). Results: bench/results/gpu_host.json.

    python bench/gpu_host.py [--device cuda] [--seconds 15] [--warmup 3] [--modes cpu,probes,full] [--rounds 2]
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

import psutil
from common import PROFILE_MODES, REPO, RESULTS, aiflame_cmd, vm_hwm_kb

LOOP = REPO / "bench" / "gpu" / "gpt_loop.py"
FREQ: list[str] = []  # --frequency: -F for aiflame profile
PYTHON = [sys.executable]  # the interpreter running the loop (--python: a side venv with the CUDA build of torch)
# probes_separate: the launch counts must match probes'; full: the defaults, CUPTI too (with a GPU)
MODES = PROFILE_MODES | {"full": []}


def _steps(stdout: str) -> dict[str, float]:
    line = next((ln for ln in stdout.splitlines() if ln.startswith('{"steps"')), "")
    if not line:
        raise SystemExit(f"gpt_loop printed no result:\n{stdout[-2000:]}")
    out: dict[str, float] = json.loads(line)
    return out


def run_alone(loop_args: Sequence[str]) -> dict[str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([*PYTHON, str(LOOP), *loop_args], capture_output=True, text=True, check=True)
    return {**_steps(proc.stdout), "wall_s": time.monotonic() - t0}


def _steady_cpu_pct(trace: list[tuple[float, float]], seconds: float) -> float:
    """The agent's CPU, in % of a core, over the loop's timed steps (its last `seconds` before it exited, less a
    second at each end): past the start-up's table builds and before the capture is symbolized."""
    if len(trace) < 2:
        return 0.0
    end = trace[-1][0] - 1.0
    start = max(trace[0][0], end - seconds + 2.0)
    inside = [(t, c) for t, c in trace if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return 0.0
    return 100 * (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def run_profiled(mode: str, loop_args: Sequence[str], out: Path, after_s: float = 8.0) -> dict[str, float]:
    """One run under `aiflame profile`: the loop's own figures, the capture's counters, the agent's peak RSS, and
    the walks' share past the first `after_s` seconds (the import's start-up left out, bench/steady_share.py)."""
    from steady_share import shares

    from aiflame.core.capture import read_capture
    from aiflame.core.model import EventKind, FrameKind
    from aiflame.symbolize.stacks import StackOptions, symbolize_capture

    t0 = time.monotonic()
    proc = subprocess.Popen(aiflame_cmd("profile", "-q", "--force", "-o", str(out), "--formats", "folded",
                                        *MODES[mode], *FREQ, "--", *PYTHON, str(LOOP), *loop_args),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hwm = 0
    agent = psutil.Process(proc.pid)
    trace: list[tuple[float, float]] = []  # (time, the agent's CPU seconds) while the job runs
    while proc.poll() is None:
        hwm = max(hwm, vm_hwm_kb(proc.pid))
        try:
            job_alive = bool(agent.children())
            if job_alive:
                t = agent.cpu_times()
                trace.append((time.monotonic(), t.user + t.system))
        except psutil.Error:
            pass
        time.sleep(0.1)
    stdout = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"aiflame profile ({mode}) failed ({proc.returncode}):\n{stdout[-2000:]}")
    res = {**_steps(stdout), "wall_s": time.monotonic() - t0, "agent_peak_rss_mb": hwm / 1024}
    res["agent_steady_cpu_pct"] = _steady_cpu_pct(trace, res["seconds"])
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    c = cap.footer.counters
    prof = symbolize_capture(cap, options=StackOptions(group="none"))
    launches = [e for e in prof.events if e.kind == EventKind.COMPUTE]
    n_launch = sum(e.calls for e in launches)
    with_py = sum(e.calls for e in launches if any(f.kind == FrameKind.PYTHON for f in e.stack))
    walks = prof.counters.get("unwind_cfi", 0)
    res.update({
        "agent_cpu_s": cap.footer.agent_cpu_s,
        "job_s": (cap.footer.end_mono_ns - cap.header.start_mono_ns) / 1e9,
        "calls_recorded": c.get("calls", 0), "calls_counted": c.get("calls_counted", 0),
        "calls_lost": c.get("call_lost", 0), "launches": n_launch,
        "launches_with_python_pct": 100 * with_py / n_launch if n_launch else 0.0,
        "walks_reaching_outermost_pct": 100 * prof.counters.get("unwind_end", 0) / walks if walks else 0.0,
        "unwind_tables_evicted": c.get("unwind_tables_evicted", 0),
        "cpu_samples": len(cap.samples),
        **{f"stop_{k.removeprefix('unwind_')}": float(v) for k, v in {**c, **prof.counters}.items()
           if k.startswith("unwind_") and k != "unwind_cfi"},
        "python_samples": prof.counters.get("python_samples", 0),
        "python_spliced_at_root": prof.counters.get("python_spliced", 0),
        "python_mismatched": prof.counters.get("python_mismatched", 0),
        "unwind_tables_loaded": c.get("unwind_tables_loaded", 0),
        "unwind_rows": c.get("unwind_rows", 0),
    })
    steady = shares(str(out / "profile.aiflame"), after_s)[f"after {after_s:g} s"]
    res.update({"walks_reaching_outermost_after_pct": steady["outermost_pct"],
                "python_spliced_after_pct": steady["python_spliced_pct"]})
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (a GPU host), or cpu for the CPU-side proxy")
    ap.add_argument("--seconds", type=float, default=15, help="steps counted after the warm-up (15)")
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--modes", default="cpu,probes,full", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--rounds", type=int, default=2, help="alone / profiled pairs per mode (2)")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python that runs the loop (a side venv's, e.g. one with the CUDA build of torch)")
    ap.add_argument("--frequency", type=int, default=0, help="aiflame's sampling rate (default: its own, 99 Hz)")
    ap.add_argument("--small", action="store_true", help="a small model (1 layer, d=128, seq 64), for a quick try")
    ap.add_argument("--map-cudnn", action="store_true",
                    help="the loop maps every libcudnn*.so.9 before its warm-up (as a GPU job's first attention does)")
    ap.add_argument("--after", type=float, default=8.0,
                    help="the walks' share is also given past this many seconds of the capture (8)")
    a = ap.parse_args(argv)
    PYTHON[:] = [a.python]
    FREQ[:] = ["-F", str(a.frequency)] if a.frequency else []
    modes = [m for m in a.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode {unknown[0]!r} (known: {', '.join(MODES)})")
    loop_args = ["--device", a.device, "--seconds", str(a.seconds), "--warmup", str(a.warmup)]
    if a.small:
        loop_args += ["--layers", "1", "--d", "128", "--seq", "64", "--batch", "4"]
    if a.map_cudnn:
        loop_args.append("--map-cudnn")
    results: dict[str, object] = {"device": a.device, "python": a.python, "frequency": a.frequency or 99,
                                   "loop": loop_args, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="aiflame-gpu-host-") as tmp:
        for mode in modes:
            pairs = []
            for r in range(a.rounds):  # alone, profiled, alone, profiled...: drift shows in both
                alone = run_alone(loop_args)
                prof = run_profiled(mode, loop_args, Path(tmp) / f"{mode}{r}", a.after)
                pairs.append((alone, prof))
                print(f"{mode} round {r}: alone {alone['steps_per_s']:.1f} steps/s, profiled "
                      f"{prof['steps_per_s']:.1f} ({prof['steps_per_s'] / alone['steps_per_s']:.3f}x); "
                      f"calls {prof['calls_counted']:.0f} counted / {prof['calls_recorded']:.0f} recorded / "
                      f"{prof['calls_lost']:.0f} lost; launches with Python {prof['launches_with_python_pct']:.1f}%;"
                      f" walks to outermost {prof['walks_reaching_outermost_pct']:.1f}% "
                      f"({prof['walks_reaching_outermost_after_pct']:.1f}% past {a.after:g} s); agent CPU "
                      f"{prof['agent_cpu_s']:.1f} s of {prof['job_s']:.1f} s "
                      f"(steps: {prof['agent_steady_cpu_pct']:.1f}%), RSS {prof['agent_peak_rss_mb']:.0f} MB; "
                      f"wall {alone['wall_s']:.1f} -> {prof['wall_s']:.1f} s; Python samples {prof['python_samples']}, "
                      f"{prof['python_spliced_at_root']} spliced at the root; "
                      + ", ".join(f"{k[5:]} {v:.0f}" for k, v in prof.items() if k.startswith("stop_")), flush=True)
            ratios = [p["steps_per_s"] / al["steps_per_s"] for al, p in pairs]
            summary = {"steps_ratio_median": statistics.median(ratios), "ratios": ratios,
                       "runs": [{"alone": al, "profiled": p} for al, p in pairs]}
            results["modes"][mode] = summary  # type: ignore[index]
            print(f"== {mode}: steps/s ratio median {summary['steps_ratio_median']:.3f} over {len(ratios)} pairs")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu_host.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS / 'gpu_host.json'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
