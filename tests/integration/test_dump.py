"""`aiflame dump` against real interpreters, with py-spy dump as the oracle in the same run: every thread's Python
frames (names, files, lines) and the GIL holder on the five interpreters of the matrix; native frames merged
around them; and hostile targets (threads exiting while dumped, thousands of threads, a process gone, a process
without Python) that give clear output or one line, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import INTERPRETERS
from tests.integration.conftest import aiflame

PY_SPY = Path(sys.executable).parent / "py-spy"

# Four threads, each parked for good in one named function: the stacks stay the same between the oracle's dump
# and ours. Only `spinner` runs Python, so it holds the GIL whenever anyone does.
TARGET = textwrap.dedent('''
    import threading, time

    def spinner():
        x = 0
        while True:
            x += 1

    def sleeper():
        while True:
            time.sleep(60)

    def waiter(ev):
        ev.wait()

    ev = threading.Event()
    threads = [threading.Thread(target=spinner, daemon=True), threading.Thread(target=sleeper, daemon=True),
               threading.Thread(target=waiter, args=(ev,), daemon=True)]
    for t in threads:
        t.start()

    def main_loop():
        while True:
            time.sleep(60)

    print("ready", flush=True)
    main_loop()
''')
WANT = {"spinner", "sleeper", "waiter", "main_loop"}


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    python = request.param
    if not os.path.exists(python):
        pytest.skip(f"{python} is not installed")
    script = tmp_path / "target.py"
    script.write_text(TARGET)
    proc = subprocess.Popen([python, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _py_spy(pid: int) -> dict[int, list[tuple[str, str, int]]]:
    out = subprocess.run([str(PY_SPY), "dump", "--json", "-p", str(pid)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return {t["os_thread_id"]: [(f["name"], os.path.basename(f["filename"]), f["line"]) for f in t["frames"]]
            for t in json.loads(out)}


def _ours(pid: int, *args: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(aiflame("dump", "--pid", str(pid), "--json", *args).stdout)
    return doc


def _python_frames(t: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [(f["name"], os.path.basename(f["file"]), f["line"]) for f in t["frames"] if f["kind"] == "python"]


def _settled(pid: int) -> dict[int, list[tuple[str, str, int]]]:
    """The oracle's dump once every thread is inside its function (threads start asynchronously)."""
    for _ in range(200):
        spy = _py_spy(pid)
        leaves = {fr[0][0] for fr in spy.values() if fr} | {f[0] for fr in spy.values() for f in fr}
        if WANT <= leaves and len(spy) == 4:
            return spy
        time.sleep(0.05)
    raise AssertionError(f"threads never settled: {spy}")


@pytest.mark.parametrize("target", INTERPRETERS, indirect=True)
def test_dump_names_every_threads_python_frames_as_py_spy_does(target: subprocess.Popen[str]) -> None:
    # Oracle: py-spy dump of the same process, in the same run
    spy = _settled(target.pid)
    doc = _ours(target.pid)
    ours = {t["tid"]: t for t in doc["threads"]}
    assert set(ours) == set(spy), (ours.keys(), spy.keys())
    assert doc["python"].startswith("CPython 3."), doc
    assert doc["stopped_s"] > 0  # the threads were stopped (for how long: bench/dump_time.py)
    for tid, frames in spy.items():
        got = _python_frames(ours[tid])
        # py-spy's sleeping spinner may be one bytecode apart from ours: the spinner's line may differ, nothing else
        if frames and frames[0][0] == "spinner":
            assert [f[:2] for f in got] == [f[:2] for f in frames], (tid, got, frames)
        else:
            assert got == frames, (tid, got, frames)
    by_leaf = {_python_frames(t)[0][0]: t for t in doc["threads"] if _python_frames(t)}
    assert set(by_leaf) >= {"spinner", "sleeper", "main_loop"}, by_leaf.keys()
    # states from /proc, read before the threads were stopped: the spinner runs (or waits for a CPU), the
    # sleeper sleeps
    assert by_leaf["spinner"]["state"] == "running", by_leaf["spinner"]
    assert by_leaf["sleeper"]["state"] == "sleeping", by_leaf["sleeper"]
    # the GIL: readable on every interpreter of the matrix; only the spinner can hold it
    assert doc["gil_known"], doc["notes"]
    holders = [t for t in doc["threads"] if t["gil"]]
    assert all(_python_frames(t)[0][0] == "spinner" for t in holders), holders
    # native frames merged around the Python ones: the sleeper's leaf is the C sleep under time.sleep, and its
    # root the thread's start
    sleeper = [f["name"] for f in by_leaf["sleeper"]["frames"]]
    assert "clock_nanosleep" in sleeper[0] or "nanosleep" in sleeper[0] or "select" in sleeper[0], sleeper
    assert sleeper[-1] in ("clone3", "clone", "start_thread"), sleeper
    # without stopping anything: the same Python frames, no native ones
    nb = {t["tid"]: t for t in _ours(target.pid, "--nonblocking")["threads"]}
    assert _ours(target.pid, "--nonblocking")["stopped_s"] == 0
    for tid, frames in spy.items():
        assert all(f["kind"] == "python" for f in nb[tid]["frames"]), nb[tid]
        assert [f[0] for f in _python_frames(nb[tid])] == [f[0] for f in frames]
    # the target runs on after every dump: no thread left stopped or traced
    for tid in spy:
        stat = Path(f"/proc/{target.pid}/task/{tid}/stat").read_text()
        assert stat[stat.rfind(")") + 2] in "RS", stat


# Another debugger holding the target (as strace -f would): every thread seized, none stopped.
TRACER = textwrap.dedent('''
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    pid = int(sys.argv[1])
    for tid in os.listdir(f"/proc/{pid}/task"):
        assert libc.ptrace(0x4206, int(tid), None, None) == 0, ctypes.get_errno()  # PTRACE_SEIZE
    print("traced", flush=True)
    time.sleep(600)
''')


@pytest.mark.parametrize("target", [INTERPRETERS[2]], indirect=True)
def test_dump_of_a_process_another_tracer_holds(target: subprocess.Popen[str]) -> None:
    # Oracle: py-spy dump of the same process (the target fixture's)
    spy = _settled(target.pid)
    tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(target.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout is not None and tracer.stdout.readline().strip() == "traced"
        doc = _ours(target.pid)
        assert any(f"already traced by pid {tracer.pid}" in n for n in doc["notes"]), doc["notes"]
        ours = {t["tid"]: t for t in doc["threads"]}
        for tid, frames in spy.items():  # the Python frames still, read without stopping
            assert [f[0] for f in _python_frames(ours[tid])] == [f[0] for f in frames], (tid, ours[tid])
    finally:
        tracer.kill()  # its tracees are detached (and go on running) when it dies
        tracer.wait()


def test_dump_gives_native_stacks_of_a_process_without_python(tmp_path: Path) -> None:
    # Oracle: by construction — `sleep`, parked in nanosleep
    proc = subprocess.Popen(["sleep", "600"])
    try:
        doc = _ours(proc.pid)
        assert doc["python"] == ""
        (t,) = doc["threads"]
        names = [f["name"] for f in t["frames"]]
        assert t["state"] == "sleeping" and any("nanosleep" in n for n in names), t
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("which", ["gone", "kernel thread"])
def test_dump_of_what_has_no_user_stack_is_one_line(which: str) -> None:
    if which == "gone":
        proc = subprocess.Popen(["true"])
        proc.wait()
        pid = proc.pid
    else:
        pid = 2  # kthreadd
    r = aiflame("dump", "--pid", str(pid), check=False)
    assert r.returncode != 0 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    if which == "kernel thread":
        assert "kernel thread" in r.stderr, r.stderr


HOSTILE_CHURN = textwrap.dedent('''
    import threading, time

    def short():
        sum(range(1000))

    print("ready", flush=True)
    while True:
        ts = [threading.Thread(target=short) for _ in range(20)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
''')

HOSTILE_MANY = textwrap.dedent('''
    import threading, sys
    threading.stack_size(64 * 1024)
    ev = threading.Event()
    ts = [threading.Thread(target=ev.wait, daemon=True) for _ in range(int(sys.argv[1]))]
    for t in ts:
        t.start()
    print("ready", flush=True)
    ev.wait()
''')


def _start(tmp: Path, code: str, *args: str) -> subprocess.Popen[str]:
    script = tmp / "hostile.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_dump_survives_threads_exiting_while_it_reads(tmp_path: Path) -> None:
    proc = _start(tmp_path, HOSTILE_CHURN)
    try:
        for _ in range(5):
            r = aiflame("dump", "--pid", str(proc.pid), check=False)
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
            assert f"Thread {proc.pid} " in r.stdout, r.stdout  # the main thread is always there
        os.kill(proc.pid, 0)  # and the target lives on
    finally:
        proc.kill()
        proc.wait()


def test_dump_of_thousands_of_threads(tmp_path: Path) -> None:
    # Oracle: by construction — 3000 threads started, each waiting on one lock
    proc = _start(tmp_path, HOSTILE_MANY, "3000")
    try:
        doc = _ours(proc.pid)
        assert len(doc["threads"]) == 3001, len(doc["threads"])
        waiting = [t for t in doc["threads"] if _python_frames(t) and _python_frames(t)[0][0] == "Condition.wait"]
        assert len(waiting) == 3001, len(waiting)  # every thread (the main one too) named
        assert all(t["state"] != "exited" for t in doc["threads"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


TWO_SPINNERS = textwrap.dedent('''
    import threading, time
    def spin_a():
        while True: pass
    def spin_b():
        while True: pass
    for f in (spin_a, spin_b):
        threading.Thread(target=f, daemon=True).start()
    print("ready", flush=True)
    time.sleep(600)
''')


def test_dump_names_the_gil_holder_and_the_thread_waiting_for_it(tmp_path: Path) -> None:
    # Oracle: by construction — spinning threads take the GIL, the main thread sleeps without it
    script = tmp_path / "two.py"
    script.write_text(TWO_SPINNERS)
    proc = subprocess.Popen([INTERPRETERS[2], str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        _settled_two(proc.pid)
        waits = 0
        for _ in range(10):
            doc = _ours(proc.pid)
            spinners = {t["tid"] for t in doc["threads"] if _python_frames(t)
                        and _python_frames(t)[0][0] in ("spin_a", "spin_b")}
            holders = [t["tid"] for t in doc["threads"] if t["gil"]]
            waiting = [t["tid"] for t in doc["threads"] if t["waits_for_gil"]]
            assert len(holders) <= 1 and set(holders) <= spinners, doc  # never the sleeping main thread
            assert set(waiting) <= spinners - set(holders), doc
            waits += len(waiting)
            if waits >= 3:
                break
        # the spinner without the GIL waits in take_gil nearly all the time: seen in most dumps
        assert waits >= 3, waits
    finally:
        proc.kill()
        proc.wait()


def _settled_two(pid: int) -> None:
    for _ in range(200):
        spy = _py_spy(pid)
        if {"spin_a", "spin_b"} <= {fr[0][0] for fr in spy.values() if fr}:
            return
        time.sleep(0.05)
    raise AssertionError(f"spinners never started: {spy}")
