"""The main loop's signals alone: real signals sent to this process, and the pipe the loop's wait watches."""

from __future__ import annotations

import os
import select
import signal

from aiflame.agent.daemon.signals import LoopSignals


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 1.0)[0])


def test_signals_ask_and_wake() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    with LoopSignals() as sig:
        assert not _readable_now(sig.fd)
        os.kill(os.getpid(), signal.SIGHUP)
        assert _readable(sig.fd) and sig.take_reload() and not sig.take_reload()
        sig.clear()
        assert not _readable_now(sig.fd) and _stop_reason(sig) == ""
        sig.wake()
        assert _readable(sig.fd)
        sig.clear()
        os.kill(os.getpid(), signal.SIGTERM)
        assert _readable(sig.fd) and _stop_reason(sig) == "SIGTERM"
        for _ in range(100_000):  # a full pipe: wake() must not block or raise
            sig.wake()
    assert {s: signal.getsignal(s) for s in before} == before


def _readable_now(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _stop_reason(sig: LoopSignals) -> str:
    return sig.stop_reason
