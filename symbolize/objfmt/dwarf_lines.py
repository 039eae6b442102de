"""Address -> (source file, line) from DWARF `.debug_line`, decoded one compile unit at a time.

A lookup decodes only the line program of the compile unit (CU) covering the address: `.debug_aranges` maps
addresses to CUs; CUs it leaves out (or all of them, for producers that emit none, like clang) are placed by
the low_pc/high_pc/ranges of their top DIE, and a CU without those is decoded whole once to learn its ranges.
From `.debug_info` only each CU's header and top DIE are read (for DW_AT_stmt_list and DW_AT_comp_dir), in
small pieces, so a multi-gigabyte debug file costs little more than the CUs actually hit (compressed sections
are the exception: zlib streams must be inflated whole).

This is a small reader written for exactly that from the DWARF 2-5 specifications: with pyelftools the same
work was ~10x slower (it parses whole abbreviation tables per CU and copies a state object per row). Every
malformed input ends in `_Malformed` or an IndexError/struct.error, which switch off the CU (or the table), so
`lookup` never raises.
"""

from __future__ import annotations

import bisect
import logging
import posixpath
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeVar

from aiflame.core.errors import BadInput
from aiflame.symbolize.errors import SymbolizeError
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.elf_format import Section

__all__ = ["LineTable"]

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

# Forms (DWARF 5, 7.5.6) whose values need more than a fixed-size read.
_F_ADDR = 0x01
_F_BLOCK2 = 0x03
_F_BLOCK4 = 0x04
_F_STRING = 0x08
_F_BLOCK = 0x09
_F_BLOCK1 = 0x0A
_F_SDATA = 0x0D
_F_STRP = 0x0E
_F_UDATA = 0x0F
_F_REF_ADDR = 0x10
_F_REF_UDATA = 0x15
_F_INDIRECT = 0x16
_F_SEC_OFFSET = 0x17
_F_EXPRLOC = 0x18
_F_STRX = 0x1A
_F_ADDRX = 0x1B
_F_STRP_SUP = 0x1D
_F_LINE_STRP = 0x1F
_F_IMPLICIT_CONST = 0x21
_F_LOCLISTX = 0x22
_F_RNGLISTX = 0x23
_F_GNU_ADDR_INDEX = 0x1F01
_F_GNU_STR_INDEX = 0x1F02
_F_GNU_REF_ALT = 0x1F20
_F_GNU_STRP_ALT = 0x1F21
# form -> size: data1/2/4/8/16, ref1/2/4/8, flag, flag_present, ref_sup4/8, ref_sig8, strx1-4, addrx1-4
_FIXED_SIZE = {0x0B: 1, 0x05: 2, 0x06: 4, 0x07: 8, 0x1E: 16, 0x11: 1, 0x12: 2, 0x13: 4, 0x14: 8, 0x0C: 1,
               0x19: 0, 0x1C: 4, 0x24: 8, 0x20: 8, 0x25: 1, 0x26: 2, 0x27: 3, 0x28: 4, 0x29: 1, 0x2A: 2,
               0x2B: 3, 0x2C: 4, _F_IMPLICIT_CONST: 0}  # fmt: skip
_OFFSET_FORMS = (_F_STRP, _F_SEC_OFFSET, _F_STRP_SUP, _F_LINE_STRP, _F_GNU_REF_ALT, _F_GNU_STRP_ALT)
_ULEB_FORMS = (_F_UDATA, _F_REF_UDATA, _F_STRX, _F_ADDRX, _F_LOCLISTX, _F_RNGLISTX, _F_GNU_ADDR_INDEX,
               _F_GNU_STR_INDEX)  # fmt: skip
_STRX_FORMS = (_F_STRX, 0x25, 0x26, 0x27, 0x28, _F_GNU_STR_INDEX)
_ADDRX_FORMS = (_F_ADDRX, 0x29, 0x2A, 0x2B, 0x2C, _F_GNU_ADDR_INDEX)
# Line program content types (DWARF 5, 6.2.4.1).
_LNCT_PATH, _LNCT_DIRECTORY_INDEX = 1, 2
_UT_TYPE, _UT_SKELETON, _UT_SPLIT_COMPILE, _UT_SPLIT_TYPE = 2, 4, 5, 6

_WHOLE_SECTION = 16 << 20  # sections up to this size are read at once; bigger plain ones piecewise
_DIE_CHUNK = 4096


T = TypeVar("T")


class _Malformed(BadInput):
    """Inconsistent DWARF; handled like the IndexError/struct.error a truncated read produces."""


_ERRORS = (_Malformed, IndexError, struct.error, ValueError, OverflowError, SymbolizeError)


def uleb(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 at `pos`: (value, position after it)."""
    b = data[pos]
    pos += 1
    if b < 0x80:
        return b, pos
    result, shift = b & 0x7F, 7
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def sleb(data: bytes, pos: int) -> tuple[int, int]:
    """A signed LEB128 at `pos`: (value, position after it)."""
    result, shift = 0, 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return (result - (1 << shift) if b & 0x40 else result), pos


class _Sec:
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
                raise _Malformed("string offset out of range")
            return self.data[off:end].decode("utf-8", "replace")
        chunk = b""
        while b"\0" not in chunk:
            more = self.read(off + len(chunk), 256)
            if not more or len(chunk) > 1 << 16:
                raise _Malformed("unterminated string")
            chunk += more
        return chunk[: chunk.index(b"\0")].decode("utf-8", "replace")


@dataclass
class _Unit:
    """The parts of one unit header that later reads need."""

    offset: int
    version: int
    addr_size: int
    offsize: int  # 4 for 32-bit DWARF, 8 for 64-bit
    abbrev_offset: int
    unit_type: int
    die_offset: int
    end: int


@dataclass
class _TopDie:
    tag: int
    attrs: dict[int, tuple[int, int | bytes]] = field(default_factory=dict)


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
        self._le = elf.little_endian
        self._bo = "<" if self._le else ">"
        self._broken = not elf.has_dwarf_lines
        self._ready = False
        self._secs: dict[str, _Sec | None] = {}
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, int]] = []  # (start, end, CU offset), sorted by start
        self._indexed: set[int] = set()
        self._full_scan_done = False
        self._cu_lines: dict[int, _CuLines | None] = {}  # by CU offset
        self._programs: dict[tuple[int, str], _CuLines] = {}  # by (stmt_list, comp_dir)
        self._abbrevs: dict[int, tuple[int, dict[int, tuple[int, list[tuple[int, int, int]]]]]] = {}

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
        except _ERRORS as e:
            log.debug("line table of %s disabled: %r", self._elf.path, e)
            self._broken = True
            return None

    # --- sections ------------------------------------------------------------------------------------------

    def _sec(self, short: str) -> _Sec | None:
        if short not in self._secs:
            sec = self._elf.dwarf_section(short)
            s = None
            if sec is not None:
                try:
                    # Abbreviations are parsed by offset into the whole table, so read them at once.
                    s = _Sec(self._elf, sec, whole=short == "abbrev")
                except SymbolizeError as e:
                    if short in ("info", "line", "abbrev"):
                        raise
                    log.debug("%s: %s skipped: %s", self._elf.path, sec.name, e)
            self._secs[short] = s
        return self._secs[short]

    def _need(self, short: str) -> _Sec:
        s = self._sec(short)
        if s is None:
            raise _Malformed(f"no .debug_{short}")
        return s

    def _initial_length(self, data: bytes, pos: int) -> tuple[int, int, int]:
        """(unit length, offset size, position after the length field)."""
        (n,) = struct.unpack_from(self._bo + "I", data, pos)
        if n == 0xFFFFFFFF:
            (n,) = struct.unpack_from(self._bo + "Q", data, pos + 4)
            return n, 8, pos + 12
        if n >= 0xFFFFFFF0:
            raise _Malformed("reserved unit length")
        return n, 4, pos + 4

    def _uint(self, data: bytes, pos: int, size: int) -> int:
        if pos + size > len(data):
            raise IndexError("read past the end")
        return int.from_bytes(data[pos : pos + size], "little" if self._le else "big")

    # --- the address index ---------------------------------------------------------------------------------

    def _add_span(self, start: int, end: int, cu: int) -> None:
        if not 0 < start < end:
            return  # address 0 and inverted ranges come from code the linker discarded
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._spans.insert(i, (start, end, cu))

    def _index_aranges(self) -> None:
        ar = self._sec("aranges")
        if ar is None:
            return
        data = ar.read(0, ar.size)
        spans: list[tuple[int, int, int]] = []
        pos = 0
        while pos + 4 <= len(data):
            begin = pos
            try:
                length, offsize, pos = self._initial_length(data, pos)
                end = min(pos + length, len(data))
                cu = self._uint(data, pos + 2, offsize)
                addr_size, seg_size = data[pos + 2 + offsize], data[pos + 3 + offsize]
            except _ERRORS:
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
                self._indexed.add(cu)
            if length == 0:
                break
            pos += length
        spans.sort()
        self._spans = spans
        self._starts = [s for s, _e, _c in spans]

    def _index_remaining_units(self) -> None:
        """Place each CU that aranges left out, by its top DIE's ranges or else its decoded line program."""
        info = self._need("info")
        off = 0
        while off + 4 <= info.size:
            try:
                unit = self._unit_at(off)
            except _ERRORS:
                break
            if unit.offset not in self._indexed and unit.unit_type not in (_UT_TYPE, _UT_SPLIT_TYPE):
                self._indexed.add(unit.offset)
                ranges: list[tuple[int, int]] | None = None
                try:
                    ranges = self._die_ranges(unit, self._top_die(unit))
                except _ERRORS as e:
                    log.debug("%s: CU at %#x has unreadable ranges (%r)", self._elf.path, off, e)
                if ranges is None:
                    lines = self._lines_of(unit.offset)
                    ranges = lines.ranges() if lines else []
                for start, end in ranges:
                    self._add_span(start, end, unit.offset)
            if unit.end <= off:
                break
            off = unit.end

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

    # --- units and their top DIE ---------------------------------------------------------------------------

    def _unit_at(self, off: int) -> _Unit:
        head = self._need("info").read(off, 40)
        length, offsize, p = self._initial_length(head, 0)
        (version,) = struct.unpack_from(self._bo + "H", head, p)
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
            raise _Malformed(f"DWARF version {version}")
        if addr_size not in (4, 8):
            raise _Malformed(f"address size {addr_size}")
        end = off + (12 if offsize == 8 else 4) + length
        return _Unit(off, version, addr_size, offsize, abbrev, unit_type, off + p, end)

    def _abbrev(self, table: int, code: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(tag, [(attribute, form, implicit const)]) of abbreviation `code`, parsing the table only as far
        as needed: the top DIE's abbreviation usually comes first."""
        data = self._need("abbrev").data or b""
        pos, found = self._abbrevs.setdefault(table, (table, {}))
        while code not in found:
            if pos >= len(data):
                raise _Malformed(f"abbreviation {code} not found")
            c, pos = uleb(data, pos)
            if c == 0:
                raise _Malformed(f"abbreviation {code} not found")
            tag, pos = uleb(data, pos)
            pos += 1  # DW_CHILDREN_yes/no
            specs = []
            while True:
                at, pos = uleb(data, pos)
                form, pos = uleb(data, pos)
                implicit = 0
                if form == _F_IMPLICIT_CONST:
                    implicit, pos = sleb(data, pos)
                if at == 0 and form == 0:
                    break
                specs.append((at, form, implicit))
            found[c] = (tag, specs)
            self._abbrevs[table] = (pos, found)
        return found[code]

    def _top_die(self, unit: _Unit) -> _TopDie:
        info = self._need("info")
        size = min(_DIE_CHUNK, unit.end - unit.die_offset)
        while True:
            data = info.read(unit.die_offset, size)
            try:
                return self._parse_die(unit, data)
            except IndexError:
                if size >= unit.end - unit.die_offset:
                    raise
                size = unit.end - unit.die_offset  # a huge attribute: read the whole unit once

    def _parse_die(self, unit: _Unit, data: bytes) -> _TopDie:
        code, pos = uleb(data, 0)
        if code == 0:
            raise _Malformed("empty unit")
        tag, specs = self._abbrev(unit.abbrev_offset, code)
        die = _TopDie(tag)
        for at, form, implicit in specs:
            value, pos = self._form(unit, data, pos, form, implicit)
            die.attrs[at] = (form, value)
        return die

    def _form(self, unit: _Unit, data: bytes, pos: int, form: int, implicit: int) -> tuple[int | bytes, int]:
        """(value, next position) of one attribute; blocks and inline strings come back as bytes."""
        while form == _F_INDIRECT:
            form, pos = uleb(data, pos)
        size = _FIXED_SIZE.get(form)
        if size is not None:
            return (implicit if form == _F_IMPLICIT_CONST else self._uint(data, pos, size)), pos + size
        if form == _F_ADDR:
            return self._uint(data, pos, unit.addr_size), pos + unit.addr_size
        if form in _OFFSET_FORMS:
            return self._uint(data, pos, unit.offsize), pos + unit.offsize
        if form == _F_REF_ADDR:
            n = unit.addr_size if unit.version <= 2 else unit.offsize
            return self._uint(data, pos, n), pos + n
        if form in _ULEB_FORMS:
            return uleb(data, pos)
        if form == _F_SDATA:
            return sleb(data, pos)
        if form == _F_STRING:
            end = data.index(b"\0", pos)
            return data[pos:end], end + 1
        if form in (_F_BLOCK, _F_EXPRLOC):
            n, pos = uleb(data, pos)
        elif form in (_F_BLOCK1, _F_BLOCK2, _F_BLOCK4):
            w = {_F_BLOCK1: 1, _F_BLOCK2: 2, _F_BLOCK4: 4}[form]
            n, pos = self._uint(data, pos, w), pos + w
        else:
            raise _Malformed(f"unknown form {form:#x}")
        if pos + n > len(data):
            raise IndexError("block past the end")
        return data[pos : pos + n], pos + n

    def _string(self, unit: _Unit, die: _TopDie, attr: int) -> str:
        """A string attribute of the top DIE, or "" when absent or in a file we don't have (dwz .sup)."""
        if attr not in die.attrs:
            return ""
        form, value = die.attrs[attr]
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if form == _F_STRP:
            return self._need("str").cstr(value)
        if form == _F_LINE_STRP:
            return self._need("line_str").cstr(value)
        if form in _STRX_FORMS:
            base = self._attr_int(die, _AT_STR_OFFSETS_BASE, 8 if unit.offsize == 4 else 16)
            offs = self._need("str_offsets").read(base + value * unit.offsize, unit.offsize)
            return self._need("str").cstr(self._uint(offs, 0, unit.offsize))
        return ""

    def _attr_int(self, die: _TopDie, attr: int, default: int) -> int:
        v = die.attrs.get(attr)
        return v[1] if v is not None and isinstance(v[1], int) else default

    def _address(self, unit: _Unit, die: _TopDie, form: int, value: int) -> int:
        if form not in _ADDRX_FORMS:
            return value
        base = self._attr_int(die, _AT_ADDR_BASE, self._attr_int(die, _AT_GNU_ADDR_BASE, 8))
        raw = self._need("addr").read(base + value * unit.addr_size, unit.addr_size)
        return self._uint(raw, 0, unit.addr_size)

    def _die_ranges(self, unit: _Unit, die: _TopDie) -> list[tuple[int, int]] | None:
        """The CU's address ranges per DW_AT_low_pc/high_pc or DW_AT_ranges; None when it does not say."""
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
        if high[0] == _F_ADDR or high[0] in _ADDRX_FORMS:
            return [(base, self._address(unit, die, high[0], high[1]))]
        return [(base, base + high[1])]  # DWARF 4+: a length

    def _ranges_v4(self, unit: _Unit, offset: int, base: int) -> list[tuple[int, int]] | None:
        sec = self._sec("ranges")
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
        raise _Malformed("unterminated range list")

    def _rnglist(
        self, unit: _Unit, die: _TopDie, form: int, value: int, base: int
    ) -> list[tuple[int, int]] | None:
        sec = self._sec("rnglists")
        if sec is None:
            return None
        if form == _F_RNGLISTX:
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
                base = self._address(unit, die, _F_ADDRX, i)
            elif kind in (2, 3):  # startx_endx, startx_length
                i, pos = uleb(data, pos)
                j, pos = uleb(data, pos)
                start = self._address(unit, die, _F_ADDRX, i)
                out.append((start, self._address(unit, die, _F_ADDRX, j) if kind == 2 else start + j))
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
                raise _Malformed(f"range list entry kind {kind}")

    # --- line programs -------------------------------------------------------------------------------------

    def _lines_of(self, cu_offset: int) -> _CuLines | None:
        if cu_offset in self._cu_lines:
            return self._cu_lines[cu_offset]
        lines: _CuLines | None = None
        try:
            unit = self._unit_at(cu_offset)
            die = self._top_die(unit)
            stmt = die.attrs.get(_AT_STMT_LIST)
            if stmt is not None and isinstance(stmt[1], int):
                comp_dir = self._string(unit, die, _AT_COMP_DIR)
                key = (stmt[1], comp_dir)
                lines = self._programs.get(key)
                if lines is None:
                    lines = self._programs[key] = self._decode_program(stmt[1], comp_dir)
        except _ERRORS as e:
            log.debug("%s: CU at %#x has no usable line program (%r)", self._elf.path, cu_offset, e)
        self._cu_lines[cu_offset] = lines
        return lines

    def _decode_program(self, offset: int, comp_dir: str) -> _CuLines:
        """Parse the line program header at `offset` in .debug_line (DWARF 5, 6.2.4) and run the program."""
        sec = self._need("line")
        length, offsize, _p = self._initial_length(sec.read(offset, 12), 0)
        data = sec.read(offset, (12 if offsize == 8 else 4) + length)
        pos = 4 if offsize == 4 else 12
        end = len(data)
        (version,) = struct.unpack_from(self._bo + "H", data, pos)
        pos += 2
        if not 2 <= version <= 5:
            raise _Malformed(f"line table version {version}")
        if version >= 5:
            pos += 2  # address_size, segment_selector_size
        header_length = self._uint(data, pos, offsize)
        pos += offsize
        program = pos + header_length
        min_len = data[pos]
        pos += 1
        if version >= 4:
            pos += 1  # maximum_operations_per_instruction: VLIW only
        # data[pos] is default_is_stmt: every row counts for lookups, statement boundary or not.
        line_base = struct.unpack_from("b", data, pos + 1)[0]
        line_range, opcode_base = data[pos + 2], data[pos + 3]
        pos += 4
        if line_range == 0 or opcode_base == 0:
            raise _Malformed("bad line program header")
        std_lengths = data[pos : pos + opcode_base - 1]
        pos += opcode_base - 1
        if version >= 5:
            dirs, pos = self._v5_entries(data, pos, offsize)
            files, pos = self._v5_entries(data, pos, offsize)
            names = _FileNames(True, [d[0] for d in dirs], files, comp_dir)
        else:
            dirs4: list[str] = []
            while data[pos]:
                e = data.index(b"\0", pos)
                dirs4.append(data[pos:e].decode("utf-8", "replace"))
                pos = e + 1
            pos += 1
            files4: list[tuple[str, int]] = []
            while data[pos]:
                e = data.index(b"\0", pos)
                name = data[pos:e].decode("utf-8", "replace")
                d, pos = uleb(data, e + 1)
                _mtime, pos = uleb(data, pos)
                _size, pos = uleb(data, pos)
                files4.append((name, d))
            names = _FileNames(False, dirs4, files4, comp_dir)
        order: Literal["little", "big"] = "little" if self._le else "big"

        def set_address(at: int, size: int) -> tuple[None, int]:
            return None, int.from_bytes(data[at : at + size], order)

        header = LineHeader(min_len, line_base, line_range, opcode_base, std_lengths)
        # Sequences at 0 (or at -1/-2 tombstones) are functions the linker discarded.
        seqs = [rows for _, rows in run_line_program(data, program, end, header, order, set_address, names.define)
                if len(rows) > 1 and 0 < rows[0][0] < rows[-1][0]]
        seqs.sort(key=lambda s: s[0][0])
        addrs: list[int] = []
        rows: list[tuple[str, int]] = []
        for seq in seqs:
            for addr, fidx, line in seq:
                addrs.append(addr)
                rows.append((names.name(fidx) if line else "", line))
        return _CuLines(addrs, rows)

    def _v5_entries(self, data: bytes, pos: int, offsize: int) -> tuple[list[tuple[str, int]], int]:
        """Directory or file entries of a DWARF 5 line header as (path, directory index)."""
        nformats = data[pos]
        pos += 1
        formats = []
        for _ in range(nformats):
            kind, pos = uleb(data, pos)
            form, pos = uleb(data, pos)
            formats.append((kind, form))
        count, pos = uleb(data, pos)
        if count and (not formats or count > len(data) - pos):
            raise _Malformed("bad entry count")  # each entry takes at least one byte
        unit = _Unit(0, 5, 8, offsize, 0, 1, 0, 0)
        out = []
        for _ in range(count):
            path, d = "", 0
            for kind, form in formats:
                value, pos = self._form(unit, data, pos, form, 0)
                if kind == _LNCT_PATH:
                    if isinstance(value, bytes):
                        path = value.decode("utf-8", "replace")
                    elif form == _F_LINE_STRP:
                        path = self._need("line_str").cstr(value)
                    elif form == _F_STRP:
                        path = self._need("str").cstr(value)
                elif kind == _LNCT_DIRECTORY_INDEX and isinstance(value, int):
                    d = value
            out.append((path, d))
        return out, pos

class LineHeader(NamedTuple):
    """What the line state machine needs from a line program header."""

    min_len: int  # minimum_instruction_length
    line_base: int
    line_range: int
    opcode_base: int
    std_lengths: bytes  # standard_opcode_lengths


Row = tuple[int, int, int]  # address, file index, line; (address, 0, 0) ends a sequence


def run_line_program(
    data: bytes,
    pos: int,
    end: int,
    h: LineHeader,
    order: Literal["little", "big"],
    set_address: Callable[[int, int], tuple[T, int]],
    define_file: Callable[[str, int], None],
) -> list[tuple[T | None, list[Row]]]:
    """Execute the line number program in data[pos:end] (DWARF 5, 6.2.5): one row list per sequence, each with
    the tag that `set_address(field offset, field size) -> (tag, address)` gave it (None before any
    DW_LNE_set_address; a cubin tags sequences with their kernel). `define_file(name, dir index)` gets
    DW_LNE_define_file. Raises ValueError (or IndexError/struct.error) on malformed programs."""
    const_add = ((255 - h.opcode_base) // h.line_range) * h.min_len
    min_len, line_base, line_range, opcode_base, std_lengths = h
    seqs: list[tuple[T | None, list[Row]]] = []
    rows: list[Row] = []
    tag: T | None = None
    address, file, line = 0, 1, 1
    while pos < end:
        op = data[pos]
        pos += 1
        if op >= opcode_base:  # special opcode: advance address and line, emit a row
            adj = op - opcode_base
            address += (adj // line_range) * min_len
            line += line_base + adj % line_range
            rows.append((address, file, line))
        elif op == 0:  # extended opcode
            n, pos = uleb(data, pos)
            if n == 0:
                continue
            sub, nxt = data[pos], pos + n
            if nxt > end:
                raise _Malformed("extended opcode runs past its unit")
            if sub == 1:  # DW_LNE_end_sequence
                rows.append((address, 0, 0))
                seqs.append((tag, rows))
                rows, tag = [], None
                address, file, line = 0, 1, 1
            elif sub == 2:  # DW_LNE_set_address
                tag, address = set_address(pos + 1, nxt - pos - 1)
            elif sub == 3:  # DW_LNE_define_file (DWARF <= 4)
                e = data.index(b"\0", pos + 1, nxt)
                d, _p = uleb(data, e + 1)
                define_file(data[pos + 1 : e].decode("utf-8", "replace"), d)
            # Others, e.g. NVIDIA's 0x90 (the inlining context that `nvdisasm -gi` shows), carry no row.
            pos = nxt
        elif op == 1:  # DW_LNS_copy
            rows.append((address, file, line))
        elif op == 2:  # advance_pc
            n, pos = uleb(data, pos)
            address += n * min_len
        elif op == 3:  # advance_line
            n, pos = sleb(data, pos)
            line += n
        elif op == 4:  # set_file
            file, pos = uleb(data, pos)
        elif op == 8:  # const_add_pc
            address += const_add
        elif op == 9:  # fixed_advance_pc
            address += int.from_bytes(data[pos : pos + 2], order)
            pos += 2
        else:  # set_column, negate_stmt, basic_block, prologue/epilogue, isa, and unknown opcodes
            for _ in range(std_lengths[op - 1]):
                _v, pos = uleb(data, pos)
    if pos > end:
        raise _Malformed("line program runs past its unit")
    return seqs


class _FileNames:
    """File index -> path for one line program (DWARF 5 indexes from 0, earlier versions from 1)."""

    def __init__(self, v5: bool, dirs: list[str], files: list[tuple[str, int]], comp_dir: str) -> None:
        self._v5 = v5
        self._dirs = dirs
        self._files = files
        self._comp_dir = comp_dir
        self._memo: dict[int, str] = {}

    def define(self, name: str, dir_index: int) -> None:
        self._files.append((name, dir_index))

    def name(self, index: int) -> str:
        hit = self._memo.get(index)
        if hit is None:
            hit = self._memo[index] = self._resolve(index)
        return hit

    def _resolve(self, index: int) -> str:
        i = index if self._v5 else index - 1
        if not 0 <= i < len(self._files):
            return ""
        name, d = self._files[i]
        if name.startswith("/"):
            return name
        if self._v5:
            directory = self._dirs[d] if 0 <= d < len(self._dirs) else ""
        else:
            directory = self._dirs[d - 1] if 0 < d <= len(self._dirs) else self._comp_dir
        if directory and not directory.startswith("/") and self._comp_dir:
            directory = posixpath.join(self._comp_dir, directory)
        return posixpath.normpath(posixpath.join(directory, name)) if directory else name
