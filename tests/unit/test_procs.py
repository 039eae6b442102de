"""What the agent asks about processes (agent.procs), on real processes, and the process table's decisions on
when to read a process's mappings again (agent.process_table), on this process."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from aiflame.agent.process_table import ProcessTable
from aiflame.agent.procs import alive, descendants, is_thread, own_cpu_s, own_rss_bytes, status


def test_states_of_live_stopped_and_exited_processes() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        # Just spawned, it may still be paging in ld.so and libc (disk-sleep) on a loaded host: wait for its sleep.
        for _ in range(1000):
            if status(child.pid) == psutil.STATUS_SLEEPING:
                break
            assert status(child.pid) in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP)
            time.sleep(0.01)
        assert alive(child.pid) and status(child.pid) == psutil.STATUS_SLEEPING
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


def _code_address() -> int:
    """An address inside an executable mapping of this process (libc's getpid)."""
    return ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value or 0


def test_table_reads_again_only_for_addresses_outside_and_not_too_often(monkeypatch: pytest.MonkeyPatch) -> None:
    pid = os.getpid()
    table = ProcessTable()
    assert table.stale([(pid, [1])], 0.5) == [pid]  # never read: at once
    snap = table.read(pid, 1)
    assert snap is not None and table.snaps[pid] is snap and table.unchanged(pid)
    inside = _code_address()
    assert snap.find(inside) is not None
    assert table.stale([(pid, [inside])], 0.0) == []
    assert table.stale([(pid, [8])], 10.0) == []  # outside, but read just now
    assert table.stale([(pid, [8])], 0.0) == [pid]
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 11.0)
    assert table.stale([(pid, [8])], 10.0) == [pid]
    table.exec_seen(pid)
    assert table.exec_seq(pid) == 1 and table.read(pid, 2) is not None and table.snaps[pid].exec_seq == 1
    table.forget(pid)
    assert pid not in table.snaps and table.exec_seq(pid) == 0 and not table.unchanged(pid)
    assert table.read(4_000_000, 3) is None


def test_table_keeps_a_zombies_last_mappings() -> None:
    child = subprocess.Popen(["sleep", "60"])
    table = ProcessTable()
    try:
        time.sleep(0.1)
        first = table.read(child.pid, 1)
        assert first is not None and first.mappings
        child.kill()
        for _ in range(100):
            if status(child.pid) == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.01)
        assert table.read(child.pid, 2) is None and table.snaps[child.pid] is first
    finally:
        child.wait()
