"""Real captures of the example workloads: proportions, kernel frames, children, Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from aiflame.core.capture import read_capture
from tests.conftest import REPO
from tests.hostile import state
from tests.integration.conftest import HANG_S, aiflame, read_folded, share, wait_until

# The example workloads run for seconds of CPU time (a fixed amount of work), so the sample counts below hold
# however busy the host: 4 s at 499 Hz is ~2000 samples, 2 s ~1000 per process.


def test_known_split_within_5_points(examples: Path, tmp_path: Path) -> None:
    """Oracle: the workload's own split of its work (70:30 of the same inner loop, by construction)."""
    out = tmp_path / "split"
    aiflame("profile", "-q", "-F", "499", "-o", str(out), "--", str(examples / "cpu_split"), "4", "70")
    folded = read_folded(out / "profile.folded")
    a, b = share(folded, "func_a"), share(folded, "func_b")
    assert a + b > 500, folded
    assert abs(100 * a / (a + b) - 70) <= 5, (a, b)
    # main is the root of (nearly) every sample's user stack: the frame-pointer walk is complete.
    assert share(folded, "main") >= 0.95 * sum(folded.values())
    assert (out / "profile.svg").read_text().startswith("<?xml")
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None and cap.footer.stop_reason.startswith("command exited (0)")
    assert cap.footer.counters["lost"] == 0


def test_kernel_frames(examples: Path, tmp_path: Path) -> None:
    """Oracles: the workload's construction (reads of /dev/zero: most of its time in the kernel) and
    /proc/kallsyms for the kernel's names."""
    out = tmp_path / "sys"
    aiflame("profile", "-q", "-F", "499", "-o", str(out), "--", str(examples / "syscalls"), "3")
    folded = read_folded(out / "profile.folded")
    total = sum(folded.values())
    kernel = sum(c for st, c in folded.items() if st.endswith("_[k]"))
    assert kernel >= 0.5 * total, folded
    # Kernel frames sit above the user frames that made the system call (libc's read has no frame of its
    # own, so a frame-pointer walk goes from it straight to main).
    assert any(";main;" in st and ";read;entry_SYSCALL" in st for st in folded), folded
    # Kernel frames are named from kallsyms (the read path shows up by name).
    assert any(f.endswith("_[k]") and "read" in f for st in folded for f in st.split(";")), folded


def test_forked_child_is_followed(examples: Path, tmp_path: Path) -> None:
    """Oracle: the workload's construction (2 s of CPU in parent_work and in child_work, in two processes)."""
    out = tmp_path / "fork"
    aiflame("profile", "-q", "-F", "499", "-o", str(out), "--", str(examples / "forker"), "2")
    folded = read_folded(out / "profile.folded")
    assert share(folded, "child_work") > 200, folded
    assert share(folded, "parent_work") > 200, folded
    cap = read_capture(out / "profile.aiflame")
    assert len({s.pid for s in cap.samples}) == 2


def test_exec_in_child_is_followed(examples: Path, tmp_path: Path) -> None:
    # Oracle: the workload's construction (CPU in parent_work, then in child_work after exec)
    out = tmp_path / "exec"
    aiflame("profile", "-q", "-F", "499", "-o", str(out), "--", str(examples / "forker"), "2", "exec")
    folded = read_folded(out / "profile.folded")
    assert share(folded, "child_work") > 200, folded
    assert share(folded, "parent_work") > 200, folded


def test_pid_mode_and_duration(examples: Path, tmp_path: Path) -> None:
    """Oracle: the workload's construction (50:50 of the same inner loop)."""
    target = subprocess.Popen([str(examples / "cpu_split"), "20", "50"])
    try:
        out = tmp_path / "pid"
        aiflame("profile", "-q", "-p", str(target.pid), "-d", "2", "-F", "199", "-o", str(out))
        cap = read_capture(out / "profile.aiflame")
        assert cap.footer is not None and cap.footer.stop_reason == "duration"
        assert {s.pid for s in cap.samples} == {target.pid}
        folded = read_folded(out / "profile.folded")
        a, b = share(folded, "func_a"), share(folded, "func_b")
        assert abs(100 * a / (a + b) - 50) <= 10, (a, b)
    finally:
        target.kill()
        target.wait()


OPENER = """
import os, sys
d = sys.argv[1]
print("ready", flush=True)
i = 0
while True:
    path = f"{d}/lib{i}.so"  # each new .so path that opens stops it until handled
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
    os.unlink(path)
    i += 1
"""


def test_target_is_never_left_stopped(tmp_path: Path) -> None:
    """A target stopped at a library open when the capture ends is continued (it was left in state T)."""
    script = tmp_path / "opener.py"
    script.write_text(OPENER)
    for n in range(2):
        target = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
        try:
            assert target.stdout is not None and target.stdout.readline().strip() == "ready"
            aiflame("profile", "-q", "-p", str(target.pid), "-d", "1", "-o", str(tmp_path / f"o{n}"))
            # From the moment profile has exited nothing stops it: never seen stopped, in 50 looks over 1 s
            states = []
            for _ in range(50):
                states.append(state(target.pid))
                time.sleep(0.02)
            assert "T" not in states, f"run {n}: target left stopped ({states})"
        finally:
            target.kill()
            target.wait()


OPENS = """
import os, sys
d, failing, opening = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(failing):  # a loader's search: paths that do not exist
    try:
        os.open(f"{d}/missing/lib{i}.so", os.O_RDONLY)
    except OSError:
        pass
for i in range(opening):
    path = f"{d}/lib{i}.so.1"
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
    os.unlink(path)
    os.close(os.open(f"{d}/ld.so.cache", os.O_RDONLY | os.O_CREAT, 0o600))  # not a library
"""


def test_only_library_opens_that_succeed_stop_the_target(tmp_path: Path) -> None:
    """A target stops at each new library path it opens, not at the paths a loader tries and misses (310 of a
    CUDA torch import's 402), nor at ld.so.cache: the same program with 40 misses and 5 opens more than a run
    without them stops exactly 5 times more."""
    # Oracle: by construction (the program's 40 opens that fail, 5 that succeed and 5 of a non-library)
    script = tmp_path / "opens.py"
    script.write_text(OPENS)
    stops = []
    for failing, opening in ((0, 0), (40, 5)):
        out = tmp_path / f"o{failing}"
        aiflame("profile", "-q", "--formats", "folded", "-o", str(out), "--", "/usr/bin/python3", str(script),
                str(tmp_path), str(failing), str(opening))
        footer = read_capture(out / "profile.aiflame").footer
        assert footer is not None
        counters = footer.counters
        assert counters.get("open_lost", 0) == 0 and counters.get("stops_late", 0) == 0, counters
        stops.append(counters["stops"])
    assert stops[1] - stops[0] == 5, stops


def test_ctrl_c_keeps_a_complete_capture(examples: Path, tmp_path: Path) -> None:
    out = tmp_path / "intr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiflame", "profile", "-q", "-F", "199", "-o", str(out), "--",
         str(examples / "cpu_split"), "60"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # Wait until samples are flowing (the capture file grows), then interrupt.
    partial = out / "profile.aiflame.partial"
    wait_until(lambda: partial.exists() and partial.stat().st_size > 20000, "20 kB of capture written")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, stderr
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None and cap.footer.stop_reason == "interrupted"
    assert len(cap.samples) > 50
    assert (out / "profile.folded").stat().st_size > 0
    assert "Traceback" not in stderr


def test_delay_leaves_out_start_up(tmp_path: Path) -> None:
    """--delay: the start-up phase's samples are left out and counted; the steady phase after it is there.
    The phases are wall time (the delay is), the counts derived from CPU time: start-up says how much it ran,
    and steady goes on for 1 s of CPU time after its 3 s (well past the delay), however busy the host."""
    script = tmp_path / "phases.py"
    script.write_text(
        "import time\n"
        "def start_up(s):\n    end = time.monotonic() + s\n    while time.monotonic() < end:\n        pass\n"
        "def steady(s, cpu):\n    end = time.monotonic() + s\n    while time.monotonic() < end:\n        pass\n"
        "    end = time.process_time() + cpu\n    while time.process_time() < end:\n        pass\n"
        "start_up(3.0)\nprint('start-up cpu', time.process_time(), flush=True)\nsteady(3.0, 1.0)\n"
    )
    out = tmp_path / "o"
    proc = aiflame("profile", "-q", "-F", "199", "--delay", "4", "-o", str(out), "--", "/usr/bin/python3",
                   str(script))
    start_up_cpu = float(proc.stdout.split("start-up cpu", 1)[1].split()[0])
    folded = read_folded(out / "profile.folded")

    def py(name: str) -> int:
        return sum(c for st, c in folded.items() if f";py::{name} (" in st)

    assert py("steady") > 50 and py("start_up") == 0, folded  # 1 s of CPU after the delay: ~199
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None
    # Oracle: the start-up's own CPU time (all of it before the delay) at 199 Hz, 70% of it at the least.
    assert start_up_cpu > 0.1, start_up_cpu
    assert cap.footer.counters.get("before_delay", 0) >= 0.7 * start_up_cpu * 199, (cap.footer.counters,
                                                                                     start_up_cpu)
