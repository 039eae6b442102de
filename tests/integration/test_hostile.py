"""Issue #20 for real: an unprivileged local user (nobody) attacks `aiflame profile` and the probes' stops with a
stand-in libcudart.so.12 built by gcc (tests/hostile.py). Each test plays one attack and checks what the issue's
targets ask: the agent keeps going, stays under 300 MB, never holds a target stopped for 1 s, changes no
root-owned file outside its output directory, and a kill -9 leaves no target stopped and a capture that exports."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from tests.conftest import REPO
from tests.hostile import (
    PYTHON,
    as_nobody,
    build_standin,
    fatbin_zstd_cubin,
    longest_stop,
    nobody_dir,
    rss_peak_mb,
    state,
    write_attacker,
)
from tests.integration.conftest import aiflame, wait_until

RSS_LIMIT_MB = 300
STOP_LIMIT_S = 1.0


class Attacker:
    """The attacker's home, stand-in runtime and program; `start(mode, ...)` runs it as nobody."""

    def __init__(self) -> None:
        self.home = nobody_dir("aiflame-attacker-")
        self.lib = build_standin(self.home)
        self.script = write_attacker(self.home)
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, mode: str, *args: str | Path) -> Run:
        proc = subprocess.Popen(as_nobody(PYTHON, self.script, self.lib, mode, *args), stdout=subprocess.PIPE,
                                text=True, cwd=self.home, start_new_session=True)
        self.procs.append(proc)
        return Run(proc)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.home, ignore_errors=True)


class Run:
    """One attacker process: its output lines as they come, with the time each arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.strip()))

    def wait_for(self, word: str, timeout: float = 60) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for _, line in self.lines:
                if line.split()[:1] == [word]:
                    return line
            if self.proc.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"attacker never said {word!r}: {self.lines[-5:]}")

    def opened(self, since: float = 0.0) -> list[float]:
        """When each library open returned (monotonic, from the attacker's own clock)."""
        return [float(line.split()[2]) for t, line in self.lines if line.startswith("opened") and t >= since]


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    yield a
    a.close()


def _gaps(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


HUNG_AGENT = textwrap.dedent("""
    import sys, time
    from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig

    def on_probe(rec):
        print("stopped", rec.pid, flush=True)
        time.sleep(3600)  # hung while the target waits at its library open

    s = CpuSampler(SamplerConfig(frequency=19, probes=True), lambda s: None, lambda e: None, on_probe)
    s.start([int(sys.argv[1])])
    print("watchdog", s.watchdog.pid, flush=True)
    while True:
        s.wait(1.0)
""")


def test_a_hung_then_killed_agent_never_leaves_a_target_stopped(attacker: Attacker, tmp_path: Path) -> None:
    """The agent hangs while a target waits stopped at a library open (BPF stopped it): the watchdog continues
    it within the deadline, every time; kill -9 of the agent and the target runs on at once."""
    run = attacker.start("opens", attacker.home, "60")
    run.wait_for("ready")
    script = tmp_path / "hung_agent.py"
    script.write_text(HUNG_AGENT)
    agent = subprocess.Popen([sys.executable, str(script), str(run.pid)], cwd=REPO, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert agent.stdout is not None
        watchdog = int(agent.stdout.readline().split()[1])
        assert agent.stdout.readline().split()[0] == "stopped"  # and hung from here on
        t0 = time.monotonic()
        wait_until(lambda: len(run.opened(since=t0)) >= 4, "4 library opens continued by the watchdog alone")
        hung = run.opened(since=t0)
        assert _gaps(hung) < STOP_LIMIT_S, hung  # each stop undone by the watchdog before 1 s
        agent.kill()
        agent.wait()
        t1 = time.monotonic()
        assert longest_stop(run.pid, 5) < STOP_LIMIT_S
        after = run.opened(since=t1)
        assert len(after) > len(hung) and _gaps(after) < STOP_LIMIT_S
        end = time.monotonic() + 5
        while time.monotonic() < end and os.path.exists(f"/proc/{watchdog}") and state(watchdog) != "Z":
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{watchdog}") or state(watchdog) == "Z"  # it went after its sweep
    finally:
        agent.kill()
        agent.wait()


def _profile(*args: str, session_leader: bool = False) -> subprocess.Popen[str]:
    """`aiflame profile ARGS` in the background; `session_leader`: in a session of its own without a terminal,
    as the daemon runs under systemd (the case where opening a terminal would make it ours)."""
    return subprocess.Popen([sys.executable, "-m", "aiflame", "profile", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=session_leader)


def _watch_rss_and_tty(proc: subprocess.Popen[str]) -> tuple[float, set[int]]:
    """Until `proc` exits: its peak RSS (MB) and every controlling terminal it had (tty_nr; 0 is none). Reads
    that race with the exit are skipped, but a watch that read nothing fails: no reading is no evidence."""
    peak, ttys, reads = 0.0, set(), 0
    while proc.poll() is None:
        try:
            peak = max(peak, rss_peak_mb(proc.pid))
            ttys.add(int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[4]))
            reads += 1
        except (OSError, ValueError, AssertionError):  # gone, or exiting without VmHWM: only at exit
            try:  # its memory is released in do_exit before it can be reaped: give the exit time to finish
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{proc.pid} is running but its RSS cannot be read") from None
        time.sleep(0.05)
    assert reads > 0, "the process exited before its RSS could be read once"
    return peak, ttys


def test_a_library_path_that_is_a_terminal_is_never_opened(attacker: Attacker, tmp_path: Path) -> None:
    """The target opens "libhijack.so", a symlink to a pty it owns, then types ^C and ^\\ into that pty: a profiler
    that opened the path as a session leader would have taken the pty as its terminal and been interrupted."""
    run = attacker.start("pty", attacker.home, "40", "30")  # a link open and ^C every 0.5 s for 20 s
    run.wait_for("ready")
    proc = _profile("-q", "-p", str(run.pid), "-d", "8", "-o", str(tmp_path / "out"), "--formats", "folded",
                    session_leader=True)
    peak, ttys = _watch_rss_and_tty(proc)
    _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert ttys == {0}
    cap = read_capture(tmp_path / "out" / "profile.aiflame")
    assert cap.footer is not None and cap.footer.stop_reason != "interrupted"
    assert peak < RSS_LIMIT_MB


def test_planted_symlinks_in_a_users_output_directory(attacker: Attacker) -> None:
    """The output directory is the attacker's: every name we write there is a symlink to a root-owned file."""
    run = attacker.start("spin", "30")
    run.wait_for("ready")
    victims = nobody_dir("aiflame-victims-")
    os.chown(victims, 0, 0)  # root's files, outside the output directory
    out = nobody_dir("aiflame-out-")
    names = ["profile.aiflame.partial", "profile.aiflame", "profile.folded", "profile.svg"]
    for name in names:
        v = victims / name
        v.write_text("root's data\n")
        os.symlink(v, out / name)
    try:
        aiflame("profile", "-q", "-p", str(run.pid), "-d", "2", "-o", str(out), "--formats", "folded,svg")
        for name in names:
            assert (victims / name).read_text() == "root's data\n", name
            assert not (out / name).is_symlink() or name.endswith(".partial")
        assert read_capture(out / "profile.aiflame").footer is not None
    finally:
        shutil.rmtree(victims)
        shutil.rmtree(out)


def test_kill_9_of_profile_mid_capture(attacker: Attacker, tmp_path: Path) -> None:
    """kill -9 of `profile` while its target keeps opening libraries (each open stops it): the target runs again
    within 5 s, and what the capture wrote is recovered and exported."""
    run = attacker.start("opens", attacker.home, "60")
    run.wait_for("ready")
    out = tmp_path / "out"
    proc = _profile("-q", "-p", str(run.pid), "-d", "60", "-o", str(out))
    partial = out / "profile.aiflame.partial"
    wait_until(lambda: partial.exists() and partial.stat().st_size > 4096, "the capture's first 4 KiB written")
    t0 = time.monotonic()  # killed while the target is being stopped at its opens: a few of them under the probes
    wait_until(lambda: len(run.opened(since=t0)) >= 3, "3 library opens under the probes")
    proc.kill()
    proc.wait()
    t1 = time.monotonic()
    assert longest_stop(run.pid, 5) < STOP_LIMIT_S
    assert run.opened(since=t1), run.lines[-3:]
    aiflame("recover", str(partial))
    cap = read_capture(out / "profile.aiflame")
    assert cap.footer is not None and cap.footer.stop_reason == "recovered" and cap.processes
    aiflame("export", str(out / "profile.aiflame"), "--format", "folded", "-o", str(out / "p.folded"))
    assert (out / "p.folded").exists()


def test_code_object_bombs_stay_under_the_memory_limit(attacker: Attacker, tmp_path: Path) -> None:
    """cuModuleLoadData of an image claiming ~500 MiB (each call used to copy it), and registrations whose
    fatbin holds a 1 GiB zstd cubin for a launched kernel (inflated at the capture's end, before)."""
    blob = attacker.home / "bomb.fatbin"
    blob.write_bytes(fatbin_zstd_cubin(1 << 30))
    os.chown(blob, 65534, 65534)
    for mode, args in (("module", ("30",)), ("fatbin", (str(blob), "30"))):
        run = attacker.start(mode, *args)
        run.wait_for("ready")
        out = tmp_path / mode
        proc = _profile("-q", "-p", str(run.pid), "-d", "5", "-o", str(out), "--formats", "folded")
        peak, _ = _watch_rss_and_tty(proc)
        _, err = proc.communicate()
        assert proc.returncode == 0, err
        assert peak < RSS_LIMIT_MB, (mode, peak)
        cap = read_capture(out / "profile.aiflame")
        assert all(len(g.data) <= 64 << 20 for g in cap.gpu_code)
        if mode == "module":
            loads = [e for e in cap.events if e.call == "cuModuleLoadData"]
            assert loads and all(e.strs.get("image", "").startswith("implausible") for e in loads), loads[:2]
        else:
            # registered and launched, so the capture's end looked for the kernel's cubin: not inflated
            assert any(e.call == "__cudaRegisterFatBinary" for e in cap.events)
            assert any(e.kind == "compute" for e in cap.events)
            assert [g.kind for g in cap.gpu_code] == ["fatbin"]  # the container (13 KB), never its 1 GiB cubin


@pytest.mark.parametrize("keep", [False, True])
def test_kill_9_of_profile_ends_its_command_unless_kept(tmp_path: Path, keep: bool) -> None:
    """`profile -- CMD` killed -9: CMD gets SIGTERM (PR_SET_PDEATHSIG), or runs on with --keep-running."""
    import psutil

    proc = _profile("-q", "-o", str(tmp_path / "out"), *(["--keep-running"] if keep else []), "--", "sleep", "300")
    cmd = None
    end = time.monotonic() + 60
    while cmd is None and time.monotonic() < end:
        kids = [c for c in psutil.Process(proc.pid).children() if c.name() == "sleep"]
        cmd = kids[0] if kids else None
        time.sleep(0.2)
    assert cmd is not None, "the command never started"
    time.sleep(1)
    proc.kill()
    proc.wait()
    try:
        gone = cmd.wait(timeout=5) is not None or not cmd.is_running()
    except psutil.TimeoutExpired:
        gone = False
    try:
        assert gone != keep
    finally:
        if cmd.is_running():
            cmd.kill()
