"""The pipeline builds the CFI tables of the large files of a target read while it waits, stopped at a library
open, only once it runs again (issue #25: a command's start-up must not wait for libtorch's table builds), and the
small files' at once (a library the target calls as soon as it runs must be known to the unwinder). The process
is this one (its real maps, libc played as a large file); the sampler is a recorder of what the pipeline asks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aiflame.agent import pipeline
from aiflame.agent.pipeline import CapturePipeline as Pipeline
from aiflame.core.capture import CaptureWriter, new_header
from aiflame.core.raw import Mapping


class RecordingSampler:
    def __init__(self, pipe: Pipeline, stopped: list[int]) -> None:
        self.pipe, self.stopped = pipe, stopped
        self.calls: list[tuple[str, int, bool]] = []  # (what, pid, whether the target was stopped then)
        self.libc: list[bool] = []  # whether each set_mappings had libc

    def set_mappings(self, pid: int, mappings: list[Mapping]) -> None:
        assert any(m.path.startswith("/") and "x" in m.perms for m in mappings)
        self.calls.append(("tables", pid, pid in self.stopped))
        self.libc.append(any("/libc.so" in m.path for m in mappings))

    def poll(self) -> None:  # a library open arrives: the target is stopped while the pipeline looks at it
        self.stopped.append(os.getpid())
        self.pipe._on_target_stop(os.getpid())
        self.stopped.remove(os.getpid())  # continued, as the probe manager does after on_stop

    def catch_up_tables(self) -> int:
        self.calls.append(("catch_up", 0, False))
        return 0

    def clear_python(self, pid: int) -> None:
        pass

    def set_python(self, pid: int, proc: object) -> None:
        pass


def test_tables_of_a_stopped_target_are_built_after_it_runs_again(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "_file_bytes", lambda pid, path: 1 << 30 if "/libc.so" in path else 4096)
    pipe = Pipeline(runtimes=False)
    stopped: list[int] = []
    sampler = RecordingSampler(pipe, stopped)
    pipe.sampler = sampler  # type: ignore[assignment]
    writer = CaptureWriter(tmp_path / "c.aiflame", new_header(99, "cpu-clock", ["test"], "pid"))
    pipe.open_file(writer)
    pid = os.getpid()
    pipe.drain()
    # read at the stop: the small files at once, all of them once continued, before the evicted ones are caught up
    assert sampler.calls[:3] == [("tables", pid, True), ("tables", pid, False), ("catch_up", 0, False)], \
        sampler.calls
    assert sampler.libc[:2] == [False, True]
    assert pid in pipe.processes.snaps
    # a target read while running (not at a stop) has its tables at once, and a gone one none later
    sampler.calls.clear()
    pipe.snapshot(pid)
    assert sampler.calls == [("tables", pid, False)]
    pipe._tables_due[pid] = []
    pipe.forget(pid)
    pipe.build_due_tables()
    assert sampler.calls == [("tables", pid, False)]

