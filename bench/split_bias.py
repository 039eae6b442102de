"""Sampling bias on a periodic workload: profile bench/split_work.py (two threads running f60, f30, f10 in a fixed
order) several times at a low rate and report each run's shares against the CPU time each function really used
(measured by the workload itself, the oracle), in points. A sampler on a regular clock can lock onto the loop's
period; a randomized one must stay within a few points.

Usage: python bench/split_bias.py [--runs 5] [--python PY ...] [-F 99] [--seconds 10] [--quantum-ms 20]
       python bench/split_bias.py --cost-s 20 [-F 99]   (in-kernel cost per kept sample, jittered vs regular)
SPLIT_CLOCK=wall in the environment makes the workload spin on the wall clock (see split_work.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench" / "split_work.py"
NAMES = ("f60", "f30", "f10")


def shares(folded: Path) -> dict[str, float]:
    """Per-function share (%) of the samples whose stack holds one of the three functions."""
    counts = dict.fromkeys(NAMES, 0)
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        for name in NAMES:
            if any(f.removeprefix("py::").split(" ", 1)[0] == name for f in frames):
                counts[name] += int(n)
                break
    total = sum(counts.values()) or 1
    return {k: 100.0 * v / total for k, v in counts.items()}


def one_run(python: str, freq: int, seconds: float, quantum_ms: float,
            extra: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """(sampled shares, true shares), both in %."""
    with tempfile.TemporaryDirectory() as tmp:
        truth = Path(tmp) / "truth.json"
        cmd = [sys.executable, "-m", "aiflame", "profile", "-q", "-F", str(freq), "--no-runtimes", "-o", tmp,
               "--formats", "folded", *extra, "--", python, str(WORK), str(seconds), str(quantum_ms), str(truth)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        used = json.loads(truth.read_text())
        total = sum(used.values()) or 1.0
        return shares(Path(tmp) / "profile.folded"), {k: 100.0 * used[k] / total for k in NAMES}


def cost(freq: int, seconds: float, python: str) -> int:
    """bpf_stats run time of the sampler's programs per kept sample: jittered (aiflame's default thinning, the
    early exits included) over a regular clock at the asked rate, two sessions on one split_work.py at once."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_unwind import cost_figures
    from common import set_bpf_stats

    set_bpf_stats(True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            r = cost_figures(Path(tmp), [python, str(WORK), str(seconds + 30), "20", str(Path(tmp) / "truth.json")],
                             seconds, (f"cfi:{freq}:0", f"cfi:{freq}:1"))
    finally:
        set_bpf_stats(False)
    jit, reg = r[f"cfi:{freq}:0"], r[f"cfi:{freq}:1"]
    assert isinstance(jit, dict) and isinstance(reg, dict)
    print(f"jittered: {jit['ns_per_sample'] / 1000:.2f} us per kept sample ({jit['samples']} samples, "
          f"{sum(p['runs'] for p in jit['programs'].values())} program runs); regular: "
          f"{reg['ns_per_sample'] / 1000:.2f} us ({reg['samples']} samples); ratio {r['ratio']:.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--python", action="append", default=[])
    ap.add_argument("-F", "--frequency", type=int, default=99)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--quantum-ms", type=float, default=20.0)
    ap.add_argument("--extra", default="", help="extra `aiflame profile` arguments, space-separated")
    ap.add_argument("--cost-s", type=float, default=0.0,
                    help="instead: the in-kernel cost per kept sample of the jittered sampler against a regular "
                         "clock (keep_one_in 1), both on one workload at once, over windows of this many seconds")
    args = ap.parse_args()
    if args.cost_s:
        return cost(args.frequency, args.cost_s, args.python[0] if args.python else sys.executable)
    pythons = args.python or ["/root/.pyenv/versions/3.11.7/bin/python3.11"]
    worst_all = 0.0
    for py in pythons:
        errs = []
        for i in range(args.runs):
            s, true = one_run(py, args.frequency, args.seconds, args.quantum_ms, args.extra.split())
            err = max(abs(s[k] - true[k]) for k in NAMES)
            errs.append(err)
            print(f"{py} run {i + 1}: " + "  ".join(f"{k} {s[k]:5.1f}% (true {true[k]:4.1f})" for k in NAMES)
                  + f"  worst error {err:4.1f} pt", flush=True)
        worst_all = max(worst_all, max(errs))
        print(f"{py}: worst {max(errs):.1f} pt, median {statistics.median(errs):.1f} pt over {args.runs} runs")
    print(f"worst over all: {worst_all:.1f} pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
