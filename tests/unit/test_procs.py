"""What the agent asks about processes (agent.procs), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil

from aiflame.agent.procs import alive, descendants, is_thread, own_cpu_s, own_rss_bytes, status


def test_states_of_live_stopped_and_exited_processes() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert alive(child.pid) and status(child.pid) in (psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING)
        child.send_signal(19)  # SIGSTOP
        for _ in range(100):
            if status(child.pid) == psutil.STATUS_STOPPED:
                break
            time.sleep(0.01)
        assert status(child.pid) == psutil.STATUS_STOPPED and alive(child.pid)
        child.kill()
        for _ in range(100):  # not waited for yet: a zombie
            if status(child.pid) == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.01)
        assert status(child.pid) == psutil.STATUS_ZOMBIE and not alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert status(child.pid) is None and not alive(child.pid)
    assert status(0) is None and status(-1) is None


def test_descendants_come_parents_first() -> None:
    script = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(500):
            below = descendants(parent.pid)
            if below:
                break
            time.sleep(0.01)
        (grandchild,) = descendants(parent.pid)
        assert psutil.Process(grandchild).ppid() == parent.pid
        mine = descendants(os.getpid())
        assert mine.index(parent.pid) < mine.index(grandchild)  # a child before its own child
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()
    assert descendants(parent.pid) == []


def test_threads_are_not_processes() -> None:
    tids: list[int] = []
    done = threading.Event()

    def run() -> None:
        tids.append(threading.get_native_id())
        done.wait(10)

    t = threading.Thread(target=run)
    t.start()
    try:
        while not tids:
            time.sleep(0.01)
        assert is_thread(tids[0]) and not is_thread(os.getpid())
    finally:
        done.set()
        t.join()


def test_own_usage() -> None:
    cpu0 = own_cpu_s()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert own_cpu_s() - cpu0 >= 0.04  # microseconds, not 10 ms ticks
    assert own_rss_bytes() > 1 << 20
