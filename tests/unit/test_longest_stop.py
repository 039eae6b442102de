"""tests/hostile.py's stop watcher, which the hostile-user tests trust: one long stop reads long, and many short
stops back to back (a target opening a library in a loop, stopped for a moment at each) do not add up."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from tests.hostile import longest_stop


def _spinner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_one_long_stop_reads_long() -> None:
    p = _spinner()
    try:
        time.sleep(0.2)
        p.send_signal(signal.SIGSTOP)
        t = threading.Timer(1.0, p.send_signal, (signal.SIGCONT,))
        t.start()
        assert longest_stop(p.pid, 1.5) >= 0.7
        t.join()
    finally:
        p.kill()
        p.wait()


def test_short_stops_back_to_back_do_not_add_up() -> None:
    p = _spinner()
    done = threading.Event()

    def flicker() -> None:
        while not done.is_set():
            p.send_signal(signal.SIGSTOP)
            time.sleep(0.1)  # stopped most of the time: a watcher that only looks at the state sees T throughout
            p.send_signal(signal.SIGCONT)
            time.sleep(0.005)

    try:
        time.sleep(0.2)
        t = threading.Thread(target=flicker)
        t.start()
        longest = longest_stop(p.pid, 2.0)
        done.set()
        t.join()
        assert longest < 0.3, longest  # each stop is 0.1 s; reading the state alone gave 0.39 here
    finally:
        p.kill()
        p.wait()
