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
    with LoopSignals(keyboard=True) as sig:
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


def test_without_a_terminal_the_keyboard_cannot_stop_or_suspend_it() -> None:
    keys = (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
    before = {s: signal.getsignal(s) for s in keys}
    with LoopSignals(keyboard=False) as sig:
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in keys)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTSTP)  # ignored: we are not suspended
        assert not _readable_now(sig.fd) and _stop_reason(sig) == ""
        os.kill(os.getpid(), signal.SIGTERM)
        assert _readable(sig.fd) and _stop_reason(sig) == "SIGTERM"
    assert {s: signal.getsignal(s) for s in keys} == before
    with LoopSignals(keyboard=True) as sig:
        os.kill(os.getpid(), signal.SIGINT)
        assert _readable(sig.fd) and _stop_reason(sig) == "SIGINT"
