"""A process snapshot: mappings parsed from /proc/PID/maps, the rest from psutil; a gone process gives None."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from aiflame.agent.procmaps import BuildIdCache, read_process


def test_snapshot_of_a_child_and_of_it_gone() -> None:
    argv = [sys.executable.encode(), b"-c", b"import sys; sys.stdin.read()", b"caf\xe9", b""]
    with subprocess.Popen(argv, stdin=subprocess.PIPE) as child:
        deadline = time.monotonic() + 10
        snap = read_process(child.pid, 7, BuildIdCache())
        while snap is not None and "caf\ufffd" not in snap.cmdline and time.monotonic() < deadline:
            time.sleep(0.01)  # still the forked copy of us: not exec'd yet
            snap = read_process(child.pid, 7, BuildIdCache())
        assert child.stdin is not None
        child.stdin.close()
    assert snap is not None and snap.pid == child.pid and snap.time_ns == 7
    assert snap.cmdline[1:] == ["-c", "import sys; sys.stdin.read()", "caf\ufffd", ""]  # undecodable: U+FFFD
    assert snap.ppid == os.getpid() and snap.comm.startswith("python")
    assert os.path.realpath(snap.exe) == os.path.realpath(sys.executable)
    assert any(m.path == snap.exe and "x" in m.perms for m in snap.mappings)
    assert read_process(child.pid, 8, BuildIdCache()) is None
