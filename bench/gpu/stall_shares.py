"""Stall-sample shares per kernel against GPU time (issue #26's check): reads the stall view as folded stacks
(`aiflame export --view stalls -f folded`) and the JSON line two_kernels printed (CUDA-event milliseconds per
kernel), prints one JSON line: each kernel's share of stall samples and of GPU time, the largest difference in
points, and the share the old accounting (CUPTI's `*_not_issued` added as samples) would have shown.

    python3 stall_shares.py STALLS.folded RUN.json
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def kernel_samples(folded: str) -> tuple[Counter[str], Counter[str]]:
    """Samples per kernel, and per kernel with the not-issued samples counted a second time (the old way)."""
    now: Counter[str] = Counter()
    old: Counter[str] = Counter()
    for line in folded.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if "-" not in frames or not n.isdigit():
            continue
        kernel = frames[frames.index("-") + 1].removesuffix("_[G]")
        now[kernel] += int(n)
        old[kernel] += int(n) * (2 if frames[-1] == "not issued_[g]" else 1)
    return now, old


def main(argv: list[str]) -> int:
    folded, run = Path(argv[0]).read_text(), Path(argv[1]).read_text()
    times = next(json.loads(ln) for ln in run.splitlines() if ln.startswith("{"))
    gpu = {k.removesuffix("_ms"): float(v) for k, v in times.items() if k.endswith("_ms")}
    now, old = kernel_samples(folded)
    total_t, total_n, total_o = sum(gpu.values()), sum(now[k] for k in gpu), sum(old[k] for k in gpu)
    if not total_n:
        print(json.dumps({"error": "no stall samples of these kernels", "kernels": sorted(now)}))
        return 1
    rows = {k: {"gpu_time": round(100 * gpu[k] / total_t, 2), "stall_samples": round(100 * now[k] / total_n, 2),
                "old_accounting": round(100 * old[k] / total_o, 2), "samples": now[k]} for k in gpu}
    worst = max(abs(r["gpu_time"] - r["stall_samples"]) for r in rows.values())
    print(json.dumps({"kernels": rows, "max_diff_points": round(worst, 2), "other_kernels": sum(now.values())
                      - total_n}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
