"""Function start addresses from a binary's `.eh_frame_hdr` search table.

Stripped binaries lose their local symbols but keep their unwind tables: every function the compiler emitted has
an FDE, and `.eh_frame_hdr` lists the FDEs' start addresses, sorted, for the unwinder's binary search. An address
no symbol covers can still be told apart by the function it lies in (`python3.11+0x10a5f0` for every sample in
one static function, instead of one frame per instruction).

Only the header every GNU and LLVM linker writes is read (version 1, the .eh_frame pointer as pcrel sdata4, the
count as udata4, the table as datarel sdata4 pairs); any other, or no section, gives no starts. A table that does
not fit its section raises Unreadable. (objfmt/cfi/ decodes every encoding, for unwinding; names need only
this.)
"""

from __future__ import annotations

import bisect
import struct

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.elf_format import SHF_ALLOC, SHF_EXECINSTR

__all__ = ["FunctionStarts", "function_starts"]

# version 1; .eh_frame pointer pcrel|sdata4; count udata4; table datarel|sdata4
_LINKER_HEADER = bytes([1, 0x1B, 0x03, 0x3B])
_MAX_FDES = 1 << 24


class FunctionStarts:
    """Sorted function start addresses, each bounded by the next start and by the end of its code range."""

    def __init__(self, starts: list[int], code: list[tuple[int, int]]) -> None:
        self._starts = starts
        self._code = sorted(code)
        self._code_lo = [lo for lo, _ in self._code]

    def __len__(self) -> int:
        return len(self._starts)

    def find(self, vaddr: int) -> int | None:
        """The start of the function holding link-time address `vaddr`, or None outside every listed function."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        j = bisect.bisect_right(self._code_lo, start) - 1
        # Both ends of the guess must lie in one executable range: a function never spans two sections.
        if j < 0 or not self._code[j][0] <= vaddr < self._code[j][1]:
            return None
        return start


def function_starts(elf: ElfFile) -> FunctionStarts:
    """The function starts `elf`'s `.eh_frame_hdr` lists (none without one, or with an unusual header)."""
    exec_alloc = SHF_EXECINSTR | SHF_ALLOC
    code = [(s.addr, s.addr + s.size) for s in elf.sections if s.flags & exec_alloc == exec_alloc and s.size]
    sec = elf.section(".eh_frame_hdr")
    if sec is None or sec.size < 12 or not code:
        return FunctionStarts([], code)
    data = elf.read_section(sec)  # empty when NOBITS (a debug-only file)
    if len(data) < 12 or data[:4] != _LINKER_HEADER:
        return FunctionStarts([], code)
    bo = "<" if elf.little_endian else ">"
    (count,) = struct.unpack_from(bo + "I", data, 8)
    if count > _MAX_FDES or 12 + 8 * count > len(data):
        raise Unreadable(f"{elf.path}: .eh_frame_hdr: table of {count} entries does not fit")
    table = struct.unpack_from(f"{bo}{2 * count}i", data, 12)
    base = sec.addr
    starts = sorted([base + rel for rel in table[0::2]])  # sorted already in a well-formed table: linear
    return FunctionStarts(starts, code)
