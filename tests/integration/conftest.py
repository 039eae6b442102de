"""Integration tests load real BPF programs. They need root and a prepared host (`make setup`); they are never
skipped: without root they fail and say why."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.flamegraph_read import read_folded_text


@pytest.fixture(autouse=True)
def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("BPF integration tests need root (run `sudo make test`)")


def aiflame(*args: str, timeout: float = 120, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, in a child process (`env`: variables set on top of ours)."""
    proc = subprocess.run([sys.executable, "-m", "aiflame", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env} if env else None)
    if check and proc.returncode != 0:
        raise AssertionError(f"aiflame {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# How long a wait for a condition goes on before the test fails: a hang, never a pace. No load comes near it
# (the condition is met as soon as the work is done, however slowly).
HANG_S = 300.0


def wait_until(pred: Callable[[], bool], what: str, guard_s: float = HANG_S) -> None:
    """Until `pred()` holds; fails the test saying `what` did not happen if it never does."""
    end = time.monotonic() + guard_s
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"{what}: not after {guard_s:g} s")
        time.sleep(0.05)


def cpu_ns(pid: int) -> int:
    """Time on CPU of `pid`'s main thread, in ns (/proc/PID/schedstat: the scheduler's own exact sum)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def process_cpu_s(pid: int) -> float:
    """CPU time of process `pid`, all its threads (the exited ones too), user and system, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuTrace:
    """The CPU time of a single-threaded process over CLOCK_MONOTONIC, read every 10 ms in a thread: how much it
    ran between two instants (a capture's start and end), to derive how many samples that capture must hold."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.points: list[tuple[int, int]] = []  # (monotonic ns, cpu ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.points.append((time.monotonic_ns(), cpu_ns(self.pid)))
            except (OSError, ValueError, IndexError):
                return  # exited
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def ran_ns(self, t0: int, t1: int) -> int:
        """CPU time between monotonic t0 and t1, at least: from the last reading at or after t0 to the last at or
        before t1 (a lower bound, never more than it ran)."""
        after = [c for t, c in self.points if t >= t0]
        before = [c for t, c in self.points if t <= t1]
        assert after and before, f"no CPU readings of {self.pid} in the interval"
        return max(before[-1] - after[0], 0)


def read_folded(path: Path) -> dict[str, int]:
    """Stack text -> weight, as flamegraph.pl reads the file (tests/flamegraph_read.py: the oracle, never ours)."""
    return {";".join(stack): n for stack, n in read_folded_text(path.read_text()).items()}


def share(folded: dict[str, int], frame: str) -> int:
    """Samples whose stack holds `frame`."""
    return sum(c for st, c in folded.items() if frame in st.split(";"))


class AgentProcess:
    """`aiflame agent` as a root subprocess with a config of its own in `tmp`: `sections` (TOML: [watch],
    [continuous], ...) plus an output directory and control socket there; its log is `tmp/daemon.log`. `popen`:
    more subprocess.Popen arguments (a session, a cgroup). Returns once it has started.

    `nice`: the daemon's [limits] nice. Tests run it at their own priority (0) by choice: the shipped 10 would let
    a CPU burner on the host (make stress) starve it; test_daemon.py tests 10 and the watchdog's own priority."""

    def __init__(self, tmp: Path, sections: str, nice: int = 0, **popen: Any) -> None:
        self.tmp = tmp
        self.out = tmp / "out"
        self.sock = tmp / "agent.sock"
        self.config = tmp / "aiflame.toml"
        sections = textwrap.dedent(sections)
        assert "[limits]" not in sections, "pass the daemon's niceness as nice="
        self.config.write_text(sections + f'[output]\ndir = "{self.out}"\n[control]\nsocket = "{self.sock}"\n'
                               f'[limits]\nnice = {nice}\n')
        self.log = tmp / "daemon.log"
        self._log_f = open(self.log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "aiflame", "agent", "--config", str(self.config)],
                                     cwd=REPO, stdout=self._log_f, stderr=subprocess.STDOUT, **popen)
        self.wait_log("INFO started", HANG_S)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, needle: str, timeout: float, after: int = 0) -> None:
        """Until `needle` is in the log (from character `after` on); fails the test if the daemon exits first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if needle in self.text()[after:]:
                return
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited ({self.proc.returncode}):\n{self.text()[-3000:]}")
            time.sleep(0.1)
        pytest.fail(f"no {needle!r} in the daemon log after {timeout} s:\n{self.text()[-3000:]}")
