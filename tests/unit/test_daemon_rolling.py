"""Rolling windows alone: a fake collector writes the windows, a fake export worker takes them; the store is a
real directory."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from aiflame.agent.daemon.collector import WindowResult
from aiflame.agent.daemon.config import ContinuousConfig, DaemonConfig, OutputConfig, RetentionConfig
from aiflame.agent.daemon.exports import ExportJob
from aiflame.agent.daemon.rolling import RollingWindows
from aiflame.agent.daemon.store import OutputDirs


class FakeSource:
    def __init__(self) -> None:
        self.path: Path | None = None
        self.next = WindowResult(Path("x"), 0, 0)
        self.reasons: list[str] = []

    def open_window(self, path: Path, target: str = "") -> None:
        assert self.path is None
        self.path = path
        path.write_bytes(b"capture")

    def close_window(self, stop_reason: str) -> WindowResult:
        assert self.path is not None
        self.reasons.append(stop_reason)
        self.path = None
        return self.next


class FakeExports:
    def __init__(self) -> None:
        self.jobs: list[tuple[ExportJob, bool]] = []

    def submit(self, job: ExportJob, block: bool = False) -> None:
        self.jobs.append((job, block))

    def publish(self, i: int) -> Path:
        """What the export worker does when it is done: rename, then the job's callback."""
        job = self.jobs[i][0]
        final = OutputDirs.publish(job.partial_dir)
        assert job.done is not None
        job.done(final, [], ["a note"])
        return final


@pytest.fixture
def parts(tmp_path: Path) -> tuple[RollingWindows, FakeSource, FakeExports, OutputDirs]:
    out = OutputDirs(tmp_path)
    out.prepare()
    cfg = DaemonConfig(continuous=ContinuousConfig(window_s=30.0), output=OutputConfig(dir=tmp_path,
                                                                                       formats=("folded", "svg")))
    exports = FakeExports()
    return RollingWindows(cfg, out, exports), FakeSource(), exports, out


def test_a_window_with_nothing_in_it_is_dropped(parts: tuple[RollingWindows, FakeSource, FakeExports,
                                                                OutputDirs]) -> None:
    windows, source, exports, out = parts
    t0 = time.monotonic()
    windows.open(source)
    assert source.path is not None and source.path.parent.parent == out.windows
    assert not windows.due(t0) and windows.due(t0 + 30.5)
    windows.rotate()
    assert source.reasons == ["window end"] and not exports.jobs and windows.written == 0
    assert [p.name for p in out.windows.iterdir()] == [source.path.parent.name]  # only the new window's


def test_a_closed_window_is_exported_counted_and_retention_applied(
        parts: tuple[RollingWindows, FakeSource, FakeExports, OutputDirs]) -> None:
    windows, source, exports, out = parts
    old = out.windows / "20000101T000000Z-000001"  # far past the age limit
    old.mkdir()
    os.utime(old, (1e9, 1e9))
    windows.open(source)
    source.next = WindowResult(Path("x"), samples=5, events=2, counters={"lost": 1}, pids=[7])
    windows.rotate()
    source.next = WindowResult(Path("x"), samples=3, events=0, counters={"lost": 2, "x": 1}, pids=[7])
    windows.close("reload")
    assert windows.written == 2 and windows.samples == 8 and windows.lost == {"lost": 3, "x": 1}
    (job, block), (job2, block2) = exports.jobs
    assert job.formats == ("folded", "svg") and not block and block2  # only the last window waits for the worker
    final = exports.publish(0)
    assert final.is_dir() and not old.exists()
    windows.close("again")  # nothing open: nothing happens
    assert len(exports.jobs) == 2


def test_reconfigure_moves_the_end_and_the_destination(
        parts: tuple[RollingWindows, FakeSource, FakeExports, OutputDirs], tmp_path: Path) -> None:
    windows, source, exports, out = parts
    windows.open(source)
    end = windows.end
    other = OutputDirs(tmp_path / "other")
    other.prepare()
    cfg = replace(windows.cfg, continuous=ContinuousConfig(window_s=10.0), retention=RetentionConfig(max_age_h=1))
    windows.reconfigure(cfg, other)
    assert windows.end == pytest.approx(end - 20.0)
    windows.rotate()
    assert source.path is not None and source.path.parent.parent == other.windows
