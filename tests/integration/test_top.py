"""`aiflame top` in a real terminal (a pty): it shows the target's hot function, then quits cleanly on `q` and on
Ctrl-C, leaving no target stopped and no traceback."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest

from aiflame.agent.procs import status as proc_status
from tests.conftest import REPO

HOT = "import time\ndef top_hot_fn():\n    while True: pass\ntop_hot_fn()\n"


def _read_until(fd: int, pattern: str, timeout_s: float) -> str:
    out = b""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
            if re.search(pattern, out.decode(errors="replace")):
                break
    return out.decode(errors="replace")


def _wait(pid: int, timeout_s: float) -> int:
    """The child's wait status; it is killed (and the test fails) when it has not exited in time."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"aiflame top did not quit within {timeout_s} s")


@pytest.mark.parametrize("quit_key", [b"q", b"\x03"], ids=["q", "ctrl-c"])
def test_top_shows_the_hot_function_and_quits(quit_key: bytes) -> None:
    target = subprocess.Popen([sys.executable, "-c", HOT])
    try:
        pid, fd = pty.fork()
        if pid == 0:  # the child: aiflame top on the pty (SIGINT may be ignored here, as in a runner started in
            # the background: top must make Ctrl-C work anyway)
            os.chdir(REPO)
            os.environ.update(COLUMNS="160", LINES="50", TERM="xterm")
            os.execv(sys.executable, [sys.executable, "-m", "aiflame.cli.main", "top", "--own", "-p",
                                      str(target.pid), "-i", "1"])
        shown = _read_until(fd, r"hottest stacks[\s\S]*top_hot_fn", 60)  # the functions table comes first
        assert "hottest stacks" in shown and "top_hot_fn" in shown, shown[-2000:]
        assert "functions by self time" in shown, shown[-2000:]
        os.write(fd, quit_key)
        t0 = time.monotonic()
        rest = _read_until(fd, r"(?!)", 20)  # to the end of output
        status = _wait(pid, 20)
        assert time.monotonic() - t0 < 30
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, rest[-2000:])
        assert "Traceback" not in shown + rest
        os.close(fd)
        state = proc_status(target.pid)
        assert state in (psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING), state  # never left stopped
    finally:
        target.send_signal(signal.SIGKILL)
        target.wait()
