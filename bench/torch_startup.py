"""Start-up of a torch job alone and under `aiflame profile` (issue #25): bench/gpu/gpt_loop.py (--small, one
second of steps) run alone, under profile with CPU sampling only, and with the runtime probes (their target
stops at each new library it opens), interleaved --rounds times. Prints the medians of the loop's own start-up
(its start to its first step: torch's import and the model), of the job's wall time as the job sees it (its
start to its last step, by the clock: issue #25's target is "the job's wall time under aiflame <= 1.05x alone +
2 s") and of the whole command's.

    python bench/torch_startup.py [--python /work/torchcuda-venv/bin/python] [--rounds 3] [--device cpu] [--cold]
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

from common import PROFILE_MODES, REPO, RESULTS, aiflame_cmd

LOOP = REPO / "bench" / "gpu" / "gpt_loop.py"
MODES: dict[str, list[str] | None] = {"alone": None, "cpu": PROFILE_MODES["cpu"], "probes": PROFILE_MODES["probes"]}


def _run(mode: str, python: str, device: str, out: Path, cache: Path | None = None) -> dict[str, float]:
    loop = [python, str(LOOP), "--device", device, "--seconds", "1", "--warmup", "0", "--layers", "1", "--d", "128",
            "--seq", "64", "--batch", "4"]
    loop = ["sh", "-c", 'date +%s.%N; exec "$@"', "sh", *loop]  # the job's start, as a clock time
    extra = MODES[mode]
    cmd = loop if extra is None else aiflame_cmd("profile", "-q", "--force", "-o", str(out), "--formats", "folded",
                                                 *extra, "--", *loop)
    env = None
    if cache is not None:  # --cold: aiflame's table and symbol cache empty, as on a host's first capture
        cache.mkdir(mode=0o700)
        env = {**os.environ, "AIFLAME_CACHE": str(cache)}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    wall = time.monotonic() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith('{"steps"')), "")
    if proc.returncode or not line:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    res: dict[str, float] = json.loads(line)
    res["wall_s"] = wall
    res["job_s"] = res.pop("end_unix") - float(proc.stdout.split(None, 1)[0])
    if extra is not None:
        from aiflame.core.capture import read_capture
        cap = read_capture(out / "profile.aiflame")
        assert cap.footer is not None
        res["capture_s"] = (cap.footer.end_mono_ns - cap.header.start_mono_ns) / 1e9
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the Python that runs the loop (a side venv's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true",
                    help="each profiled run with an empty table and symbol cache (AIFLAME_CACHE), as a host's first")
    a = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="aiflame-startup-") as tmp:
        for r in range(a.rounds):
            for mode in MODES:
                cache = Path(tmp) / f"cache-{mode}{r}" if a.cold and MODES[mode] is not None else None
                res = _run(mode, a.python, a.device, Path(tmp) / f"{mode}{r}", cache)
                runs[mode].append(res)
                print(f"round {r} {mode}: start-up {res['startup_s']:.2f} s, job {res['job_s']:.2f} s, command "
                      f"{res['wall_s']:.1f} s" + (f", capture {res['capture_s']:.1f} s" if "capture_s" in res else ""),
                      flush=True)
    summary = {m: {"startup_s_median": statistics.median(x["startup_s"] for x in v),
                   "job_s_median": statistics.median(x["job_s"] for x in v),
                   "wall_s_median": statistics.median(x["wall_s"] for x in v), "runs": v} for m, v in runs.items()}
    for m, s in summary.items():
        print(f"== {m}: start-up median {s['startup_s_median']:.2f} s, job median {s['job_s_median']:.2f} s, "
              f"command median {s['wall_s_median']:.1f} s")
    alone = statistics.median(x["job_s"] for x in runs["alone"])
    for m in ("cpu", "probes"):
        job = statistics.median(x["job_s"] for x in runs[m])
        print(f"== {m}: job {job / alone:.2f}x alone; the target (1.05x alone + 2 s) is {1.05 * alone + 2:.2f} s: "
              + ("met" if job <= 1.05 * alone + 2 else "NOT met"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "torch_startup.json").write_text(json.dumps({"python": a.python, "cold_cache": a.cold,
                                                             "modes": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
