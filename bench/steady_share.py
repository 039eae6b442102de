"""Shares of a capture's CPU samples after its start-up (issue #25): of the samples from --after seconds past the
first one, how many walks reached the outermost frame, why the others stopped, and how many samples with Python
frames had some spliced at the root, next to the same figures for the whole capture.

    python bench/steady_share.py CAPTURE.aiflame [--after 8]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from common import REPO

sys.path.insert(0, str(REPO))

from aiflame.core.capture import read_capture  # noqa: E402
from aiflame.symbolize.stacks import StackOptions, symbolize_capture  # noqa: E402


def shares(path: str, after_s: float) -> dict[str, dict[str, float]]:
    cap = read_capture(Path(path))
    if not cap.samples:
        raise SystemExit(f"{path}: no samples")
    t0 = min(s.time_ns for s in cap.samples)
    everything = list(cap.samples)
    out = {}
    for label, kept in (("whole", everything), (f"after {after_s:g} s", [
            s for s in everything if s.time_ns >= t0 + after_s * 1e9])):
        cap.samples = kept
        c = symbolize_capture(cap, options=StackOptions(group="none")).counters
        walks = c.get("unwind_cfi", 0)
        py = c.get("python_samples", 0)
        out[label] = {"samples": len(kept), "walks": walks,
                      "outermost_pct": 100 * c.get("unwind_end", 0) / walks if walks else 0.0,
                      "depth": c.get("unwind_depth", 0), "no_mapping": c.get("unwind_no_mapping", 0),
                      "evicted": c.get("unwind_evicted", 0), "python_samples": py,
                      "python_spliced_pct": 100 * c.get("python_spliced", 0) / py if py else 0.0}
    cap.samples = everything
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture")
    ap.add_argument("--after", type=float, default=8.0, help="seconds of start-up left out (8)")
    a = ap.parse_args(argv)
    for label, r in shares(a.capture, a.after).items():
        print(f"{label}: {r['samples']} samples, {r['walks']} walks, {r['outermost_pct']:.1f} % to the outermost "
              f"frame (stops: depth {r['depth']}, no mapping {r['no_mapping']}, evicted {r['evicted']}); "
              f"{r['python_samples']} with Python frames, {r['python_spliced_pct']:.1f} % spliced at the root")
    return 0


if __name__ == "__main__":
    sys.exit(main())
