"""Reading a live process's memory through `/proc/PID/mem`: the one reader of the project.

Python code objects are read here while their process lives (symbolize/python/code.py, agent/python/), and so
is what a runtime probe could not copy in BPF: pages not yet resident, strings longer than a probe's buffer
(agent/runtimes/base.py wraps this for its plug-ins, where a failed read is an answer, not an error).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from aiflame.core.errors import TargetGone

__all__ = ["ProcessMemory", "Reader", "read_cstring"]

Reader = Callable[[int, int], bytes]  # (address, size) -> exactly `size` bytes, or TargetGone
_PAGE = 4096


class ProcessMemory:
    """Reads from `/proc/PID/mem` with pread; every failure (including short reads) is TargetGone.

    The file stays open for the reader's life, so a walk of many small reads costs one open."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._fd: int | None = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise TargetGone(f"pid {pid}: cannot open memory: {e.strerror or e}") from None

    def read(self, addr: int, size: int) -> bytes:
        if self._fd is None:
            raise TargetGone(f"pid {self.pid}: memory reader is closed")
        if addr <= 0 or size < 0 or addr + size > 1 << 64:
            raise TargetGone(f"pid {self.pid}: bad address {addr:#x}")
        try:
            data = os.pread(self._fd, size, addr)
        except (OSError, OverflowError) as e:
            msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise TargetGone(f"pid {self.pid}: cannot read {size} bytes at {addr:#x}: {msg}") from None
        if len(data) != size:
            raise TargetGone(f"pid {self.pid}: short read at {addr:#x}")
        return data

    def u64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ProcessMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_cstring(read: Reader, addr: int, limit: int) -> bytes:
    """The NUL-terminated string at `addr`, without its NUL; exactly `limit` bytes when none came within them.

    Reads stay within one page each, so a string that ends right before an unmapped page reads whole; a read
    that still fails is retried for its first byte alone (a reader may map less than whole pages, as test
    doubles do). Errors of `read` on that byte propagate."""
    out = b""
    while len(out) < limit:
        at = addr + len(out)
        n = min(_PAGE - at % _PAGE, limit - len(out))
        try:
            chunk = read(at, n)
        except TargetGone:
            if n == 1:
                raise
            chunk = read(at, 1)
        nul = chunk.find(b"\0")
        if nul >= 0:
            return out + chunk[:nul]
        out += chunk
    return out
