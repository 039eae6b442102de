"""A binary's function symbols in compact form: sorted start and end addresses in two u64 arrays and the names in
one byte string, looked up by nearest preceding start. It stands in for a list of Symbol tuples (libtorch_cpu:
~10^5 functions took ~120 MB as Python objects and 2.7 s to read from the ELF at every run) and is saved in the
symbol cache as it is, so a later run reads one file (tens of ms) instead of the symbol tables.

File layout (little endian), version 1::

    magic "AIFLSYM1", u32 count, u32 names_len, u32 source_len
    source (utf-8: the debug file the names came from, empty for none)
    u64 starts[count], u64 ends[count], u32 name_offsets[count + 1], names (utf-8, surrogateescape)
"""

from __future__ import annotations

import bisect
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from itertools import pairwise

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf_symbols import Symbol

__all__ = ["SymbolIndex"]

MAGIC = b"AIFLSYM1"
_HEADER = struct.Struct("<8sIII")
_MAX_ADDR = (1 << 64) - 1
_LOOKBACK = 16  # how many preceding symbols may cover an address (nested or overlapping symbols)


def _le(a: array[int]) -> array[int]:
    if sys.byteorder != "little":
        a.byteswap()
    return a


class SymbolIndex:
    """Nearest-preceding-symbol lookup over sorted symbols with one symbol per address."""

    def __init__(self, starts: array[int], ends: array[int], offsets: array[int], names: bytes | bytearray,
                 source: str | None = None) -> None:
        self._starts = starts
        self._ends = ends
        self._offsets = offsets
        self._names = names
        self.source = source  # the debug file the names came from, if any

    @classmethod
    def merged(cls, *lists: Sequence[Symbol], source: str | None = None) -> SymbolIndex:
        """One symbol per address; earlier lists win (a debug file's .symtab before the binary's own). Built
        without a second copy of the names: the lists of a large binary already take ~10^2 MB."""
        lists = tuple(syms for syms in lists if syms)
        if len(lists) == 1 and all(a.addr < b.addr for a, b in pairwise(lists[0])):
            syms: Sequence[Symbol] = lists[0]  # function_symbols() gives them so: no merge needed
        else:
            by_addr: dict[int, Symbol] = {}
            for one in lists:
                for s in one:
                    by_addr.setdefault(s.addr, s)
            syms = [by_addr[a] for a in sorted(by_addr)]
        starts = array("Q", (s.addr for s in syms))
        ends = array("Q", (min(s.addr + max(s.size, 1), _MAX_ADDR) for s in syms))
        offsets, blob = array("I", [0]), bytearray()
        for s in syms:
            blob += s.name.encode("utf-8", "surrogateescape")
            offsets.append(len(blob))
        return cls(starts, ends, offsets, blob, source)

    def __len__(self) -> int:
        return len(self._starts)

    def name(self, i: int) -> str:
        return self._names[self._offsets[i]:self._offsets[i + 1]].decode("utf-8", "surrogateescape")

    def find(self, vaddr: int) -> str | None:
        """The name of the symbol covering `vaddr`, or None."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        for j in range(i, max(i - _LOOKBACK, -1), -1):
            if vaddr < self._ends[j]:
                return self.name(j)
        return None

    def pieces(self) -> Iterator[bytes | memoryview]:
        """The saved form in pieces, to write without one more copy of the names."""
        source = (self.source or "").encode("utf-8", "surrogateescape")
        yield _HEADER.pack(MAGIC, len(self), len(self._names), len(source)) + source
        for a in (self._starts, self._ends, self._offsets):
            yield _le(array(a.typecode, a)).tobytes()
        yield memoryview(self._names)

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces())

    @classmethod
    def from_bytes(cls, data: bytes) -> SymbolIndex:
        """Read what to_bytes wrote; Unreadable for anything else (short, long, inconsistent)."""
        if len(data) < _HEADER.size:
            raise Unreadable("symbol index: shorter than its header")
        magic, n, names_len, source_len = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise Unreadable("symbol index: not an aiflame symbol index (version 1)")
        at = _HEADER.size
        if len(data) != at + source_len + 16 * n + 4 * (n + 1) + names_len:
            raise Unreadable(f"symbol index: {len(data)} bytes, not what {n} symbols take")
        source = data[at:at + source_len].decode("utf-8", "surrogateescape")
        at += source_len
        starts, ends, offsets = array("Q"), array("Q"), array("I")
        for a, size in ((starts, 8 * n), (ends, 8 * n), (offsets, 4 * (n + 1))):
            a.frombytes(data[at:at + size])
            _le(a)
            at += size
        if offsets[0] != 0 or offsets[-1] != names_len or any(b < a for a, b in pairwise(offsets)):
            raise Unreadable("symbol index: name offsets out of order")
        if any(b <= a for a, b in pairwise(starts)):
            raise Unreadable("symbol index: addresses out of order")
        return cls(starts, ends, offsets, data[at:], source or None)
