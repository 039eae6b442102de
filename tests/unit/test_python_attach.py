"""PythonPlugin.attach's retries, with detect_python replaced: what a starting interpreter looks like to it."""

from __future__ import annotations

import os
import time

import pytest

from aiflame.agent.python import detect, runtime
from aiflame.agent.python.detect import PythonNotLoaded
from aiflame.agent.python.runtime import PythonPlugin
from aiflame.core.errors import HostError, Unreadable


class _Detect:
    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.calls = 0
        self.stopped: list[bool] = []

    def __call__(self, pid: int, *, stopped: bool = False) -> None:
        self.calls += 1
        self.stopped.append(stopped)
        if self.error is not None:
            raise self.error


@pytest.fixture
def plugin() -> PythonPlugin:
    p = PythonPlugin()
    p.RETRY_S = 0.0  # no waiting between timed tries
    return p


def test_forced_tries_leave_the_timed_ones(monkeypatch: pytest.MonkeyPatch, plugin: PythonPlugin) -> None:
    """Tries at target stops (one per library open while the interpreter starts) use up no timed retry."""
    detect = _Detect(HostError("CPython 3.12 in pid 7: layout check failed: no interpreter"))
    monkeypatch.setattr(runtime, "detect_python", detect)
    for _ in range(3 * PythonPlugin.RETRIES):
        assert plugin.attach(7, 1, force=True) is None
    assert detect.calls == 3 * PythonPlugin.RETRIES and not plugin.warnings
    for _ in range(2 * PythonPlugin.RETRIES):
        plugin.attach(7, 1)
    assert detect.calls == 4 * PythonPlugin.RETRIES  # then the timed ones stop
    assert len(plugin.warnings) == 1 and "no interpreter" in plugin.warnings[0]
    # a forced try is made with the target being stopped: its retries pause less
    assert detect.stopped == [True] * 3 * PythonPlugin.RETRIES + [False] * PythonPlugin.RETRIES


def test_a_stopped_target_is_retried_after_short_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed live check is retried after a pause (a torn read: the target runs, or its threads have not all
    stopped yet); at a stop the pauses are short, since each one holds the target longer."""
    checks: list[int] = []
    sleeps: list[float] = []

    def failing_check(pid: int, *a: object) -> None:
        checks.append(pid)
        raise Unreadable("no interpreter (starting up or finalizing)")

    monkeypatch.setattr(detect, "_check_live", failing_check)
    monkeypatch.setattr(time, "sleep", sleeps.append)
    for stopped, pauses in ((True, [0.001, 0.002]), (False, [0.01, 0.02])):
        checks.clear()
        sleeps.clear()
        with pytest.raises(HostError, match="layout check failed"):
            detect.detect_python(os.getpid(), stopped=stopped)
        assert len(checks) == detect._CHECK_TRIES == 3 and sleeps == pauses


def test_not_loaded_yet_is_not_absent(monkeypatch: pytest.MonkeyPatch, plugin: PythonPlugin) -> None:
    detect = _Detect(PythonNotLoaded("pid 7: libpython is not mapped yet"))
    monkeypatch.setattr(runtime, "detect_python", detect)
    assert plugin.attach(7, 1) is None
    detect.error = None  # now: "no CPython in this image"
    assert plugin.attach(7, 1) is None
    assert plugin.attach(7, 1, force=True) is None
    assert detect.calls == 2  # asked again after "not loaded"; not after "no CPython"
