"""DWARF encodings (DWARF 5, 7): LEB128 numbers, initial lengths, unit headers' shared parts, and attribute
forms, read from bytes in the file's byte order. dwarf_lines.py reads compile units and their top DIE with these,
dwarf_program.py line program headers; `Unreadable` and IndexError/struct.error mark malformed input."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

from aiflame.core.errors import Unreadable

__all__ = [
    "ADDRX_FORMS",
    "DWARF_ERRORS",
    "F_ADDR",
    "F_ADDRX",
    "F_IMPLICIT_CONST",
    "F_LINE_STRP",
    "F_RNGLISTX",
    "F_STRP",
    "STRX_FORMS",
    "ByteOrder",
    "Unit",
    "initial_length",
    "read_form",
    "sleb",
    "uint",
    "uleb",
]

ByteOrder = Literal["little", "big"]

# Forms (DWARF 5, 7.5.6) whose values need more than a fixed-size read.
F_ADDR = 0x01
_F_BLOCK2 = 0x03
_F_BLOCK4 = 0x04
_F_STRING = 0x08
_F_BLOCK = 0x09
_F_BLOCK1 = 0x0A
_F_SDATA = 0x0D
F_STRP = 0x0E
_F_UDATA = 0x0F
_F_REF_ADDR = 0x10
_F_REF_UDATA = 0x15
_F_INDIRECT = 0x16
_F_SEC_OFFSET = 0x17
_F_EXPRLOC = 0x18
_F_STRX = 0x1A
F_ADDRX = 0x1B
_F_STRP_SUP = 0x1D
F_LINE_STRP = 0x1F
F_IMPLICIT_CONST = 0x21
_F_LOCLISTX = 0x22
F_RNGLISTX = 0x23
_F_GNU_ADDR_INDEX = 0x1F01
_F_GNU_STR_INDEX = 0x1F02
_F_GNU_REF_ALT = 0x1F20
_F_GNU_STRP_ALT = 0x1F21
# form -> size: data1/2/4/8/16, ref1/2/4/8, flag, flag_present, ref_sup4/8, ref_sig8, strx1-4, addrx1-4
_FIXED_SIZE = {0x0B: 1, 0x05: 2, 0x06: 4, 0x07: 8, 0x1E: 16, 0x11: 1, 0x12: 2, 0x13: 4, 0x14: 8, 0x0C: 1,
               0x19: 0, 0x1C: 4, 0x24: 8, 0x20: 8, 0x25: 1, 0x26: 2, 0x27: 3, 0x28: 4, 0x29: 1, 0x2A: 2,
               0x2B: 3, 0x2C: 4, F_IMPLICIT_CONST: 0}  # fmt: skip
_OFFSET_FORMS = (F_STRP, _F_SEC_OFFSET, _F_STRP_SUP, F_LINE_STRP, _F_GNU_REF_ALT, _F_GNU_STRP_ALT)
_ULEB_FORMS = (_F_UDATA, _F_REF_UDATA, _F_STRX, F_ADDRX, _F_LOCLISTX, F_RNGLISTX, _F_GNU_ADDR_INDEX,
               _F_GNU_STR_INDEX)  # fmt: skip
STRX_FORMS = (_F_STRX, 0x25, 0x26, 0x27, 0x28, _F_GNU_STR_INDEX)
ADDRX_FORMS = (F_ADDRX, 0x29, 0x2A, 0x2B, 0x2C, _F_GNU_ADDR_INDEX)


# What malformed DWARF raises here: a reader catches these to switch off one unit (or table).
DWARF_ERRORS = (Unreadable, IndexError, struct.error, ValueError, OverflowError)


@dataclass
class Unit:
    """The parts of one unit header that later reads need."""

    offset: int
    version: int
    addr_size: int
    offsize: int  # 4 for 32-bit DWARF, 8 for 64-bit
    abbrev_offset: int
    unit_type: int
    die_offset: int
    end: int


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


def uint(data: bytes, pos: int, size: int, order: ByteOrder) -> int:
    """An unsigned `size`-byte integer at `pos`; IndexError past the end."""
    if pos + size > len(data):
        raise IndexError("read past the end")
    return int.from_bytes(data[pos : pos + size], order)


def initial_length(data: bytes, pos: int, order: ByteOrder) -> tuple[int, int, int]:
    """A unit's initial length at `pos`: (unit length, offset size, position after the length field)."""
    (n,) = struct.unpack_from("<I" if order == "little" else ">I", data, pos)
    if n == 0xFFFFFFFF:
        (n,) = struct.unpack_from("<Q" if order == "little" else ">Q", data, pos + 4)
        return n, 8, pos + 12
    if n >= 0xFFFFFFF0:
        raise Unreadable("reserved unit length")
    return n, 4, pos + 4


def read_form(unit: Unit, data: bytes, pos: int, form: int, implicit: int, order: ByteOrder) -> tuple[int | bytes, int]:
    """(value, next position) of one attribute; blocks and inline strings come back as bytes."""
    while form == _F_INDIRECT:
        form, pos = uleb(data, pos)
    size = _FIXED_SIZE.get(form)
    if size is not None:
        return (implicit if form == F_IMPLICIT_CONST else uint(data, pos, size, order)), pos + size
    if form == F_ADDR:
        return uint(data, pos, unit.addr_size, order), pos + unit.addr_size
    if form in _OFFSET_FORMS:
        return uint(data, pos, unit.offsize, order), pos + unit.offsize
    if form == _F_REF_ADDR:
        n = unit.addr_size if unit.version <= 2 else unit.offsize
        return uint(data, pos, n, order), pos + n
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
        n, pos = uint(data, pos, w, order), pos + w
    else:
        raise Unreadable(f"unknown form {form:#x}")
    if pos + n > len(data):
        raise IndexError("block past the end")
    return data[pos : pos + n], pos + n
