"""The BPF object as plain descriptors: compiled in a child (no LLVM in the agent), maps read and written with our
own syscalls, the ring buffer read through mmap, every descriptor closed at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiflame.agent.kernel.records import PyProcRec, TargetFlag
from aiflame.agent.kernel.sampler import CpuSampler, ProcEvent, SamplerConfig
from aiflame.core.errors import HostError
from aiflame.core.raw import RawSample
from tests.conftest import REPO
from tests.hostile import state


def test_ring_buffer_wraps_without_losing_a_decodable_record() -> None:
    """An 8 KiB ring holds about two full samples: at 999 Hz every few records wrap past the end."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    samples: list[RawSample] = []
    other: list[object] = []
    sampler = CpuSampler(SamplerConfig(frequency=999, ringbuf_pages=2, event="cpu-clock"), samples.append,
                         other.append, other.append)
    try:
        sampler.start([busy.pid])
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            sampler.poll()
            time.sleep(0.002)
        sampler.remove_target(busy.pid)
        time.sleep(0.05)  # a program that saw the target before the removal has finished
        sampler.poll()
        counters = sampler.counters()
    finally:
        sampler.close()
        busy.kill()
        busy.wait()
    assert len(samples) > 300, (len(samples), counters)
    assert all(s.pid == busy.pid and s.tid == busy.pid and s.user for s in samples)
    assert all(isinstance(r, ProcEvent) for r in other)
    # Every sample the program took was either handed over whole or counted as lost (none is half-read).
    assert counters["samples"] == len(samples) + counters["lost"], (counters, len(samples))



def test_a_watched_fd_ends_a_wait() -> None:
    """Samples never wake the agent (they wait for its timer); a readable watched fd (the daemon's wakeup pipe:
    signals, control requests) ends the wait at once."""
    sampler = CpuSampler(SamplerConfig(frequency=99, event="cpu-clock"), lambda s: None, lambda e: None,
                         lambda r: None)
    r, w = os.pipe()
    try:
        sampler.start([os.getpid()])
        sampler.watch(r)
        t0 = time.monotonic()
        sampler.wait(0.3)
        idle = time.monotonic() - t0
        os.write(w, b"x")
        t0 = time.monotonic()
        sampler.wait(30.0)
        woken = time.monotonic() - t0
    finally:
        sampler.close()
        os.close(r)
        os.close(w)
    assert idle >= 0.25, idle  # nothing readable: the whole timeout
    assert woken < 5, woken

def test_waiting_out_a_deadline_does_not_spin() -> None:
    """The session waits in a loop until its next tick: each wait must sleep until then, the last millisecond
    included (rounded down to whole milliseconds, that millisecond was ~80 waits with no timeout, every tick)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sampler = CpuSampler(SamplerConfig(frequency=19, event="cpu-clock"), lambda s: None, lambda e: None,
                         lambda r: None)
    try:
        sampler.start([sleeper.pid])
        waits = 0
        for _ in range(5):  # five ticks of 0.1 s, as agent/session.py waits them out
            tick = time.monotonic() + 0.1
            while (left := tick - time.monotonic()) > 0:
                sampler.wait(left)
                waits += 1
    finally:
        sampler.close()
        sleeper.kill()
        sleeper.wait()
    assert waits <= 25, waits


def test_maps_round_trip() -> None:
    sampler = CpuSampler(SamplerConfig(probes=True), lambda s: None, lambda e: None, lambda r: None)
    try:
        sampler.start([11, 22])
        assert sorted(sampler.targets()) == [11, 22]
        sampler.set_python(22, PyProcRec())
        sampler.set_python(33, PyProcRec())  # not a target: stays out
        flags = sampler._bpf.maps["targets"]
        assert flags.lookup((22).to_bytes(4, "little")) == (TargetFlag.ON | TargetFlag.PY).to_bytes(4, "little")
        assert sorted(sampler.targets()) == [11, 22]
        sampler.clear_python(22)
        assert flags.lookup((22).to_bytes(4, "little")) == TargetFlag.ON.to_bytes(4, "little")
        sampler.remove_target(11)
        sampler.remove_target(11)  # already gone: no error
        assert sampler.targets() == [22]
        for h in (1, 2, 3):
            sampler.mark_library_seen(h)
        assert len(sampler._bpf.maps["libs_seen"].keys()) == 3
        sampler.forget_libraries_seen()
        assert sampler._bpf.maps["libs_seen"].keys() == []
        assert set(sampler.counters()) >= {"samples", "lost"}
    finally:
        sampler.close()


CHILD = """
import os, sys
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
before = set(os.listdir("/proc/self/fd"))
s = CpuSampler(SamplerConfig(probes=True), lambda r: None, lambda r: None, lambda r: None)
s.start([os.getpid()])
maps = open("/proc/self/maps").read()
held = len(set(os.listdir("/proc/self/fd")) - before)
s.close()
leaked = set(os.listdir("/proc/self/fd")) - before
print("llvm" if "LLVM" in maps or "libbcc" in maps else "no-llvm", held, len(leaked))
"""


def test_llvm_stays_in_the_compiler_and_close_releases_every_descriptor() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=REPO, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout.split()
    assert out[0] == "no-llvm", out
    assert int(out[1]) > 10, out  # programs, maps, perf events, links were held...
    assert int(out[2]) == 0, out  # ...and none is left after close


def test_full_maps_are_counted_not_raised() -> None:
    """What a target can fill (its children, its Python processes) ends in a count; a full target map is one
    HostError for the caller to count (issue #20)."""

    sampler = CpuSampler(SamplerConfig(max_targets=4, follow_children=True), lambda s: None, lambda e: None)
    try:
        sampler.start([11, 22, 33, 44])
        with pytest.raises(HostError, match="4 targets already"):
            sampler.add_target(55)
        for pid in range(1000, 1000 + 4097):  # py_procs holds 4096
            sampler.set_python(pid, PyProcRec())
        assert sampler.counters()["py_procs_full"] == 1
    finally:
        sampler.close()


FIFO_OPENER = """
import os, sys
sys.stdin.readline()
print("opening", flush=True)
fd = os.open(sys.argv[1], os.O_RDONLY)  # a FIFO: blocks in openat until a writer comes
print("opened", flush=True)
sys.stdin.readline()
"""


def test_an_open_returning_after_stop_stopping_does_not_stop_its_target(tmp_path: Path) -> None:
    """A library open that entered while the probes could stop targets and returns after stop_stopping() (the
    capture's end) stops nothing: the exit's program is detached too. With it attached the target would stop
    there, its record after the last drain, until the watchdog's deadline."""
    fifo = tmp_path / "libslow.so"
    os.mkfifo(fifo)
    target = subprocess.Popen([sys.executable, "-c", FIFO_OPENER, str(fifo)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    records: list[object] = []
    sampler = CpuSampler(SamplerConfig(frequency=19, probes=True, event="cpu-clock"), lambda s: None,
                         lambda e: None, records.append)
    assert target.stdin is not None and target.stdout is not None
    try:
        sampler.start([target.pid])
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "opening"
        deadline = time.monotonic() + 10
        while state(target.pid) != "S" and time.monotonic() < deadline:  # blocked in openat
            time.sleep(0.01)
        time.sleep(0.1)
        sampler.stop_stopping()
        writer = os.open(fifo, os.O_WRONLY)  # the open returns now
        assert target.stdout.readline().strip() == "opened"
        states = []
        for _ in range(20):
            states.append(state(target.pid))
            time.sleep(0.01)
        sampler.poll()
        os.close(writer)
    finally:
        sampler.close()
        target.kill()
        target.wait()
    assert "T" not in states, states
    assert not records, records  # no stop was sent for it (one would have held it until the watchdog's deadline)
