"""DDP step time over gloo with and without `aiflame profile` attached: examples/ddp_gloo.py (2 ranks, CPU
PyTorch, OMP_NUM_THREADS=1) run plainly, under `aiflame profile -- CMD` (CPU sampling + gloo probes), and under
`aiflame profile --no-runtimes -- CMD` (CPU sampling only), in rotated order, same steps and inputs each time.

Step time: the program's own per-step wall time (forward, backward with DDP's all-reduces, optimizer), both
ranks, skipping the first SKIP steps (DDP's bucket rebuild, warm-up); median over steps, then over repetitions.
Also the process CPU per step (all threads of a rank): a probe's trap and BPF program are charged to the probed
thread, so this shows the probes' own cost even when other load on the host makes wall times noisy.
Prints one JSON line and saves bench/results/gloo.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, aiflame_cmd, conditions, save

SKIP = 3
EXAMPLE = REPO / "examples" / "ddp_gloo.py"
MODES = ("none", "aiflame", "aiflame_no_runtimes")


def run(mode: str, steps: int, tmp: Path) -> dict[str, float]:
    expect = tmp / f"{mode}.jsonl"
    target = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--expect", str(expect)]
    out = tmp / mode
    if mode == "none":
        cmd = target
    else:
        extra = ["--no-runtimes"] if mode == "aiflame_no_runtimes" else []
        cmd = aiflame_cmd("profile", "-q", "-o", str(out), "--force", "--formats", "folded", *extra, "--", *target)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    recs = [json.loads(line) for line in expect.read_text().splitlines()]
    res = {out_key: 1000 * statistics.median(s for r in recs for s in r[key][SKIP:])
           for key, out_key in (("step_s", "step_ms"), ("step_cpu_s", "step_cpu_ms"))}
    if mode != "none":
        from aiflame.core.capture import read_capture

        cap = read_capture(out / "profile.aiflame")
        gloo = [e for e in cap.events if e.runtime == "gloo"]
        res["gloo_events"] = len(gloo)
        res["collectives"] = sum(1 for e in gloo if e.kind == "collective")
        res["probe_hits"] = cap.footer.counters.get("calls", 0) if cap.footer else 0
        if cap.footer:
            elapsed = (cap.footer.end_mono_ns - cap.header.start_mono_ns) / 1e9
            res["agent_cpu_pct"] = 100 * cap.footer.agent_cpu_s / elapsed
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="aiflame-gloo-") as td:
        for rep in range(args.reps):
            for m in MODES[rep % 3:] + MODES[: rep % 3]:
                runs[m].append(run(m, args.steps, Path(td)))
                print(f"rep {rep} {m}: {json.dumps(runs[m][-1])}", file=sys.stderr, flush=True)

    def med(m: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[m])

    base, cpu_base = med("none", "step_ms"), med("none", "step_cpu_ms")
    result = {
        "bench": "gloo_ddp_step",
        "conditions": {**conditions(), "steps": args.steps, "skipped_steps": SKIP, "reps": args.reps, "ranks": 2},
        "step_ms": {m: round(med(m, "step_ms"), 3) for m in MODES},
        "slowdown_pct": {m: round(100 * (med(m, "step_ms") / base - 1), 2) for m in MODES[1:]},
        "step_cpu_ms": {m: round(med(m, "step_cpu_ms"), 3) for m in MODES},
        "cpu_overhead_pct": {m: round(100 * (med(m, "step_cpu_ms") / cpu_base - 1), 2) for m in MODES[1:]},
        "probe_hits_per_run": med("aiflame", "probe_hits"),
        "collectives_per_run": med("aiflame", "collectives"),
        "agent_cpu_pct_of_core": round(med("aiflame", "agent_cpu_pct"), 1),
    }
    save("gloo", {**result, "runs": runs})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
