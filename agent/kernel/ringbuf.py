"""The consumer side of a BPF ring buffer map, read through mmap (no libbpf): one page holding the consumer
position (ours to write), then the producer position page and the data area, mapped twice in a row by the kernel
so a record that wraps reads as one piece. Each record starts with an 8-byte header: u32 length whose top bits
say busy (being written) or discarded, u32 page offset; records are 8-byte aligned."""

from __future__ import annotations

import ctypes
import mmap
import select
import struct
from collections.abc import Callable

BUSY, DISCARD = 1 << 31, 1 << 30
HEADER = 8
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class RingBuffer:
    def __init__(self, map_fd: int, size: int, on_record: Callable[[bytes], None]) -> None:
        """`size`: the map's max_entries (a power of two of pages); `on_record` gets each record's bytes."""
        if size <= 0 or size & (size - 1) or size % mmap.PAGESIZE:
            raise ValueError(f"ring buffer size {size} is not a power-of-two number of pages")
        self._mask = size - 1
        self._on_record = on_record
        self._cons_map = mmap.mmap(map_fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._data = mmap.mmap(map_fd, mmap.PAGESIZE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ,
                               offset=mmap.PAGESIZE)
        self._cons = ctypes.c_uint64.from_buffer(self._cons_map)  # an aligned 8-byte store: the kernel sees it whole
        self._epoll = select.epoll()
        self._epoll.register(map_fd, select.EPOLLIN)

    def consume(self, limit: int = 0) -> int:
        """Hand complete records to the callback, oldest first, all of them or at most `limit` (> 0); returns
        how many."""
        data, mask = self._data, self._mask
        cons = self._cons.value
        n = 0
        while True:
            prod = _U64.unpack_from(data, 0)[0]
            if cons >= prod:
                break
            while cons < prod:
                if n == limit > 0:
                    return n
                at = mmap.PAGESIZE + (cons & mask)
                length = _U32.unpack_from(data, at)[0]
                if length & BUSY:
                    self._cons.value = cons
                    return n
                size = length & ~(BUSY | DISCARD)
                if not length & DISCARD:
                    self._on_record(data[at + HEADER:at + HEADER + size])
                    n += 1
                cons += (size + HEADER + 7) & ~7
                self._cons.value = cons  # free the space as we go, like libbpf
        return n

    def watch(self, fd: int) -> None:
        """Let `fd` becoming readable end a poll too (e.g. the caller's own wakeup pipe); the caller reads it."""
        self._epoll.register(fd, select.EPOLLIN)

    def wait(self, timeout_s: float) -> None:
        """Wait until the kernel signals new records (producers that ask for a wakeup), a watched fd is
        readable or `timeout_s` passes; consuming is the caller's. The wait is rounded up to the next millisecond:
        rounded down, a caller waiting out a deadline spun with zero timeouts through its last millisecond
        (~16 waits a tick, 160 a second)."""
        self._epoll.poll(max(timeout_s, 0.0))

    def close(self) -> None:
        self._epoll.close()
        del self._cons
        self._cons_map.close()
        self._data.close()
