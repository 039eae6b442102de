"""Kernel launches at 10k and 40k a second for 60 s from a deep native stack, under `aiflame profile` (issue #25's
"zero loss at 10k+ launches/s, exact per-kernel counts"): tests/cuda/launch_loop.cu, built with the NVIDIA wheels'
nvcc; without a GPU every launch fails at once but is made, so the probes see each one. Prints, per rate, the
launches the program made and aiflame counted (per kernel), records kept, lost, and the agent's CPU time.
Results: bench/results/launch_rate.json.

    python bench/launch_rate.py [--seconds 60] [--rates 10000,40000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from common import REPO, RESULTS, aiflame_cmd


def _build(work: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.cuda_build import CUDA_DIR, build_cuda

    return build_cuda(CUDA_DIR / "launch_loop.cu", work / "launch_loop", gencodes=(90,))


def run(loop: Path, out: Path, seconds: float, rate: int) -> dict[str, object]:
    from aiflame.core.capture import read_capture
    from aiflame.core.model import EventKind
    from aiflame.symbolize.stacks import StackOptions, symbolize_capture

    proc = subprocess.run(aiflame_cmd("profile", "-q", "--force", "-o", str(out), "--formats", "folded", "--",
                                      str(loop), str(seconds), str(rate)), cwd=REPO, capture_output=True, text=True,
                          check=True)
    made = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    counted: Counter[str] = Counter()
    for e in symbolize_capture(cap, options=StackOptions(group="none")).events:
        if e.kind == EventKind.COMPUTE:
            counted[e.name] += e.calls
    c = cap.footer.counters
    return {"rate": rate, "seconds": seconds, "made": made, "counted": dict(counted),
            "exact": dict(counted) == made, "records": c.get("calls", 0), "counted_in_bpf": c.get("call_skipped", 0),
            "lost": c.get("call_lost", 0), "agent_cpu_s": cap.footer.agent_cpu_s}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rates", default="10000,40000")
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="aiflame-launch-rate-") as tmp:
        loop = _build(Path(tmp))
        for rate in (int(r) for r in a.rates.split(",")):
            r = run(loop, Path(tmp) / f"r{rate}", a.seconds, rate)
            rows.append(r)
            print(f"{rate}/s for {a.seconds:.0f} s: made {r['made']}, counted {r['counted']} (exact: {r['exact']}); "
                  f"{r['records']} records, {r['counted_in_bpf']} counted in BPF, {r['lost']} lost; agent CPU "
                  f"{r['agent_cpu_s']:.1f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "launch_rate.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exact"] and not r["lost"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
