"""The runtime events a capture keeps for its GPU code lookup (agent.gpu_code.LaunchLog): all of them for one
capture, a bounded set for the daemon."""

from __future__ import annotations

from aiflame.agent.gpu_code import LaunchLog
from aiflame.core.raw import RawEvent


def _reg(pid: int, handle: int) -> RawEvent:
    return RawEvent("cuda", "__cudaRegisterFatBinary", "meta", pid, pid, 1, args={"handle": handle})


def _launch(pid: int, func: int, t: int = 1) -> RawEvent:
    return RawEvent("cuda", "cudaLaunchKernel", "compute", pid, pid, t, args={"func": func}, strs={"name": "k"})


def _copy(pid: int) -> RawEvent:
    return RawEvent("nccl", "ncclAllReduce", "collective", pid, pid, 1)


def test_a_capture_that_ends_keeps_everything() -> None:
    log = LaunchLog()
    events = [_reg(1, 10), _launch(1, 5), _launch(1, 5, 2), _copy(1)]
    log.add(events)
    assert log.events == events and log.saw_runtime("nccl") and not log.saw_runtime("level_zero")


def test_the_daemon_keeps_registrations_and_one_launch_per_kernel() -> None:
    log = LaunchLog(bounded=True)
    log.add([_reg(1, 10), _launch(1, 5), _launch(1, 5, 2), _copy(1), _launch(2, 5)])
    log.add([_launch(1, 5, 3), _launch(1, 6)])
    assert log.events == [_reg(1, 10), _launch(1, 5), _launch(2, 5), _launch(1, 6)]
    log.end_file()  # the window is written: its launches go, registrations stay while their process lives
    assert log.events == [_reg(1, 10)]
    log.forget(1)
    assert log.events == []
