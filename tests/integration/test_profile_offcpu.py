"""`profile --off-cpu` for real: where threads block and for how long, with their Python frames, in the offcpu view
and beside the CPU samples in the wall view."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from aiflame.core.capture import OFF_CPU_FORMAT_VERSION, read_capture
from aiflame.core.errors import Unreadable
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.conftest import PROGRAMS, REPO
from tests.integration.conftest import HANG_S, aiflame, read_folded, wait_until

SPLIT = PROGRAMS / "offcpu_split.py"
PYTHON = "/usr/bin/python3"  # Debian's: its evaluator frames merge with the Python ones (as on every interpreter)
# 1 s asleep and 1 s of CPU time, however busy the host, in slices short enough that the first calls (made before
# the agent has found the interpreter: their stacks lack Python frames) shift the split by a point at most.
ROUNDS, SLICE_S = 50, 0.02


def _py_share(folded: dict[str, int], function: str) -> int:
    """The weight of stacks holding the Python function `function` (labels `py::NAME (FILE:LINE)`)."""
    return sum(c for st, c in folded.items() if any(f.startswith(f"py::{function} (") for f in st.split(";")))


def test_wall_view_splits_half_asleep_half_on_cpu_evenly(tmp_path: Path) -> None:
    """Oracle: the program's construction: each round sleeps SLICE_S in `sleeper` and computes SLICE_S of its own
    CPU time in `computer`. Blocked time is counted to the wakeup (not the wait for a CPU after it) and CPU
    samples weigh one sampling period, so the split holds on a loaded host."""
    out = tmp_path / "split"
    aiflame("profile", "-q", "--off-cpu", "-F", "999", "-o", str(out), "--", PYTHON, str(SPLIT), str(ROUNDS),
            str(SLICE_S))
    for view in ("profile", "offcpu", "wall"):
        assert (out / f"{view}.svg").read_text().startswith("<?xml"), view
    wall = read_folded(out / "wall.folded")
    asleep, computing = _py_share(wall, "sleeper"), _py_share(wall, "computer")
    split = 100 * asleep / (asleep + computing)
    print(f"wall view: sleeper {split:.1f} %, computer {100 - split:.1f} % "
          f"({asleep / 1e9:.3f} s blocked, {computing / 1e9:.3f} s on CPU)")
    assert abs(split - 50) <= 5, (asleep, computing)

    offcpu = read_folded(out / "offcpu.folded")
    assert offcpu and all(st.split(";")[-1].startswith("[off-cpu") for st in offcpu), offcpu
    sleeps = [st.split(";") for st in offcpu if any(f.startswith("py::sleeper (") for f in st.split(";"))]
    assert sleeps, offcpu
    for frames in sleeps:  # merged: Python caller above, the blocking call and the kernel's sleep below
        names = [f.split(" (")[0] for f in frames]
        assert names.index("py::main") < names.index("py::sleeper") < names.index("clock_nanosleep"), frames
        assert "schedule_[k]" in names and names[-1] == "[off-cpu]", frames
    cpu = read_folded(out / "profile.folded")
    assert _py_share(cpu, "computer") > 500 and not any("[off-cpu" in st for st in cpu)
    assert _py_share(cpu, "sleeper") <= 0.02 * sum(cpu.values())  # asleep is not on CPU

    cap = read_capture(out / "profile.aiflame")
    assert cap.header.format_version == OFF_CPU_FORMAT_VERSION
    assert cap.footer is not None and cap.footer.counters["offcpu"] >= ROUNDS
    assert cap.footer.counters["offcpu_lost"] == 0 and cap.footer.counters["offcpu_unpaired"] == 0
    # Each sleep is one block, from its start to its timer's expiry (the wait for a CPU after it is not blocked
    # time): not shorter than asked but for the time from the call to the switch, hardly longer. On a loaded
    # host a preemption in between (the deadline is taken before the syscall) shortens a sleep now and then
    # (CI: one such in 50), so the bound holds for nearly all of them, and the typical sleep is as asked.
    prof = symbolize_capture(cap, options=StackOptions(group="none"))
    sleep_ns = sorted(s.weight for s in prof.off_cpu if any(f.name == "sleeper" for f in s.stack))
    assert len(sleep_ns) >= ROUNDS // 2, len(sleep_ns)
    outside = [w for w in sleep_ns if not 0.99 * SLICE_S * 1e9 <= w <= 1.25 * SLICE_S * 1e9]
    assert len(outside) <= 0.1 * len(sleep_ns), (outside, len(sleep_ns))
    assert 1.0 * SLICE_S * 1e9 <= sleep_ns[len(sleep_ns) // 2] <= 1.05 * SLICE_S * 1e9, sleep_ns
    # `export --view wall` gives what profile wrote
    aiflame("export", str(out / "profile.aiflame"), "--view", "wall", "-f", "folded", "-o",
            str(tmp_path / "w.folded"))
    assert read_folded(tmp_path / "w.folded") == wall


WAITER = textwrap.dedent("""\
    import os, sys, time

    def poll(go):
        while not os.path.exists(go):
            time.sleep(0.01)

    def long_wait(flag):
        open(flag, "w").close()
        time.sleep(600)

    poll(sys.argv[1])
    long_wait(sys.argv[2])
""")


def _described(partial: Path) -> bool:
    """Whether the capture being written holds a process's mappings and its Python runtime."""
    try:
        cap = read_capture(partial, partial=True)
    except (Unreadable, FileNotFoundError):
        return False
    return bool(cap.processes and cap.py_runtimes)


def test_a_thread_blocked_when_the_capture_ends_is_blocked_until_then(tmp_path: Path) -> None:
    """Oracle: the test's own clock: the target starts a 600 s sleep, the capture is interrupted a second later,
    so that block is at least about a second long and ends where the capture does."""
    script, go, sleeping = tmp_path / "waiter.py", tmp_path / "go", tmp_path / "sleeping"
    script.write_text(WAITER)
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "aiflame", "profile", "-q", "--off-cpu", "-o", str(out), "--",
                             PYTHON, str(script), str(go), str(sleeping)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the target's Python walker and mappings are in (its blocks get their Python frames from then on)
        wait_until(lambda: _described(out / "profile.aiflame.partial") or proc.poll() is not None,
                   "the target's Python runtime in the capture")
        go.touch()
        wait_until(lambda: sleeping.exists() or proc.poll() is not None, "the target asleep")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None and cap.footer.stop_reason == "interrupted"
    prof = symbolize_capture(cap, options=StackOptions(group="none"))
    # On a loaded host the flag's open() in long_wait may block too, for a moment: one block in long_wait lasts
    # past the interrupt, any other is short.
    waits = [s for s in prof.off_cpu if any(f.name == "long_wait" for f in s.stack)]
    long = [s for s in waits if s.weight >= 0.5e9]
    assert len(long) == 1, [([f.name for f in s.stack], s.weight) for s in waits]
    assert all(s.weight < 0.1e9 for s in waits if s not in long), [s.weight for s in waits]
    (w,) = long
    assert 0.5e9 <= w.weight < 60e9, w.weight
    assert w.time_ns + w.weight <= cap.footer.end_mono_ns
