"""Kernel launches at 10k and 40k a second for 60 s from a deep native stack, under `aiflame profile` (issue #25's
"zero loss at 10k+ launches/s, exact per-kernel counts"): tests/cuda/launch_loop.cu, built with the NVIDIA wheels'
nvcc; without a GPU every launch fails at once but is made, so the probes see each one. Prints, per rate, the
launches the program made and aiflame counted (per kernel), records kept, lost, and the agent's CPU time.
With --python PY the same loop runs as a library called from a Python function 20 calls deep
(bench/gpu/launch_py.py), and the share of launches whose stack carries that Python function is printed too
(issue #25: ">= 95 % of launches carry the Python line that caused them"; launches counted in BPF without a record
of their own stand under the record of their kernel that carries their count). Results:
bench/results/launch_rate.json.

    python bench/launch_rate.py [--seconds 60] [--rates 10000,40000] [--python /root/.pyenv/versions/3.12.1/bin/python3]
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

PY_DRIVER = REPO / "bench" / "gpu" / "launch_py.py"


def _build(work: Path, shared: bool) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.cuda_build import CUDA_DIR, build_cuda

    name = "liblaunch_loop.so" if shared else "launch_loop"
    return build_cuda(CUDA_DIR / "launch_loop.cu", work / name, gencodes=(90,), shared_lib=shared)


def run(cmd: list[str], out: Path, seconds: float, rate: int) -> dict[str, object]:
    from aiflame.core.capture import read_capture
    from aiflame.core.model import EventKind, FrameKind
    from aiflame.symbolize.stacks import StackOptions, symbolize_capture

    proc = subprocess.run(aiflame_cmd("profile", "-q", "--force", "-o", str(out), "--formats", "folded", "--",
                                      *cmd, str(seconds), str(rate)), cwd=REPO, capture_output=True, text=True,
                          check=True)
    made = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    counted: Counter[str] = Counter()
    with_python = 0
    for e in symbolize_capture(cap, options=StackOptions(group="none")).events:
        if e.kind == EventKind.COMPUTE:
            counted[e.name] += e.calls
            if any(f.kind == FrameKind.PYTHON and f.name == "launch_from_python" for f in e.stack):
                with_python += e.calls
    c = cap.footer.counters
    total = sum(counted.values())
    return {"rate": rate, "seconds": seconds, "made": made, "counted": dict(counted),
            "exact": dict(counted) == made, "records": c.get("calls", 0), "counted_in_bpf": c.get("call_skipped", 0),
            "lost": c.get("call_lost", 0), "agent_cpu_s": cap.footer.agent_cpu_s,
            "python_share": with_python / total if total else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rates", default="10000,40000")
    ap.add_argument("--python", default="", help="launch from this Python through ctypes (bench/gpu/launch_py.py)")
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="aiflame-launch-rate-") as tmp:
        built = _build(Path(tmp), shared=bool(a.python))
        cmd = [a.python, str(PY_DRIVER), str(built)] if a.python else [str(built)]
        for rate in (int(r) for r in a.rates.split(",")):
            r = run(cmd, Path(tmp) / f"r{rate}", a.seconds, rate)
            rows.append(r)
            print(f"{rate}/s for {a.seconds:.0f} s: made {r['made']}, counted {r['counted']} (exact: {r['exact']}); "
                  f"{r['records']} records, {r['counted_in_bpf']} counted in BPF, {r['lost']} lost; agent CPU "
                  f"{r['agent_cpu_s']:.1f} s" + (f"; launches under launch_from_python {r['python_share']:.1%}"
                                                 if a.python else ""), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "launch_rate.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exact"] and not r["lost"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
