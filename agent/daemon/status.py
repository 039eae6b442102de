"""The daemon's status, as a control client sees it. Only the main loop may read its collector, so a status is
built there, and only when a client asks (an idle daemon spends nothing on it): the control thread posts a
request, wakes the loop and waits a little; the loop answers between two drains. A loop that is busy (a
capture starting) leaves the client the last status built."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

STATUS_WAIT_S = 2.0  # a status request waits this long for the main loop to answer, then gets the last one


class StatusBoard:
    def __init__(self, wake: Callable[[], None], wait_s: float = STATUS_WAIT_S) -> None:
        self._wake = wake
        self._wait_s = wait_s
        self._status: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._waiters: list[threading.Event] = []

    def fresh(self) -> dict[str, Any]:
        """(Control thread) ask the main loop for a status and wait for it; the last one if it is busy."""
        ready = threading.Event()
        with self._lock:
            self._waiters.append(ready)
        self._wake()
        ready.wait(self._wait_s)
        with self._lock:
            if ready in self._waiters:
                self._waiters.remove(ready)
            return dict(self._status)

    def answer(self, build: Callable[[], dict[str, Any]]) -> None:
        """(Main loop) when a client waits: build a status and hand it to every client waiting."""
        with self._lock:
            waiting, self._waiters = self._waiters, []
        if waiting:
            self.publish(build())
            for ready in waiting:
                ready.set()

    def publish(self, status: dict[str, Any]) -> None:
        with self._lock:
            self._status = status
