"""DWARF compile units, as far as finding source lines needs them: `.debug_aranges`, each unit's header in
`.debug_info`, and its top DIE (read through `.debug_abbrev`) for the line program offset, the compilation
directory and the unit's address ranges (`.debug_ranges`, `.debug_rnglists`, `.debug_addr`, string tables).
Sections are read lazily, small or compressed ones whole, others in pieces (dwarf_lines.py says why)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.dwarf_forms import (
    ADDRX_FORMS,
    DWARF_ERRORS,
    F_ADDR,
    F_ADDRX,
    F_IMPLICIT_CONST,
    F_LINE_STRP,
    F_RNGLISTX,
    F_STRP,
    STRX_FORMS,
    ByteOrder,
    Unit,
    initial_length,
    read_form,
    sleb,
    uint,
    uleb,
)
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.elf_format import Section

__all__ = ["CompileUnits", "DwarfSection", "TopDie"]

log = logging.getLogger(__name__)

# Attributes (DWARF 5, 7.5.4) read from a CU's top DIE.
_AT_STMT_LIST = 0x10
_AT_LOW_PC = 0x11
_AT_HIGH_PC = 0x12
_AT_COMP_DIR = 0x1B
_AT_RANGES = 0x55
_AT_STR_OFFSETS_BASE = 0x72
_AT_ADDR_BASE = 0x73
_AT_RNGLISTS_BASE = 0x74
_AT_GNU_ADDR_BASE = 0x2133
_UT_TYPE, _UT_SKELETON, _UT_SPLIT_COMPILE, _UT_SPLIT_TYPE = 2, 4, 5, 6

_WHOLE_SECTION = 16 << 20  # sections up to this size are read at once; bigger plain ones piecewise
_DIE_CHUNK = 4096


class DwarfSection:
    """One DWARF section: in memory when small or compressed, else read in pieces on demand."""

    def __init__(self, elf: ElfFile, sec: Section, whole: bool) -> None:
        self._elf, self._sec = elf, sec
        self.data: bytes | None = None
        if whole or elf.is_compressed(sec) or sec.size <= _WHOLE_SECTION:
            self.data = elf.read_section(sec)
            self.size = len(self.data)
        else:
            self.size = sec.size

    def read(self, off: int, n: int) -> bytes:
        if self.data is not None:
            return self.data[off : off + n] if off >= 0 else b""
        return self._elf.read_section_range(self._sec, off, n)

    def cstr(self, off: int) -> str:
        if self.data is not None:
            end = self.data.find(b"\0", off)
            if off < 0 or end < 0:
                raise Unreadable("string offset out of range")
            return self.data[off:end].decode("utf-8", "replace")
        chunk = b""
        while b"\0" not in chunk:
            more = self.read(off + len(chunk), 256)
            if not more or len(chunk) > 1 << 16:
                raise Unreadable("unterminated string")
            chunk += more
        return chunk[: chunk.index(b"\0")].decode("utf-8", "replace")


@dataclass
class TopDie:
    """The first DIE of a unit: its tag and attributes as (form, value)."""

    tag: int
    attrs: dict[int, tuple[int, int | bytes]] = field(default_factory=dict)


class CompileUnits:
    """The compile units of one ELF file's DWARF. Methods raise one of DWARF_ERRORS on malformed input."""

    def __init__(self, elf: ElfFile) -> None:
        self._elf = elf
        self._order: ByteOrder = "little" if elf.little_endian else "big"
        self._secs: dict[str, DwarfSection | None] = {}
        self._abbrevs: dict[int, tuple[int, dict[int, tuple[int, list[tuple[int, int, int]]]]]] = {}

    # --- sections ------------------------------------------------------------------------------------------

    def section(self, short: str) -> DwarfSection | None:
        """`.debug_<short>`, read on first use; None when the file has none (or, for the optional ones, it
        cannot be read)."""
        if short not in self._secs:
            sec = self._elf.dwarf_section(short)
            s = None
            if sec is not None:
                try:
                    # Abbreviations are parsed by offset into the whole table, so read them at once.
                    s = DwarfSection(self._elf, sec, whole=short == "abbrev")
                except Unreadable as e:
                    if short in ("info", "line", "abbrev"):
                        raise
                    log.debug("%s: %s skipped: %s", self._elf.path, sec.name, e)
            self._secs[short] = s
        return self._secs[short]

    def need(self, short: str) -> DwarfSection:
        """`.debug_<short>`, or Unreadable when the file has none."""
        s = self.section(short)
        if s is None:
            raise Unreadable(f"no .debug_{short}")
        return s

    def _uint(self, data: bytes, pos: int, size: int) -> int:
        return uint(data, pos, size, self._order)

    # --- which units there are -----------------------------------------------------------------------------

    def aranges(self) -> tuple[list[tuple[int, int, int]], set[int]]:
        """The (start, end, CU offset) spans `.debug_aranges` lists, sorted, and the CUs it covers; it is read
        as far as it is readable."""
        spans: list[tuple[int, int, int]] = []
        covered: set[int] = set()
        ar = self.section("aranges")
        if ar is None:
            return spans, covered
        data = ar.read(0, ar.size)
        pos = 0
        while pos + 4 <= len(data):
            begin = pos
            try:
                length, offsize, pos = initial_length(data, pos, self._order)
                end = min(pos + length, len(data))
                cu = self._uint(data, pos + 2, offsize)
                addr_size, seg_size = data[pos + 2 + offsize], data[pos + 3 + offsize]
            except DWARF_ERRORS:
                break
            if addr_size in (4, 8) and length:
                tup, pair = 2 * addr_size + seg_size, 2 * addr_size
                # The (address, length) tuples start at the first multiple of `pair` from the unit start.
                hdr = pos + 4 + offsize - begin
                p = begin + (hdr + pair - 1) // pair * pair
                while p + tup <= end:
                    a = self._uint(data, p + seg_size, addr_size)
                    n = self._uint(data, p + seg_size + addr_size, addr_size)
                    p += tup
                    if not a and not n:
                        break
                    if a and n:
                        spans.append((a, a + n, cu))
                covered.add(cu)
            if length == 0:
                break
            pos += length
        spans.sort()
        return spans, covered

    def compile_units(self) -> Iterator[Unit]:
        """The compile units of .debug_info in order (type units left out), up to the first unreadable header."""
        info = self.need("info")
        off = 0
        while off + 4 <= info.size:
            try:
                unit = self.unit_at(off)
            except DWARF_ERRORS:
                return
            if unit.unit_type not in (_UT_TYPE, _UT_SPLIT_TYPE):
                yield unit
            if unit.end <= off:
                return
            off = unit.end

    def line_program(self, unit: Unit) -> tuple[int, str] | None:
        """(offset of its line program in .debug_line, compilation directory) of a unit; None without one."""
        die = self.top_die(unit)
        stmt = die.attrs.get(_AT_STMT_LIST)
        if stmt is None or not isinstance(stmt[1], int):
            return None
        return stmt[1], self._string(unit, die, _AT_COMP_DIR)

    # --- units and their top DIE ---------------------------------------------------------------------------

    def unit_at(self, off: int) -> Unit:
        """The header of the unit at `off` in .debug_info."""
        head = self.need("info").read(off, 40)
        length, offsize, p = initial_length(head, 0, self._order)
        version = self._uint(head, p, 2)
        p += 2
        unit_type = 1
        if version >= 5:
            unit_type, addr_size = head[p], head[p + 1]
            abbrev = self._uint(head, p + 2, offsize)
            p += 2 + offsize
            if unit_type in (_UT_SKELETON, _UT_SPLIT_COMPILE):
                p += 8  # dwo_id
            elif unit_type in (_UT_TYPE, _UT_SPLIT_TYPE):
                p += 8 + offsize  # type signature and offset
        elif version >= 2:
            abbrev = self._uint(head, p, offsize)
            addr_size = head[p + offsize]
            p += offsize + 1
        else:
            raise Unreadable(f"DWARF version {version}")
        if addr_size not in (4, 8):
            raise Unreadable(f"address size {addr_size}")
        end = off + (12 if offsize == 8 else 4) + length
        return Unit(off, version, addr_size, offsize, abbrev, unit_type, off + p, end)

    def _abbrev(self, table: int, code: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(tag, [(attribute, form, implicit const)]) of abbreviation `code`, parsing the table only as far
        as needed: the top DIE's abbreviation usually comes first."""
        data = self.need("abbrev").data or b""
        pos, found = self._abbrevs.setdefault(table, (table, {}))
        while code not in found:
            if pos >= len(data):
                raise Unreadable(f"abbreviation {code} not found")
            c, pos = uleb(data, pos)
            if c == 0:
                raise Unreadable(f"abbreviation {code} not found")
            tag, pos = uleb(data, pos)
            pos += 1  # DW_CHILDREN_yes/no
            specs = []
            while True:
                at, pos = uleb(data, pos)
                form, pos = uleb(data, pos)
                implicit = 0
                if form == F_IMPLICIT_CONST:
                    implicit, pos = sleb(data, pos)
                if at == 0 and form == 0:
                    break
                specs.append((at, form, implicit))
            found[c] = (tag, specs)
            self._abbrevs[table] = (pos, found)
        return found[code]

    def top_die(self, unit: Unit) -> TopDie:
        info = self.need("info")
        size = min(_DIE_CHUNK, unit.end - unit.die_offset)
        while True:
            data = info.read(unit.die_offset, size)
            try:
                return self._parse_die(unit, data)
            except IndexError:
                if size >= unit.end - unit.die_offset:
                    raise
                size = unit.end - unit.die_offset  # a huge attribute: read the whole unit once

    def _parse_die(self, unit: Unit, data: bytes) -> TopDie:
        code, pos = uleb(data, 0)
        if code == 0:
            raise Unreadable("empty unit")
        tag, specs = self._abbrev(unit.abbrev_offset, code)
        die = TopDie(tag)
        for at, form, implicit in specs:
            value, pos = read_form(unit, data, pos, form, implicit, self._order)
            die.attrs[at] = (form, value)
        return die

    def _string(self, unit: Unit, die: TopDie, attr: int) -> str:
        """A string attribute of the top DIE, or "" when absent or in a file we don't have (dwz .sup)."""
        if attr not in die.attrs:
            return ""
        form, value = die.attrs[attr]
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if form == F_STRP:
            return self.need("str").cstr(value)
        if form == F_LINE_STRP:
            return self.need("line_str").cstr(value)
        if form in STRX_FORMS:
            base = self._attr_int(die, _AT_STR_OFFSETS_BASE, 8 if unit.offsize == 4 else 16)
            offs = self.need("str_offsets").read(base + value * unit.offsize, unit.offsize)
            return self.need("str").cstr(self._uint(offs, 0, unit.offsize))
        return ""

    def _attr_int(self, die: TopDie, attr: int, default: int) -> int:
        v = die.attrs.get(attr)
        return v[1] if v is not None and isinstance(v[1], int) else default

    def _address(self, unit: Unit, die: TopDie, form: int, value: int) -> int:
        if form not in ADDRX_FORMS:
            return value
        base = self._attr_int(die, _AT_ADDR_BASE, self._attr_int(die, _AT_GNU_ADDR_BASE, 8))
        raw = self.need("addr").read(base + value * unit.addr_size, unit.addr_size)
        return self._uint(raw, 0, unit.addr_size)

    def ranges(self, unit: Unit) -> list[tuple[int, int]] | None:
        """The CU's address ranges per its top DIE's DW_AT_low_pc/high_pc or DW_AT_ranges; None when it does
        not say."""
        die = self.top_die(unit)
        low = die.attrs.get(_AT_LOW_PC)
        base = self._address(unit, die, low[0], low[1]) if low and isinstance(low[1], int) else 0
        if _AT_RANGES in die.attrs:
            form, value = die.attrs[_AT_RANGES]
            if not isinstance(value, int):
                return None
            if unit.version >= 5:
                return self._rnglist(unit, die, form, value, base)
            return self._ranges_v4(unit, value, base)
        high = die.attrs.get(_AT_HIGH_PC)
        if low is None or high is None or not isinstance(high[1], int):
            return None
        if high[0] == F_ADDR or high[0] in ADDRX_FORMS:
            return [(base, self._address(unit, die, high[0], high[1]))]
        return [(base, base + high[1])]  # DWARF 4+: a length

    def _ranges_v4(self, unit: Unit, offset: int, base: int) -> list[tuple[int, int]] | None:
        sec = self.section("ranges")
        if sec is None:
            return None
        a = unit.addr_size
        top = (1 << (8 * a)) - 1
        out: list[tuple[int, int]] = []
        pos = offset
        for _ in range(1 << 20):
            pair = sec.read(pos, 2 * a)
            start, end = self._uint(pair, 0, a), self._uint(pair, a, a)
            pos += 2 * a
            if start == 0 and end == 0:
                return out
            if start == top:
                base = end  # base address selection entry
            else:
                out.append((base + start, base + end))
        raise Unreadable("unterminated range list")

    def _rnglist(
        self, unit: Unit, die: TopDie, form: int, value: int, base: int
    ) -> list[tuple[int, int]] | None:
        sec = self.section("rnglists")
        if sec is None:
            return None
        if form == F_RNGLISTX:
            rbase = self._attr_int(die, _AT_RNGLISTS_BASE, 12 if unit.offsize == 4 else 20)
            raw = sec.read(rbase + value * unit.offsize, unit.offsize)
            value = rbase + self._uint(raw, 0, unit.offsize)
        data = sec.read(value, 1 << 16)
        a = unit.addr_size
        out: list[tuple[int, int]] = []
        pos = 0
        while True:
            kind = data[pos]
            pos += 1
            if kind == 0:  # DW_RLE_end_of_list
                return out
            if kind == 1:  # base_addressx
                i, pos = uleb(data, pos)
                base = self._address(unit, die, F_ADDRX, i)
            elif kind in (2, 3):  # startx_endx, startx_length
                i, pos = uleb(data, pos)
                j, pos = uleb(data, pos)
                start = self._address(unit, die, F_ADDRX, i)
                out.append((start, self._address(unit, die, F_ADDRX, j) if kind == 2 else start + j))
            elif kind == 4:  # offset_pair
                s, pos = uleb(data, pos)
                e, pos = uleb(data, pos)
                out.append((base + s, base + e))
            elif kind == 5:  # base_address
                base, pos = self._uint(data, pos, a), pos + a
            elif kind == 6:  # start_end
                out.append((self._uint(data, pos, a), self._uint(data, pos + a, a)))
                pos += 2 * a
            elif kind == 7:  # start_length
                s = self._uint(data, pos, a)
                n, pos = uleb(data, pos + a)
                out.append((s, s + n))
            else:
                raise Unreadable(f"range list entry kind {kind}")
