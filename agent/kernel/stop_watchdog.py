"""The stop watchdog: continues targets our probes stopped when the agent does not, in time or at all.

The runtime probes stop a target (SIGSTOP from BPF, at a library open or in exit()) so that the agent can attach
probes or read mappings before it goes on; BPF records each stop in the `stops` map (pid -> CLOCK_MONOTONIC ns),
and the agent deletes the entry when it continues the target. This process holds that map too, and

* every POLL it continues each target whose entry is older than the deadline (the agent is slow, or hung);
* when the agent's pipe on its stdin closes (the agent exited, or was killed -9), it continues every target still
  recorded, sweeps on for GRACE_S (a stop made as the agent died), then exits;
* after SIGTERM (systemd stopping the unit, e.g. on its OOM policy) it continues every stop at once, until the
  agent is gone.

It runs in its own session (no terminal's ^C, no kill of the agent's process group reaches it) and reports one
line per target it continued on stdout: `PID AGE_MS`. Run by agent/kernel/sampler.py as
`python -I -S stop_watchdog.py MAP_FD DEADLINE_MS`. A process that lowers its own priority calls
`keep_watchdog_priority()` first: watchdogs then start at the priority it had, not at its own (without
CAP_SYS_NICE they could never take it back). Imports only the standard library (a few MB resident): it runs
as a file, outside the aiflame package, and outlives the agent.
"""

import ctypes
import errno
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

GRACE_S = 1.0  # sweeping on after the agent is gone
_SYS_BPF = 321  # x86-64
_LOOKUP, _DELETE, _NEXT_KEY = 1, 3, 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Attr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


def _bpf(cmd: int, fd: int, key: "ctypes.Array[ctypes.c_char] | None",
         value: "ctypes.Array[ctypes.c_char] | None") -> bool:
    attr = _Attr(map_fd=fd, key=ctypes.addressof(key) if key is not None else 0,
                 value=ctypes.addressof(value) if value is not None else 0)
    return int(_libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))) == 0


def _entries(fd: int) -> list[tuple[int, int]]:
    """(pid, stop time) of each recorded stop."""
    out: list[tuple[int, int]] = []
    cur: ctypes.Array[ctypes.c_char] | None = None
    nxt = ctypes.create_string_buffer(4)
    val = ctypes.create_string_buffer(8)
    while _bpf(_NEXT_KEY, fd, cur, nxt):
        key = ctypes.create_string_buffer(nxt.raw, 4)
        if _bpf(_LOOKUP, fd, key, val):
            out.append((int.from_bytes(key.raw, "little"), int.from_bytes(val.raw, "little")))
        cur = key
    return out


def _continue(fd: int, pid: int, since: int, now: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError as e:
        if e.errno != errno.ESRCH:
            raise
    key, val = ctypes.create_string_buffer(pid.to_bytes(4, "little"), 4), ctypes.create_string_buffer(8)
    # Only the stop we saw: a later one of the same process (a new entry time) is the agent's to handle.
    if _bpf(_LOOKUP, fd, key, val) and int.from_bytes(val.raw, "little") == since:
        _bpf(_DELETE, fd, key, None)
    try:
        os.write(1, f"{pid} {(now - since) // 1_000_000}\n".encode())
    except OSError:
        pass  # the agent is gone: nobody to tell


def _sweep(fd: int, older_than_ns: int) -> None:
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    for pid, since in _entries(fd):
        if now - since >= older_than_ns:
            _continue(fd, pid, since, now)


def main() -> int:
    fd, deadline_ns = int(sys.argv[1]), int(sys.argv[2]) * 1_000_000
    poll_s = min(0.05, deadline_ns / 4e9)
    terminating: list[int] = []
    # SIGTERM (systemd stopping the unit, or the OOM policy after the agent was killed): from now on nothing waits
    # for the deadline; we stay until the agent is gone.
    signal.signal(signal.SIGTERM, lambda *_: terminating.append(1))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    clean = False
    while True:
        try:
            ready, _, _ = select.select([0], [], [], poll_s)
        except InterruptedError:
            ready = []
        if ready:
            data = os.read(0, 4096)
            if not data:
                break  # the agent is gone
            clean = clean or b"q" in data  # it stopped stopping targets and is closing: nothing more will come
        _sweep(fd, 0 if terminating else deadline_ns)
    # Died: its programs go as its descriptors close, and a stop made in that moment is recorded all the same:
    # sweep a little longer.
    end = time.monotonic() + (0 if clean else GRACE_S)
    while True:
        _sweep(fd, 0)
        if time.monotonic() >= end:
            return 0
        time.sleep(poll_s)


class _Launcher:
    """A thread that starts watchdogs. Linux niceness belongs to a thread, threads and children inherit their
    creator's, and lowering it back needs CAP_SYS_NICE: this thread, made before the process lowers its priority,
    keeps the old one for the watchdogs it starts."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], subprocess.Popen[bytes]], queue.SimpleQueue[object]]] = (
            queue.SimpleQueue())
        threading.Thread(target=self._run, name="aiflame-watchdog-launcher", daemon=True).start()

    def _run(self) -> None:
        while True:
            start, done = self._jobs.get()
            try:
                done.put(start())
            except BaseException as e:  # handed to the caller, raised there
                done.put(e)

    def start(self, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        done: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._jobs.put((start, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, subprocess.Popen)
        return result


_launcher: _Launcher | None = None


def keep_watchdog_priority() -> None:
    """Stop watchdogs started from now on begin at the calling thread's present priority, whatever it becomes."""
    global _launcher
    if _launcher is None:
        _launcher = _Launcher()


class StopWatchdog:
    """The agent's end: starts the watchdog over the `stops` map fd, collects what it reports, and lets it go
    (`close`: it continues whatever is still recorded, then exits). Dying does the same."""

    def __init__(self, map_fd: int, deadline_ms: int) -> None:
        read_end, self._pipe = os.pipe()  # the write end is ours alone (not inheritable): EOF means we are gone

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(map_fd), str(deadline_ms)],
                stdin=read_end, stdout=subprocess.PIPE, pass_fds=(map_fd,), start_new_session=True, cwd="/")

        try:
            self._proc = _launcher.start(start) if _launcher is not None else start()
        except BaseException:
            os.close(self._pipe)
            raise
        finally:
            os.close(read_end)
        assert self._proc.stdout is not None
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._partial = b""
        self.resumed = 0  # targets it continued (each one we held past the deadline, or left stopped)
        self.worst_ms = 0

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> list[tuple[int, int]]:
        """(pid, ms stopped) of each target it continued since the last call."""
        assert self._proc.stdout is not None
        try:
            data = self._proc.stdout.read() or b""
        except OSError:
            data = b""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            pid, _, ms = line.partition(b" ")
            if pid.isdigit() and ms.isdigit():
                out.append((int(pid), int(ms)))
                self.resumed += 1
                self.worst_ms = max(self.worst_ms, int(ms))
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Let it go once no probe can stop a target any more: it continues what is still recorded and exits."""
        if self._pipe < 0:
            return
        try:
            os.write(self._pipe, b"q")
        except OSError:
            pass
        os.close(self._pipe)
        self._pipe = -1
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self.poll()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
