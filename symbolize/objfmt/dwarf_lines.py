"""Address -> (source file, line) from DWARF `.debug_line`, decoded one compile unit at a time.

A lookup decodes only the line program of the compile unit (CU) covering the address: `.debug_aranges` maps
addresses to CUs; CUs it leaves out (or all of them, for producers that emit none, like clang) are placed by
the low_pc/high_pc/ranges of their top DIE, and a CU without those is decoded whole once to learn its ranges.
From `.debug_info` only each CU's header and top DIE are read (for DW_AT_stmt_list and DW_AT_comp_dir), in
small pieces, so a multi-gigabyte debug file costs little more than the CUs actually hit (compressed sections
are the exception: zlib streams must be inflated whole).

This is a small reader written for exactly that from the DWARF 2-5 specifications: with pyelftools the same
work was ~10x slower (it parses whole abbreviation tables per CU and copies a state object per row). Every
malformed input ends in `Unreadable` or an IndexError/struct.error, which switch off the CU (or the table), so
`lookup` never raises.
"""

from __future__ import annotations

import bisect
import logging

from aiflame.symbolize.objfmt.dwarf_forms import DWARF_ERRORS, F_LINE_STRP, ByteOrder, initial_length
from aiflame.symbolize.objfmt.dwarf_program import FileNames, parse_line_header, run_line_program
from aiflame.symbolize.objfmt.dwarf_units import CompileUnits
from aiflame.symbolize.objfmt.elf import ElfFile

__all__ = ["LineTable"]

log = logging.getLogger(__name__)


class _CuLines:
    """Decoded rows of one line program, sorted by address; a row with line 0 carries no line (e.g. it ends a
    sequence), so addresses from there up to the next row resolve to nothing."""

    __slots__ = ("addrs", "rows")

    def __init__(self, addrs: list[int], rows: list[tuple[str, int]]) -> None:
        self.addrs = addrs
        self.rows = rows

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        i = bisect.bisect_right(self.addrs, vaddr) - 1
        if i < 0:
            return None
        file, line = self.rows[i]
        return (file, line) if line > 0 else None

    def ranges(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence (rows between consecutive line-0 end markers)."""
        out: list[tuple[int, int]] = []
        start: int | None = None
        for a, (_f, line) in zip(self.addrs, self.rows, strict=True):
            if line and start is None:
                start = a
            elif not line and start is not None:
                out.append((start, a))
                start = None
        return out


class LineTable:
    """Source lines of one ELF file (the binary, or its separate debug file). Lazy; `lookup` never raises."""

    def __init__(self, elf: ElfFile) -> None:
        self._elf = elf
        self._units = CompileUnits(elf)
        self._order: ByteOrder = "little" if elf.little_endian else "big"
        self._broken = not elf.has_dwarf_lines
        self._ready = False
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, int]] = []  # (start, end, CU offset), sorted by start
        self._indexed: set[int] = set()
        self._full_scan_done = False
        self._cu_lines: dict[int, _CuLines | None] = {}  # by CU offset
        self._programs: dict[tuple[int, str], _CuLines] = {}  # by (stmt_list, comp_dir)

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(file path, line) of the instruction at link-time address `vaddr`, or None."""
        if self._broken:
            return None
        try:
            if not self._ready:
                self._ready = True
                self._index_aranges()
            hit = self._lookup_indexed(vaddr)
            if hit is None and not self._full_scan_done:
                self._full_scan_done = True
                self._index_remaining_units()
                hit = self._lookup_indexed(vaddr)
            return hit
        except DWARF_ERRORS as e:
            log.debug("line table of %s disabled: %r", self._elf.path, e)
            self._broken = True
            return None

    # --- the address index ---------------------------------------------------------------------------------

    def _add_span(self, start: int, end: int, cu: int) -> None:
        if not 0 < start < end:
            return  # address 0 and inverted ranges come from code the linker discarded
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._spans.insert(i, (start, end, cu))

    def _index_aranges(self) -> None:
        self._spans, self._indexed = self._units.aranges()
        self._starts = [s for s, _e, _c in self._spans]

    def _index_remaining_units(self) -> None:
        """Place each CU that aranges left out, by its top DIE's ranges or else its decoded line program."""
        for unit in self._units.compile_units():
            if unit.offset in self._indexed:
                continue
            self._indexed.add(unit.offset)
            ranges: list[tuple[int, int]] | None = None
            try:
                ranges = self._units.ranges(unit)
            except DWARF_ERRORS as e:
                log.debug("%s: CU at %#x has unreadable ranges (%r)", self._elf.path, unit.offset, e)
            if ranges is None:
                lines = self._lines_of(unit.offset)
                ranges = lines.ranges() if lines else []
            for start, end in ranges:
                self._add_span(start, end, unit.offset)

    def _lookup_indexed(self, vaddr: int) -> tuple[str, int] | None:
        i = bisect.bisect_right(self._starts, vaddr) - 1
        # Spans of different CUs may nest (rare); check a few predecessors too.
        for j in range(i, max(i - 4, -1), -1):
            start, end, cu = self._spans[j]
            if start <= vaddr < end:
                lines = self._lines_of(cu)
                hit = lines.lookup(vaddr) if lines else None
                if hit:
                    return hit
        return None

    # --- line programs -------------------------------------------------------------------------------------

    def _lines_of(self, cu_offset: int) -> _CuLines | None:
        if cu_offset in self._cu_lines:
            return self._cu_lines[cu_offset]
        lines: _CuLines | None = None
        try:
            key = self._units.line_program(self._units.unit_at(cu_offset))
            if key is not None:
                lines = self._programs.get(key)
                if lines is None:
                    lines = self._programs[key] = self._decode_program(*key)
        except DWARF_ERRORS as e:
            log.debug("%s: CU at %#x has no usable line program (%r)", self._elf.path, cu_offset, e)
        self._cu_lines[cu_offset] = lines
        return lines

    def _decode_program(self, offset: int, comp_dir: str) -> _CuLines:
        """Parse the line program header at `offset` in .debug_line and run the program."""
        sec = self._units.need("line")
        length, offsize, _p = initial_length(sec.read(offset, 12), 0, self._order)
        data = sec.read(offset, (12 if offsize == 8 else 4) + length)
        prog = parse_line_header(data, 0, self._order, self._line_string)
        names = FileNames(prog.version >= 5, prog.dirs, prog.files, comp_dir)
        order = self._order

        def set_address(at: int, size: int) -> tuple[None, int]:
            return None, int.from_bytes(data[at : at + size], order)

        # Sequences at 0 (or at -1/-2 tombstones) are functions the linker discarded.
        end = min(prog.end, len(data))
        seqs = [rows for _, rows in run_line_program(data, prog.program, end, prog.header, order, set_address,
                                                     names.define)
                if len(rows) > 1 and 0 < rows[0][0] < rows[-1][0]]
        seqs.sort(key=lambda s: s[0][0])
        addrs: list[int] = []
        rows: list[tuple[str, int]] = []
        for seq in seqs:
            for addr, fidx, line in seq:
                addrs.append(addr)
                rows.append((names.name(fidx) if line else "", line))
        return _CuLines(addrs, rows)

    def _line_string(self, form: int, offset: int) -> str:
        return self._units.need("line_str" if form == F_LINE_STRP else "str").cstr(offset)
