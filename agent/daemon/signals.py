"""What ends the main loop's wait: SIGTERM and SIGINT ask it to stop, SIGHUP to re-read its configuration, and
another thread (a control request) may wake it. All of them write to one non-blocking pipe (signals through
Python's wakeup fd) that the loop's wait watches, so none waits for the next timer."""

from __future__ import annotations

import os
import signal
from types import FrameType, TracebackType
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class LoopSignals:
    """`with LoopSignals() as sig:` installs the handlers and the pipe; leaving restores what was there."""

    def __init__(self) -> None:
        self.stop_reason = ""  # the name of the signal that asked to stop, "" while running
        self._reload = False
        self._r = self._w = -1
        self._old_wakeup = -1
        self._old: dict[signal.Signals, Any] = {}  # the handlers that were there

    def __enter__(self) -> LoopSignals:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._on_signal) for s in HANDLED}
        return self

    def __exit__(self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._r)
        os.close(self._w)

    @property
    def fd(self) -> int:
        """Readable when the loop should look: a signal came or `wake()` was called."""
        return self._r

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self._reload = True
        else:
            self.stop_reason = signal.Signals(signum).name

    def take_reload(self) -> bool:
        """True once after each SIGHUP."""
        asked, self._reload = self._reload, False
        return asked

    def wake(self) -> None:
        """End the main loop's wait now (from another thread)."""
        try:
            os.write(self._w, b"\0")
        except OSError:  # full (a wakeup is pending anyway) or closed (stopping)
            pass

    def clear(self) -> None:
        """Empty the pipe (the loop has looked)."""
        try:
            while os.read(self._r, 512):
                pass
        except OSError:  # empty
            pass
