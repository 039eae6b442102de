"""On-demand captures alone: requests checked against the limits, then run step by step as the main loop would,
with fake collectors and a fake export worker (the store is a real directory)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aiflame.agent.daemon.captures import Capture, Captures, CaptureSource
from aiflame.agent.daemon.collector import WindowResult
from aiflame.agent.daemon.config import DaemonConfig, OutputConfig, TriggerConfig
from aiflame.agent.daemon.exports import ExportJob
from aiflame.agent.daemon.protocol import Response, TriggerRequest
from aiflame.agent.daemon.store import OutputDirs


class FakeSource:
    def __init__(self, fail: str = "") -> None:
        self.exited: list[int] = []
        self._targets: list[int] = []
        self.fail = fail
        self.path: Path | None = None
        self.target = ""
        self.ticks = 0
        self.closed = False

    @property
    def targets(self) -> list[int]:
        return list(self._targets)

    def start(self) -> None:
        if self.fail:
            raise RuntimeError(self.fail)

    def open_window(self, path: Path, target: str = "") -> None:
        self.path, self.target = path, target
        path.write_bytes(b"capture")

    def add_target(self, pid: int) -> bool:
        self._targets.append(pid)
        return True

    def tick(self, timeout_s: float) -> None:
        self.ticks += 1

    def close_window(self, stop_reason: str) -> WindowResult:
        assert self.path is not None
        return WindowResult(self.path, 10, 2, {"lost": 1}, self.targets)

    def close(self) -> None:
        self.closed = True


class InstantExports:
    """Publishes a job at once, on the caller's thread."""

    def __init__(self) -> None:
        self.jobs: list[ExportJob] = []

    def submit(self, job: ExportJob, block: bool = False) -> None:
        self.jobs.append(job)
        final = OutputDirs.publish(job.partial_dir)
        assert job.done is not None
        job.done(final, [final / "profile.folded"], [])


class Harness:
    def __init__(self, tmp: Path, fail: str = "", watched: tuple[int, ...] = ()) -> None:
        self.out = OutputDirs(tmp)
        self.out.prepare()
        limits = TriggerConfig(default_duration_s=1, max_duration_s=5, max_frequency=500)
        cfg = DaemonConfig(output=OutputConfig(dir=tmp), trigger=limits)
        self.sources: list[FakeSource] = []
        self.exits_heard = 0
        self.woken = 0
        self.exports = InstantExports()
        self.fail = fail
        self.caps = Captures(cfg, self.out, self.exports, self._source, lambda: list(watched),
                             lambda pid: pid != 4_000_000, self._on_exits, self._wake)

    def _source(self, c: Capture) -> CaptureSource:
        self.sources.append(FakeSource(self.fail))
        return self.sources[-1]

    def _on_exits(self, exited: list[int]) -> None:
        self.exits_heard += 1
        exited.clear()

    def _wake(self) -> None:
        self.woken += 1

    def run(self, req: TriggerRequest, timeout_s: float = 10.0) -> Response:
        """The client on a thread of its own; the main loop's steps here."""
        got: list[Response] = []
        client = threading.Thread(target=lambda: got.append(self.caps.request(req)))
        client.start()
        end = time.monotonic() + timeout_s
        while client.is_alive() and time.monotonic() < end:
            self.caps.step()
            time.sleep(0.01)
        client.join(1)
        assert got, "no answer"
        return got[0]


def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_limits_and_unknown_processes_are_refused(tmp_path: Path) -> None:
    caps = Harness(tmp_path).caps
    assert "exceeds the configured maximum (5 s)" in caps.request(TriggerRequest((1,), duration_s=6)).error
    assert "exceeds the configured maximum (500 Hz)" in caps.request(TriggerRequest((1,), frequency=501)).error
    assert caps.request(TriggerRequest(all_targets=True)).error == "no watched processes to capture"
    assert caps.request(TriggerRequest((1, 4_000_000))).error == "no such process: 4000000"


def test_a_capture_runs_for_its_duration_and_is_answered(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    resp = h.run(TriggerRequest((os.getpid(),), duration_s=0.3, chakra=True))
    assert resp.ok, resp.error
    (source,) = h.sources
    assert source.closed and source.ticks > 1 and h.exits_heard == source.ticks
    assert source.target == f"pids {os.getpid()}" and h.woken == 1
    d = resp.data
    assert d["stop_reason"] == "duration" and d["samples"] == 10 and d["events"] == 2 and d["lost"] == 1
    assert Path(d["dir"]).parent == h.out.captures and Path(d["dir"]).name.endswith("-c0001")
    assert h.exports.jobs[0].formats == ("folded", "svg", "chakra")
    assert not h.caps.running and h.caps.written == 1


def test_a_capture_ends_when_its_targets_exit(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    h = Harness(tmp_path, watched=(proc.pid,))
    threading.Timer(0.3, proc.kill).start()
    try:
        resp = h.run(TriggerRequest(all_targets=True, duration_s=5))
    finally:
        proc.kill()
        proc.wait()
    assert resp.ok and resp.data["stop_reason"] == "targets exited" and resp.data["pids"] == [proc.pid]


def test_a_sampler_that_cannot_start_is_reported(tmp_path: Path) -> None:
    h = Harness(tmp_path, fail="no BPF here")
    resp = h.run(TriggerRequest((os.getpid(),), duration_s=1))
    assert resp.error == "cannot start the capture: no BPF here"
    assert h.sources[0].closed and not h.caps.running and not list(h.out.captures.iterdir())


def test_one_capture_at_a_time_and_stopping_answers_everyone(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    first: list[Response] = []
    client = threading.Thread(target=lambda: first.append(h.caps.request(TriggerRequest((os.getpid(),)))))
    client.start()
    _until(lambda: h.woken > 0)
    assert h.caps.request(TriggerRequest((os.getpid(),))).error.startswith("busy:")
    h.caps.step()  # compiling
    assert h.caps.running
    h.caps.finish("daemon stopping (SIGTERM)")
    client.join(5)
    assert first[0].error == "capture cancelled: daemon stopping (SIGTERM)"
    assert not h.caps.running


@pytest.mark.parametrize("steps", [0, 1])
def test_queued_captures_fail_when_the_daemon_stops(tmp_path: Path, steps: int) -> None:
    h = Harness(tmp_path)
    got: list[Response] = []
    client = threading.Thread(target=lambda: got.append(h.caps.request(TriggerRequest((os.getpid(),)))))
    client.start()
    _until(lambda: h.woken > 0)
    for _ in range(steps):
        h.caps.step()
    h.caps.finish("stopping")
    h.caps.fail_queued("the daemon is stopping")
    client.join(5)
    assert got[0].error in ("the daemon is stopping", "capture cancelled: stopping")


def test_a_capture_at_a_time_starts_then(tmp_path: Path) -> None:
    """trigger --at: the sampler is loaded at once, the window opens at the instant named (never before; after it by
    no more than the main loop's own delay, bounded loosely here: the tight figure is a bench's); the reply says
    when it opened. A time passed or more than a day ahead is refused."""
    h = Harness(tmp_path)
    at = time.time_ns() + 400_000_000
    resp = h.run(TriggerRequest((os.getpid(),), duration_s=0.2, at_wall_ns=at))
    assert resp.ok, resp.error
    started = resp.data["started_ns"]
    assert isinstance(started, int) and at <= started < at + 1_000_000_000, (started - at) / 1e6
    caps = h.caps
    assert "passed" in caps.request(TriggerRequest((1,), at_wall_ns=time.time_ns() - 10**9)).error
    assert "at most 86400 s" in caps.request(TriggerRequest((1,), at_wall_ns=time.time_ns() + 2 * 86400 * 10**9)).error
