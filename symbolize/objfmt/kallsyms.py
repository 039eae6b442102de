"""Kernel symbols from /proc/kallsyms: address -> nearest preceding text symbol."""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable

__all__ = ["KernelSymbols"]

_RANK = {"T": 0, "t": 1, "W": 2, "w": 3}  # several names at one address: global, local, weak, weak local


class KernelSymbols:
    """A sorted table of kernel text symbols. Empty when addresses are hidden (kptr_restrict shows zeros).
    Compact (an array of addresses and a list of names, ~9 MB for 120k symbols) so a daemon can keep it."""

    def __init__(self, addrs: Iterable[int], names: list[str]) -> None:
        self._addrs = array("Q", addrs)
        self._names = names

    def __len__(self) -> int:
        return len(self._addrs)

    @classmethod
    def from_lines(cls, lines: Iterable[str]) -> KernelSymbols:
        """Parse kallsyms lines: `ADDR TYPE NAME [\t[MODULE]]`; malformed lines and non-text symbols are skipped."""
        keys: list[int] = []  # address * 4 + rank: sorting them orders by address, then by preference
        names: list[str] = []
        for line in lines:
            f = line.split()
            if len(f) < 3 or len(f) > 4 or len(f[1]) != 1 or f[1] not in _RANK:
                continue
            if len(f) == 4 and not (f[3].startswith("[") and f[3].endswith("]")):
                continue
            try:
                addr = int(f[0], 16)
            except ValueError:
                continue
            if not addr:
                continue  # hidden address (kptr_restrict) or an absolute symbol at 0
            keys.append(addr * 4 + _RANK[f[1]])
            names.append(f"{f[2]} {f[3]}" if len(f) == 4 else f[2])
        addrs: list[int] = []
        kept: list[str] = []
        for i in sorted(range(len(keys)), key=keys.__getitem__):
            addr = keys[i] >> 2
            if not addrs or addrs[-1] != addr:  # the first at an address is the preferred one
                addrs.append(addr)
                kept.append(names[i])
        return cls(addrs, kept)

    @classmethod
    def from_text(cls, text: str) -> KernelSymbols:
        return cls.from_lines(text.splitlines())

    @classmethod
    def load(cls, path: str = "/proc/kallsyms") -> KernelSymbols:
        """Read and parse `path` line by line; OSError propagates (the caller decides whether kernel frames
        matter)."""
        with open(path, encoding="utf-8", errors="replace") as f:
            return cls.from_lines(f)

    def lookup(self, addr: int) -> str | None:
        """Name of the text symbol at or before `addr`; None for 0, below the first symbol, or if empty."""
        if not addr:
            return None
        i = bisect.bisect_right(self._addrs, addr) - 1
        return self._names[i] if i >= 0 else None
