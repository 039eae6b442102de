"""DWARF line number programs (DWARF 5, 6.2): the header with its directory and file tables (versions 2-5), the
state machine that turns a program into rows, and file index -> path. dwarf_lines.py runs them for host binaries,
cubin.py for GPU code (where the address of a sequence comes from a relocation)."""

from __future__ import annotations

import posixpath
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.dwarf_forms import (
    F_LINE_STRP,
    F_STRP,
    ByteOrder,
    Unit,
    initial_length,
    read_form,
    sleb,
    uint,
    uleb,
)

__all__ = ["FileNames", "LineHeader", "LineProgram", "Row", "parse_line_header", "run_line_program"]

T = TypeVar("T")
_LNCT_PATH, _LNCT_DIRECTORY_INDEX = 1, 2  # line program content types (DWARF 5, 6.2.4.1)


class LineHeader(NamedTuple):
    """What the line state machine needs from a line program header."""

    min_len: int  # minimum_instruction_length
    line_base: int
    line_range: int
    opcode_base: int
    std_lengths: bytes  # standard_opcode_lengths


@dataclass(frozen=True, slots=True)
class LineProgram:
    """A parsed line program header: what the state machine needs, the file table, and where the program runs."""

    version: int
    header: LineHeader
    dirs: list[str]
    files: list[tuple[str, int]]  # (name, directory index)
    program: int  # offset of the first opcode
    end: int  # offset past the unit, as its length says (it may lie past the data: the caller decides)


def parse_line_header(data: bytes, pos: int, order: ByteOrder, strings: Callable[[int, int], str] | None = None,
                      max_version: int = 5) -> LineProgram:
    """The line program header of the unit at `pos` (DWARF 5, 6.2.4). `strings(form, offset)` gives the paths a
    DWARF 5 file table keeps in .debug_str or .debug_line_str (without it, those paths are ""). Raises one of
    DWARF_ERRORS when malformed or newer than `max_version`."""
    length, offsize, p = initial_length(data, pos, order)
    end = p + length
    version = uint(data, p, 2, order)
    p += 2
    if not 2 <= version <= max_version:
        raise Unreadable(f"line table version {version}")
    if version >= 5:
        p += 2  # address_size, segment_selector_size
    header_length = uint(data, p, offsize, order)
    p += offsize
    program = p + header_length
    min_len = data[p]
    p += 2 if version >= 4 else 1  # maximum_operations_per_instruction (4+) is VLIW only
    # data[p] is default_is_stmt: every row counts for lookups, statement boundary or not.
    line_base = struct.unpack_from("b", data, p + 1)[0]
    line_range, opcode_base = data[p + 2], data[p + 3]
    p += 4
    if not line_range or not opcode_base or program > end:
        raise Unreadable("bad line program header")
    std_lengths = data[p : p + opcode_base - 1]
    p += opcode_base - 1
    if version >= 5:
        dir_entries, p = _v5_entries(data, p, offsize, order, strings)
        files, p = _v5_entries(data, p, offsize, order, strings)
        dirs = [d for d, _ in dir_entries]
    else:
        dirs = []
        while data[p]:
            e = data.index(b"\0", p, end)
            dirs.append(data[p:e].decode("utf-8", "replace"))
            p = e + 1
        p += 1
        files = []
        while data[p]:
            e = data.index(b"\0", p, end)
            name = data[p:e].decode("utf-8", "replace")
            d, p = uleb(data, e + 1)
            _mtime, p = uleb(data, p)
            _size, p = uleb(data, p)
            files.append((name, d))
    header = LineHeader(min_len, line_base, line_range, opcode_base, std_lengths)
    return LineProgram(version, header, dirs, files, program, end)


def _v5_entries(data: bytes, pos: int, offsize: int, order: ByteOrder,
                strings: Callable[[int, int], str] | None) -> tuple[list[tuple[str, int]], int]:
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
        raise Unreadable("bad entry count")  # each entry takes at least one byte
    unit = Unit(0, 5, 8, offsize, 0, 1, 0, 0)
    out = []
    for _ in range(count):
        path, d = "", 0
        for kind, form in formats:
            value, pos = read_form(unit, data, pos, form, 0, order)
            if kind == _LNCT_PATH:
                if isinstance(value, bytes):
                    path = value.decode("utf-8", "replace")
                elif form in (F_LINE_STRP, F_STRP) and strings is not None:
                    path = strings(form, value)
            elif kind == _LNCT_DIRECTORY_INDEX and isinstance(value, int):
                d = value
        out.append((path, d))
    return out, pos


Row = tuple[int, int, int]  # address, file index, line; (address, 0, 0) ends a sequence


def run_line_program(
    data: bytes,
    pos: int,
    end: int,
    h: LineHeader,
    order: ByteOrder,
    set_address: Callable[[int, int], tuple[T, int]],
    define_file: Callable[[str, int], None],
) -> list[tuple[T | None, list[Row]]]:
    """Execute the line number program in data[pos:end] (DWARF 5, 6.2.5): one row list per sequence, each with
    the tag that `set_address(field offset, field size) -> (tag, address)` gave it (None before any
    DW_LNE_set_address; a cubin tags sequences with their kernel). `define_file(name, dir index)` gets
    DW_LNE_define_file. Raises one of DWARF_ERRORS on malformed programs."""
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
                raise Unreadable("extended opcode runs past its unit")
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
        raise Unreadable("line program runs past its unit")
    return seqs


class FileNames:
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
