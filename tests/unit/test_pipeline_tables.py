"""The pipeline builds the CFI tables of a target read while it waits, stopped at a library open, only once it
runs again (issue #25: a command's start-up must not wait for table builds). The process is this one (its real
maps); the sampler is a recorder of what the pipeline asks of it."""

from __future__ import annotations

import os
from pathlib import Path

from aiflame.agent.pipeline import CapturePipeline as Pipeline
from aiflame.core.capture import CaptureWriter, new_header
from aiflame.core.raw import Mapping


class RecordingSampler:
    def __init__(self, pipe: Pipeline, stopped: list[int]) -> None:
        self.pipe, self.stopped = pipe, stopped
        self.calls: list[tuple[str, int, bool]] = []  # (what, pid, whether the target was stopped then)

    def set_mappings(self, pid: int, mappings: list[Mapping]) -> None:
        assert any(m.path.startswith("/") and "x" in m.perms for m in mappings)
        self.calls.append(("tables", pid, pid in self.stopped))

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


def test_tables_of_a_stopped_target_are_built_after_it_runs_again(tmp_path: Path) -> None:
    pipe = Pipeline(runtimes=False)
    stopped: list[int] = []
    sampler = RecordingSampler(pipe, stopped)
    pipe.sampler = sampler  # type: ignore[assignment]
    writer = CaptureWriter(tmp_path / "c.aiflame", new_header(99, "cpu-clock", ["test"], "pid"))
    pipe.open_file(writer)
    pid = os.getpid()
    pipe.drain()
    # read at the stop, built once continued, before the evicted tables are caught up
    assert sampler.calls[:2] == [("tables", pid, False), ("catch_up", 0, False)], sampler.calls
    assert pid in pipe.processes.snaps
    # a target read while running (not at a stop) has its tables at once, and a gone one none later
    sampler.calls.clear()
    pipe.snapshot(pid)
    assert sampler.calls == [("tables", pid, False)]
    pipe._tables_due[pid] = []
    pipe.forget(pid)
    pipe.build_due_tables()
    assert sampler.calls == [("tables", pid, False)]

