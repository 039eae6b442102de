"""The daemon for real: started as a root subprocess with real BPF, short windows, a temp output directory and
socket; workloads that map a real accelerator runtime (NCCL from the wheel), fork and exit while it runs.
One daemon serves the module (its BPF compile takes seconds); SIGTERM comes last."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiflame.agent.daemon.store import CAPTURE_RE, WINDOW_RE
from aiflame.core.capture import read_capture
from tests.conftest import REPO
from tests.integration.conftest import HANG_S, AgentProcess, CpuTrace, cpu_ns, wait_until
from tests.integration.test_runtime_nccl import _libnccl

WINDOW_S = 3.0
HZ = 19  # the daemon's continuous rate (the default)

# Fixed CPU work, not wall time: each process spins until it has run `seconds` on a CPU, so the samples it gets
# (cpu-clock counts time on CPU) do not depend on how busy the host is.
WORKLOAD = textwrap.dedent("""
    import ctypes, os, sys, time
    ctypes.CDLL(sys.argv[1])  # maps an accelerator runtime: the daemon watches this process
    seconds = float(sys.argv[2])

    def spin(s):
        end, x = time.thread_time() + s, 0
        while time.thread_time() < end:
            for i in range(5000):
                x += i

    def parent_work(s):
        spin(s)

    def child_work(s):
        spin(s)

    sys.stdin.read(1)  # the test says go once the daemon watches this process: the fork is followed in BPF
    pid = os.fork()
    if pid == 0:
        child_work(seconds)
        os._exit(0)
    parent_work(seconds)
    os.waitpid(pid, 0)
""")


class Daemon(AgentProcess):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, f"""
            [watch]
            scan_interval_s = 0.2
            [continuous]
            window_s = {WINDOW_S}
            [trigger]
            max_duration_s = 30
        """)

    def client(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aiflame", *args, "--socket", str(self.sock)],
                              cwd=REPO, capture_output=True, text=True, timeout=timeout)

    def windows(self) -> list[Path]:
        return sorted(p for p in (self.out / "windows").iterdir() if WINDOW_RE.match(p.name))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    if d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait()


def _workload(daemon: Daemon, cpu_s: float) -> subprocess.Popen[bytes]:
    """The workload, started once the daemon watches it: `cpu_s` seconds on a CPU in the parent and its child."""
    script = daemon.tmp / "workload.py"
    script.write_text(WORKLOAD)
    # its own process group, so the child it forks goes with it (see _kill)
    work = subprocess.Popen([sys.executable, str(script), str(_libnccl()), str(cpu_s)], start_new_session=True,
                            stdin=subprocess.PIPE)
    daemon.wait_log(f"watching pid={work.pid}", HANG_S)
    assert work.stdin is not None
    work.stdin.write(b"g")
    work.stdin.close()
    return work


def _kill(work: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(work.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    work.wait(timeout=60)


def _samples_by_pid(windows: list[Path]) -> dict[int, int]:
    out: dict[int, int] = {}
    for w in windows:
        for s in read_capture(w / "profile.aiflame").samples:
            out[s.pid] = out.get(s.pid, 0) + 1
    return out


def test_windows_follow_targets_that_start_fork_and_exit(daemon: Daemon) -> None:
    # Oracle: the workload's construction (CPU in parent_work and in its forked child's child_work)
    before = set(daemon.windows())
    work = _workload(daemon, 4.0)
    assert work.wait(timeout=HANG_S) == 0
    daemon.wait_log(f"target exited pid={work.pid}", HANG_S)
    exited_ns = time.monotonic_ns()

    def closed_and_exported() -> bool:  # a window ended after the exit, and every new window is exported
        new = [w for w in daemon.windows() if w not in before]
        return (any((c := read_capture(w / "profile.aiflame")).footer is not None and c.footer.end_mono_ns >= exited_ns
                    for w in new) and all((w / "profile.folded").exists() for w in new))

    wait_until(closed_and_exported, "the window holding the exit closed and exported")
    new = [w for w in daemon.windows() if w not in before]
    by_pid = _samples_by_pid(new)
    # 4 s on CPU each at 19 Hz: 76 samples expected; 10 allows for the fork being followed late
    assert by_pid.get(work.pid, 0) >= 10, (by_pid, daemon.text())
    children = [p for p in by_pid if p != work.pid]
    assert children and max(by_pid[p] for p in children) >= 10, by_pid  # the forked child, followed in BPF
    folded = "".join((w / "profile.folded").read_text() for w in new if (w / "profile.folded").exists())
    assert "py::parent_work" in folded and "py::child_work" in folded
    for w in new:  # every window stands alone: complete capture, its processes' mappings inside
        cap = read_capture(w / "profile.aiflame")
        assert cap.footer is not None
        sampled = {s.pid for s in cap.samples}
        assert sampled <= {p.pid for p in cap.processes}
    # No window is left partial: each one open now (bar the one in progress) is finished or removed. Waited for,
    # not timed: a daemon on a busy host finishes windows late, never leaves them.
    partial = sorted(p for p in (daemon.out / "windows").iterdir() if p.name.startswith(".partial-"))
    wait_until(lambda: all(not p.exists() for p in partial[:-1]), f"partial windows finished: {partial}")


def test_trigger_and_status(daemon: Daemon) -> None:
    work = _workload(daemon, 3600.0)  # outlives the trigger however slow its BPF compile; killed after
    trace = CpuTrace(work.pid)
    try:
        status: dict[str, Any] = {}

        def listed() -> bool:  # the status is refreshed once a second
            status.update(json.loads(daemon.client("status", "--json").stdout))
            return work.pid in [t["pid"] for t in status["targets"]]

        wait_until(listed, f"pid {work.pid} in the daemon's status")
        assert status["frequency_hz"] == HZ and status["rss_mb"] > 0
        r = daemon.client("trigger", "--pid", str(work.pid), "-d", "2", "-F", "199", "--chakra", timeout=HANG_S)
        trace.stop()
        assert r.returncode == 0, r.stderr
        # the workload maps NCCL but calls nothing in it: Chakra says why there are no traces instead of failing
        assert "chakra: no collectives" in r.stdout + r.stderr, r
        cap_dir = Path(r.stdout.split("capture: ", 1)[1].split()[0])
        assert CAPTURE_RE.match(cap_dir.name) and cap_dir.parent == daemon.out / "captures"
        cap = read_capture(cap_dir / "profile.aiflame")
        assert cap.footer is not None and cap.header.frequency_hz == 199
        n = sum(1 for s in cap.samples if s.pid == work.pid)
        # Oracle: the scheduler — the workload's own CPU time during the capture (/proc/PID/schedstat) at
        # 199 Hz, whatever share of a CPU the host left it. Sampling is jittered: 70% of it, at the least.
        ran_s = trace.ran_ns(cap.header.start_mono_ns, cap.footer.end_mono_ns) / 1e9
        assert ran_s > 0.1, f"the workload ran {ran_s:.2f} s on a CPU during the capture"
        assert n >= 0.7 * ran_s * 199, (n, ran_s, cap.footer.stop_reason)
        assert (cap_dir / "profile.folded").stat().st_size > 0 and (cap_dir / "profile.svg").exists()
        assert (cap_dir / "profile.aiflame").stat().st_mode & 0o077 in (0, 0o040)  # no world access
    finally:
        trace.stop()
        _kill(work)
    human = daemon.client("status")
    assert human.returncode == 0 and "windows written" in human.stdout


def test_trigger_refuses_bad_requests(daemon: Daemon) -> None:
    r = daemon.client("trigger", "--pid", "4194000", "-d", "1")
    assert r.returncode == 1 and "no such process: 4194000" in r.stderr and "Traceback" not in r.stderr
    r = daemon.client("trigger", "--all", "-d", "999")
    assert r.returncode == 1 and "exceeds the configured maximum" in r.stderr
    for raw in (b"not json\n", b'{"op": "trigger", "pids": [1], "output": "/etc"}\n', b'{"op": "rm"}\n',
                b"[" * 70000 + b"\n"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(daemon.sock))
        try:
            s.sendall(raw)
        except OSError:
            pass  # the daemon may hang up on an oversized request before reading all of it
        reply = json.loads(s.makefile("rb").readline())
        s.close()
        assert reply["ok"] is False and reply["error"].startswith("bad request:"), reply


def _as_nobody(sock: Path) -> subprocess.CompletedProcess[str]:
    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    return subprocess.run([sys.executable, "-m", "aiflame", "status", "--socket", str(sock)],
                          cwd=REPO, capture_output=True, text=True, timeout=30, preexec_fn=drop)


def test_non_root_clients_are_refused(daemon: Daemon) -> None:
    assert (daemon.sock.stat().st_mode & 0o777) == 0o600
    # Let nobody reach the socket file itself (pytest's temp directories are 0700).
    dirs = [d for d in [daemon.tmp, *daemon.tmp.parents] if d != Path("/")]
    modes = {d: d.stat().st_mode & 0o7777 for d in dirs}
    for d in dirs:
        os.chmod(d, modes[d] | 0o001)
    try:
        r = _as_nobody(daemon.sock)
        assert r.returncode == 1 and "root-only" in r.stderr and "Traceback" not in r.stderr
        os.chmod(daemon.sock, 0o666)  # even so, the daemon checks the peer's credentials
        try:
            r = _as_nobody(daemon.sock)
        finally:
            os.chmod(daemon.sock, 0o600)
    finally:
        for d, m in modes.items():
            os.chmod(d, m)
    assert r.returncode == 1 and "only root may use" in r.stderr, r.stderr


def test_sighup_and_sigterm_mid_window_lose_nothing(daemon: Daemon) -> None:
    work = _workload(daemon, 3600.0)  # on CPU until SIGTERM has closed the last window; killed after
    started = cpu_ns(work.pid)
    wait_until(lambda: cpu_ns(work.pid) - started > 0.5e9, "the workload's first 0.5 s on a CPU")
    mark = len(daemon.text())
    daemon.config.write_text(daemon.config.read_text().replace("scan_interval_s = 0.2", "scan_interval_s = 0.3"))
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_log("INFO reloaded", HANG_S, after=mark)
    daemon.wait_log("reason=window-end", HANG_S, after=mark)  # the window open at SIGHUP ends on time, complete
    assert daemon.proc.poll() is None
    ran = cpu_ns(work.pid)
    wait_until(lambda: cpu_ns(work.pid) - ran > 0.5e9, "0.5 s more on a CPU, in the last window")
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        assert daemon.proc.wait(timeout=HANG_S) == 0, daemon.text()
    finally:
        _kill(work)
    log = daemon.text()[mark:]
    assert "reason=window-end" in log and "reason=daemon-stopping-(SIGTERM)" in log
    windows = daemon.windows()
    assert not [p for p in (daemon.out / "windows").iterdir() if not WINDOW_RE.match(p.name)], "partial left"
    last = read_capture(windows[-1] / "profile.aiflame")
    assert last.footer is not None and last.footer.stop_reason == "daemon stopping (SIGTERM)"
    assert sum(1 for s in last.samples if s.pid == work.pid) > 0
    assert (windows[-1] / "profile.folded").exists()
    # The windows that watched the workload follow each other with no gap: nothing between them went unrecorded.
    # (Windows before the daemon found it watched nothing and were dropped; on a loaded host finding it can take a
    # window or two, so the last three windows are not necessarily consecutive.)
    caps = {w.name: read_capture(w / "profile.aiflame") for w in windows}
    seqs = [int(name[17:23]) for name, c in caps.items() if any(s.pid == work.pid for s in c.samples)]
    assert len(seqs) >= 2 and seqs == list(range(seqs[0], seqs[0] + len(seqs))), sorted(caps)
    watched = [c for c in caps.values() if any(s.pid == work.pid for s in c.samples)]
    for a, b in zip(watched, watched[1:], strict=False):
        assert a.footer is not None
        assert b.header.start_mono_ns - a.footer.end_mono_ns < 200_000_000
    assert not daemon.sock.exists()


CAP_SYS_NICE, PR_CAPBSET_DROP = 23, 24


def _without_cap_sys_nice() -> None:
    """preexec_fn: drop CAP_SYS_NICE from the bounding set, as the unit does: after exec no process of the
    daemon can lower a niceness it has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_NICE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _nice(pid: int) -> int:
    """The niceness of `pid`'s main thread (/proc/PID/stat, field 19)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


def test_the_stop_watchdog_keeps_the_daemons_starting_priority(tmp_path: Path) -> None:
    """The shipped [limits] nice (10) lowers the daemon, never the safety net that continues the targets its
    probes stopped: the watchdog runs at the priority the daemon started with, here without CAP_SYS_NICE."""
    d = AgentProcess(tmp_path, "[continuous]\nruntimes = true\n", nice=10, preexec_fn=_without_cap_sys_nice)
    try:
        status = Path(f"/proc/{d.proc.pid}/status").read_text()
        bounding = int(next(ln for ln in status.splitlines() if ln.startswith("CapBnd:")).split()[1], 16)
        assert not bounding & (1 << CAP_SYS_NICE), status
        assert _nice(d.proc.pid) == 10
        watchdogs = [int(c) for task in Path(f"/proc/{d.proc.pid}/task").iterdir()
                     for c in (task / "children").read_text().split()
                     if b"stop_watchdog.py" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(watchdogs) == 1, d.text()
        assert _nice(watchdogs[0]) == os.getpriority(os.PRIO_PROCESS, 0) < 10, d.text()
    finally:
        d.proc.terminate()
        assert d.proc.wait(timeout=HANG_S) == 0, d.text()
