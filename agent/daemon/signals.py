"""What ends the main loop's wait: SIGTERM (and SIGINT, in a terminal) asks it to stop, SIGHUP to re-read its
configuration, and another thread (a control request) may wake it. All of them write to one non-blocking pipe
(signals through Python's wakeup fd) that the loop's wait watches, so none waits for the next timer.

The keyboard's signals (SIGINT, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU) stop or suspend a process only through a
terminal. A daemon started without one (systemd) ignores them: no terminal may ever stop or suspend it, not even
one a watched process tricked it into opening (issue #20; every file a target names is opened O_NOCTTY anyway).
Started by hand in a terminal, Ctrl-C stops it as SIGTERM does."""

from __future__ import annotations

import os
import signal
from types import FrameType, TracebackType
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
KEYBOARD = (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


def controlling_tty() -> int:
    """This process's controlling terminal (tty_nr of /proc/self/stat: major and minor), 0 when it has none."""
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[4])
    except (OSError, IndexError, ValueError):
        return 0


class LoopSignals:
    """`with LoopSignals() as sig:` installs the handlers and the pipe; leaving restores what was there.
    `keyboard`: whether SIGINT stops us (True) or the keyboard's signals are ignored (False); None: True when we
    have a controlling terminal now."""

    def __init__(self, keyboard: bool | None = None) -> None:
        self.keyboard = keyboard
        self.stop_reason = ""  # the name of the signal that asked to stop, "" while running
        self._reload = False
        self._r = self._w = -1
        self._old_wakeup = -1
        self._old: dict[signal.Signals, Any] = {}  # the handlers that were there

    def __enter__(self) -> LoopSignals:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        keyboard = controlling_tty() != 0 if self.keyboard is None else self.keyboard
        self._old = {s: signal.signal(s, self._on_signal) for s in HANDLED if keyboard or s not in KEYBOARD}
        if not keyboard:
            self._old.update({s: signal.signal(s, signal.SIG_IGN) for s in KEYBOARD})
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
