"""A host's first capture of a torch process, for real: with the runtime probes, every library the target opens
stops it, and libtorch_cpu's unwind table (17 MiB of .eh_frame, ~0.5 s to build) is not in the empty cache. It
is built in the background while the target runs on (agent/kernel/unwind.py), its mapping scanned past meanwhile,
and the walks through libtorch once it is stored are those of a capture whose tables were all cached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aiflame.core.capture import read_capture
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.conftest import REPO
from tests.unwind_oracle import TORCH_WORK, cpp_under_python, share

CPU_S = "3"  # the dispatcher loop's seconds of CPU after the import


def _capture(out: Path, cache: Path) -> tuple[dict[str, int], float, int]:
    """One capture of the dispatcher loop under `profile` (probes on) with `cache` as aiflame's cache: its
    counters, and the share of the loop's samples (those under `step`) with libtorch's C++ frames under it."""
    proc = subprocess.run([sys.executable, "-m", "aiflame", "profile", "-q", "-F", "99", "--formats", "folded",
                           "-o", str(out), "--", sys.executable, str(TORCH_WORK), CPU_S], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "AIFLAME_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    prof = symbolize_capture(cap, NativeSymbolizer(), StackOptions(group="none", kernel=False, native_interp=True))
    loop = [s.stack for s in prof.samples if any(f.name == "step" for f in s.stack)]
    return dict(cap.footer.counters), share(loop, cpp_under_python), len(loop)


def test_a_first_capture_builds_big_tables_in_the_background(tmp_path: Path) -> None:
    # Oracle: the same program captured again with every table cached (the first capture filled the cache)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    cold, cold_share, cold_n = _capture(tmp_path / "cold", cache)
    warm, warm_share, warm_n = _capture(tmp_path / "warm", cache)
    print(f"cold: {cold_share:.3f} of {cold_n} loop samples with C++ under Python, "
          f"{cold.get('unwind_tables_background', 0)} tables built in the background; "
          f"warm: {warm_share:.3f} of {warm_n}, {warm.get('unwind_tables_background', 0)}")
    assert cold.get("unwind_tables_background", 0) >= 1  # libtorch_cpu's, at least
    assert warm.get("unwind_tables_background", 0) == 0  # cached: read at the stop
    assert cold.get("unwind_table_errors", 0) == 0 and warm.get("unwind_table_errors", 0) == 0
    assert cold_n > 150 and warm_n > 150, (cold_n, warm_n)
    assert warm_share > 0.3, warm_share
    # the loop runs after the import: by then the table built in the background is in the pool
    assert cold_share >= warm_share - 0.05, (cold_share, warm_share)
