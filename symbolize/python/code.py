"""CPython code objects read out of a live process: names, file, first line, and instruction -> line.

The BPF walker ships, per Python frame, the code object's address and a raw instruction value (`instr`);
this module turns those into a function name and a source line by reading `/proc/PID/mem`. Resolution must
happen while the process is alive. Results are cached per code address, guarded against address reuse by
re-reading the object's header (one small read per lookup) and comparing the fields that identify it.

The `instr` convention (what the BPF side ships, what `line_for` takes):

* 3.10: the frame's `f_lasti` as a signed int: the index, in 2-byte code units, of the instruction being
  executed (-1 before the first one). Its line is that of bytecode offset `2 * f_lasti` in `co_linetable`.
* 3.11 / 3.12: `prev_instr - code_addr`, in bytes. `prev_instr` points at the instruction being executed
  (for a caller frame: its CALL), one code unit before the first instruction when the frame has not started.
* 3.13: `instr_ptr - code_addr`, in bytes. `instr_ptr` too points at the instruction being executed (3.13
  sets it at the start of each instruction, and a caller's stays on its CALL while the callee runs); for a
  frame not started yet it points at the first instruction.

In all three 3.11+ cases the instruction index is `(instr - CodeInfo.first_instr_offset) // 2` (the offset
of `co_code_adaptive`), and the line is that of the instruction at that index in the location table. That is
exactly what CPython's own `frame.f_lineno` computes (`_PyInterpreterFrame_LASTI`). When the index is out of
range or the instruction has no location, the result is `firstlineno`.
"""

from __future__ import annotations

import struct

from aiflame.core.errors import TargetGone, Unreadable
from aiflame.core.python_layouts import PyLayout
from aiflame.core.raw import CodeInfo
from aiflame.symbolize.process_memory import ProcessMemory, Reader, read_cstring

__all__ = [
    "CodeResolver",
    "decode_unicode",
    "line_for",
    "read_type_name",
]

_MAX_STRING_CHARS = 1 << 16
_MAX_LINETABLE_BYTES = 1 << 20
_MAX_TYPE_NAME = 256
_CACHE_LIMIT = 1 << 16


def _u64(b: bytes, off: int) -> int:
    return int.from_bytes(b[off : off + 8], "little")


def _cstring(read: Reader, addr: int, limit: int = _MAX_TYPE_NAME) -> bytes:
    """A NUL-terminated string of at most `limit` bytes; Unreadable when it runs on past them."""
    out = read_cstring(read, addr, limit)
    if len(out) >= limit:
        raise Unreadable(f"string at {addr:#x} is not terminated within {limit} bytes")
    return out


def read_type_name(read: Reader, obj_addr: int, layout: PyLayout) -> str:
    """`Py_TYPE(obj)->tp_name` of the object at `obj_addr`."""
    type_addr = _u64(read(obj_addr + layout.object_type, 8), 0)
    if not type_addr:
        raise Unreadable(f"object at {obj_addr:#x} has no type")
    name_addr = _u64(read(type_addr + layout.type_name, 8), 0)
    if not name_addr:
        raise Unreadable(f"type at {type_addr:#x} has no name")
    return _cstring(read, name_addr).decode("utf-8", "replace")


def decode_unicode(read: Reader, addr: int, layout: PyLayout, max_chars: int = _MAX_STRING_CHARS) -> str:
    """The value of the `str` object at `addr`, read through `read(addr, size) -> bytes`.

    Handles compact ASCII, compact (kinds 1/2/4) and legacy (non-compact, ready) strings. Raises
    Unreadable when the header is implausible (unknown kind, negative or huge length); errors of
    `read` propagate. Invalid code points decode with replacement characters rather than failing.
    """
    head = read(addr, layout.unicode_compact_size)
    if len(head) < layout.unicode_compact_size:
        raise Unreadable(f"str at {addr:#x}: short header")
    length = struct.unpack_from("<q", head, layout.unicode_length)[0]
    state = struct.unpack_from("<I", head, layout.unicode_state)[0]
    kind = (state >> layout.unicode_kind_shift) & 7
    compact = (state >> layout.unicode_compact_shift) & 1
    ascii_ = (state >> layout.unicode_ascii_shift) & 1
    if kind not in (1, 2, 4):
        raise Unreadable(f"str at {addr:#x}: unknown kind {kind}")
    if ascii_ and kind != 1:
        raise Unreadable(f"str at {addr:#x}: ascii string of kind {kind}")
    if not 0 <= length <= max_chars:
        raise Unreadable(f"str at {addr:#x}: implausible length {length}")
    if compact:
        data_addr = addr + (layout.unicode_ascii_size if ascii_ else layout.unicode_compact_size)
    else:
        if layout.unicode_data_any < 0:
            raise Unreadable(f"str at {addr:#x}: not compact")
        data_addr = _u64(read(addr + layout.unicode_data_any, 8), 0)
        if not data_addr:
            raise Unreadable(f"str at {addr:#x}: no data")
    if length == 0:
        return ""
    data = read(data_addr, length * kind)
    if len(data) != length * kind:
        raise Unreadable(f"str at {addr:#x}: short data")
    if kind == 1:
        return data.decode("ascii" if ascii_ else "latin-1", "replace")
    codec = "utf-16-le" if kind == 2 else "utf-32-le"
    try:
        return data.decode(codec, "surrogatepass")  # Python strings may hold lone surrogates: keep them
    except UnicodeDecodeError:
        return data.decode(codec, "replace")  # code points past U+10FFFF: garbage, but don't fail


def read_bytes_object(read: Reader, addr: int, layout: PyLayout, limit: int = _MAX_LINETABLE_BYTES) -> bytes:
    """The contents of the `bytes` object at `addr`."""
    size = struct.unpack("<q", read(addr + layout.var_size, 8))[0]
    if not 0 <= size <= limit:
        raise Unreadable(f"bytes at {addr:#x}: implausible size {size}")
    return read(addr + layout.bytes_sval, size) if size else b""


# --- line tables ------------------------------------------------------------------------------------------


def _line_310(table: bytes, firstlineno: int, offset: int) -> int | None:
    """Line of bytecode byte `offset` in a 3.10 co_linetable: (unsigned byte delta, signed line delta) pairs,
    line delta -128 meaning "no line"."""
    line = firstlineno
    end = 0
    for i in range(0, len(table) - 1, 2):
        start = end
        end += table[i]
        ldelta = table[i + 1] - 256 if table[i + 1] > 127 else table[i + 1]
        current: int | None
        if ldelta == -128:
            current = None
        else:
            line += ldelta
            current = line
        if start <= offset < end:
            return current
    return None


def _varint(table: bytes, pos: int) -> tuple[int, int]:
    """Unsigned varint of the 3.11+ location table: 6-bit chunks, little end first, 0x40 = more follow."""
    value = shift = 0
    while True:
        if pos >= len(table):
            raise IndexError("truncated varint")
        b = table[pos]
        pos += 1
        value |= (b & 0x3F) << shift
        shift += 6
        if not b & 0x40:
            return value, pos
        if shift > 60:
            raise IndexError("varint too long")


def _svarint(table: bytes, pos: int) -> tuple[int, int]:
    v, pos = _varint(table, pos)
    return (-(v >> 1) if v & 1 else v >> 1), pos


def _line_311(table: bytes, firstlineno: int, index: int) -> int | None:
    """Line of code unit `index` in a 3.11+ location table (Objects/locations.md).

    Each entry starts with a byte `1cccclll`: code c, covering l+1 code units. 15: no location; 14: long form
    (svarint line delta, then end line, column, end column varints); 13: svarint line delta only; 10-12: line
    delta c-10 plus two column bytes; 0-9: same line, one column byte.
    """
    line = firstlineno
    unit = 0
    pos = 0
    n = len(table)
    try:
        while pos < n:
            first = table[pos]
            if not first & 0x80:
                return None  # not at an entry start: corrupt table
            pos += 1
            code = (first >> 3) & 0xF
            length = (first & 7) + 1
            current: int | None
            if code == 15:
                current = None
            elif code == 14:
                delta, pos = _svarint(table, pos)
                for _ in range(3):
                    _, pos = _varint(table, pos)
                line += delta
                current = line
            elif code == 13:
                delta, pos = _svarint(table, pos)
                line += delta
                current = line
            elif code >= 10:
                line += code - 10
                pos += 2
                current = line
            else:
                pos += 1
                current = line
            if unit <= index < unit + length:
                return current
            unit += length
    except IndexError:
        return None
    return None


def line_for(info: CodeInfo, instr: int) -> int:
    """Source line of the instruction `instr` designates (see the module docstring for the convention).

    Never raises: a negative, odd, out-of-range or garbage `instr`, a corrupt table or an instruction without a
    location all give `info.firstlineno`.
    """
    line: int | None
    if info.version < (3, 11):
        line = _line_310(info.line_table, info.firstlineno, 2 * instr) if instr >= 0 else None
    else:
        rel = instr - info.first_instr_offset
        line = _line_311(info.line_table, info.firstlineno, rel // 2) if rel >= 0 and rel % 2 == 0 else None
    return info.firstlineno if line is None or line <= 0 else line


# --- resolver ---------------------------------------------------------------------------------------------


class CodeResolver:
    """Code objects of one process by address, cached and re-validated on each lookup.

    A hit costs one read of the object's header: the type pointer, first line, and the name, qualname, file
    and line table pointers must be unchanged, or the entry is re-read (the address was reused by another
    code object). `resolve` returns None when the address does not hold a readable code object.
    """

    def __init__(self, pid: int, layout: PyLayout) -> None:
        self.pid = pid
        self.layout = layout
        self._mem: ProcessMemory | None = None
        self._cache: dict[int, tuple[tuple[int, ...], CodeInfo]] = {}
        self._code_types: dict[int, bool] = {}
        lay = layout
        fields = [lay.object_type, lay.code_filename, lay.code_name, lay.code_firstlineno, lay.code_linetable]
        if lay.code_qualname >= 0:
            fields.append(lay.code_qualname)
        self._head_size = max(fields) + 8

    def _memory(self) -> ProcessMemory:
        if self._mem is None:
            self._mem = ProcessMemory(self.pid)
        return self._mem

    def close(self) -> None:
        if self._mem is not None:
            self._mem.close()
            self._mem = None

    def __enter__(self) -> CodeResolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resolve(self, code_addr: int) -> CodeInfo | None:
        """The code object at `code_addr`, or None (unreadable, not a code object, process gone)."""
        try:
            return self._resolve(code_addr)
        except (TargetGone, Unreadable):
            return None

    def _resolve(self, addr: int) -> CodeInfo | None:
        lay = self.layout
        mem = self._memory()
        head = mem.read(addr, self._head_size)
        type_ptr = _u64(head, lay.object_type)
        firstlineno = struct.unpack_from("<i", head, lay.code_firstlineno)[0]
        ptrs = [_u64(head, off) for off in (lay.code_filename, lay.code_name, lay.code_linetable)]
        qual_ptr = _u64(head, lay.code_qualname) if lay.code_qualname >= 0 else 0
        key = (type_ptr, firstlineno, *ptrs, qual_ptr)
        hit = self._cache.get(addr)
        if hit is not None and hit[0] == key:
            return hit[1]
        if not self._is_code_type(type_ptr):
            return None
        filename_ptr, name_ptr, linetable_ptr = ptrs
        filename = decode_unicode(mem.read, filename_ptr, lay)
        qualname = decode_unicode(mem.read, qual_ptr or name_ptr, lay)
        table = read_bytes_object(mem.read, linetable_ptr, lay)
        info = CodeInfo(
            qualname=qualname,
            filename=filename,
            firstlineno=firstlineno,
            line_table=table,
            version=lay.version,
            first_instr_offset=lay.code_code_adaptive if lay.code_code_adaptive >= 0 else 0,
        )
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[addr] = (key, info)
        return info

    def _is_code_type(self, type_ptr: int) -> bool:
        known = self._code_types.get(type_ptr)
        if known is None:
            mem = self._memory()
            try:
                name_ptr = mem.u64(type_ptr + self.layout.type_name)
                known = _cstring(mem.read, name_ptr) == b"code"
            except (TargetGone, Unreadable):
                return False  # not cached: the pointer may be garbage read mid-update
            self._code_types[type_ptr] = known
        return known
