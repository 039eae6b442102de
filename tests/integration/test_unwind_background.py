"""A host's first capture of a torch process, for real: with the runtime probes, every library the target opens
stops it, and libtorch_cpu's unwind table (17 MiB of .eh_frame, ~0.5 s to build) is not in the empty cache. It
is built in the background while the target runs on (agent/kernel/unwind.py), its mapping scanned past meanwhile,
and the walks through libtorch once it is stored are those of a capture whose tables were all cached."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from aiflame.core.capture import read_capture
from aiflame.core.unwind import END, USED_FP, USED_SCAN, stop_of
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.integration.conftest import aiflame
from tests.unwind_oracle import TORCH_WORK, cpp_under_python, share

CPU_S = "5"  # the dispatcher loop's seconds of CPU after the import: ~450 samples of it at 99 Hz


def _capture(out: Path, cache: Path) -> tuple[dict[str, int], float, int, float, int]:
    """One capture of the dispatcher loop under `profile` (probes on) with `cache` as aiflame's cache: its
    counters; the share of the loop's samples (those under `step`) with libtorch's C++ frames under it; the
    share of the samples of the capture's last half (the loop's) walked by CFI alone to the outermost frame."""
    aiflame("profile", "-q", "-F", "99", "--formats", "folded", "-o", str(out), "--", sys.executable,
            str(TORCH_WORK), CPU_S, timeout=600, env={"AIFLAME_CACHE": str(cache)})
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    prof = symbolize_capture(cap, NativeSymbolizer(), StackOptions(group="none", kernel=False, native_interp=True))
    loop = [s.stack for s in prof.samples if any(f.name == "step" for f in s.stack)]
    t0, t1 = min(s.time_ns for s in cap.samples), max(s.time_ns for s in cap.samples)
    late = [s.unwind for s in cap.samples if s.time_ns >= (t0 + t1) // 2]
    return (dict(cap.footer.counters), share(loop, cpp_under_python), len(loop),
            share(late, lambda u: stop_of(u) == END and not u & (USED_FP | USED_SCAN)), len(late))


def test_a_first_capture_builds_big_tables_in_the_background(tmp_path: Path) -> None:
    # Oracle: the same program captured again with every table cached (the first capture filled the cache)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    cold, cold_share, cold_n, cold_cfi, cold_late = _capture(tmp_path / "cold", cache)
    warm, warm_share, warm_n, warm_cfi, warm_late = _capture(tmp_path / "warm", cache)
    print(f"cold: {cold_share:.3f} of {cold_n} loop samples with C++ under Python, {cold_cfi:.3f} of {cold_late} "
          f"late ones walked by CFI alone, {cold.get('unwind_tables_background', 0)} tables built in the background; "
          f"warm: {warm_share:.3f} of {warm_n}, {warm_cfi:.3f} of {warm_late}, "
          f"{warm.get('unwind_tables_background', 0)}")
    assert cold.get("unwind_tables_background", 0) >= 1  # libtorch_cpu's, at least
    assert warm.get("unwind_tables_background", 0) == 0  # cached: read at the stop
    assert cold.get("unwind_table_errors", 0) == 0 and warm.get("unwind_table_errors", 0) == 0
    assert cold_n > 250 and warm_n > 250, (cold_n, warm_n)
    assert warm_share > 0.3, warm_share
    # The loop runs after the import: by then the table built in the background is in the pool, and the two
    # shares differ by sampling alone (4 sigma of the two-proportion test; without the table stored, the
    # loop's walks are scans only: 0.68 against 0.84)
    sigma = math.sqrt(warm_share * (1 - warm_share) * (1 / cold_n + 1 / warm_n))
    assert cold_share >= warm_share - max(0.03, 4 * sigma), (cold_share, warm_share, sigma)
    # and walked the same way: by the tables (without them stored: scans and frame pointers)
    sigma = math.sqrt(warm_cfi * (1 - warm_cfi) * (1 / cold_late + 1 / warm_late))
    assert warm_cfi > 0.5 and cold_cfi >= warm_cfi - max(0.03, 4 * sigma), (cold_cfi, warm_cfi, sigma)
