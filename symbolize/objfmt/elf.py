"""Reading ELF files for symbolization: build ids, load segments, function symbols, raw sections.

Everything here is parsed with `struct`: `read_build_id` runs for every mapping of every profiled process at
capture time and must read only a few hundred bytes, and unpacking symbol tables with `struct.iter_unpack` is
an order of magnitude faster than pyelftools on binaries with 10^5 symbols. DWARF lives in dwarf_lines.py.

Files are read with `pread`, never mmap: a binary truncated while we hold it would turn an mmap access into
SIGBUS for the whole agent. Every malformed-input path raises `SymbolizeError`.
"""

from __future__ import annotations

import bisect
import os
import stat
import struct
import weakref
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from aiflame.symbolize.errors import SymbolizeError

__all__ = ["ElfFile", "Section", "Segment", "Symbol", "read_build_id"]

_MAGIC = b"\x7fELF"
_ELFCLASS32, _ELFCLASS64 = 1, 2
_ELFDATA2LSB, _ELFDATA2MSB = 1, 2
_ET_DYN = 3
_PT_LOAD, _PT_NOTE = 1, 4
_PF_X = 1
_SHT_RELA, _SHT_NOTE, _SHT_NOBITS, _SHT_REL = 4, 7, 8, 9
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_SHF_ALLOC, _SHF_EXECINSTR, _SHF_COMPRESSED = 0x2, 0x4, 0x800
_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_STB_LOCAL, _STB_GLOBAL, _STB_WEAK = 0, 1, 2
_SHN_UNDEF, _SHN_ABS, _SHN_COMMON, _SHN_XINDEX = 0, 0xFFF1, 0xFFF2, 0xFFFF
_PN_XNUM = 0xFFFF
_NT_GNU_BUILD_ID = 3
_ELFCOMPRESS_ZLIB = 1
_EM_386, _EM_ARM, _EM_X86_64, _EM_AARCH64 = 3, 40, 62, 183

_HEAD_READ = 4096  # one read covers the ELF header, program headers and notes of almost every binary
_MAX_NOTE_BYTES = 1 << 20
_MAX_TABLE_ENTRIES = 1 << 20  # sanity bound on e_phnum / e_shnum (extended numbering allows 2^32)
_MAX_SECTION_BYTES = 1 << 32


class _Layout(NamedTuple):
    """Struct formats of one ELF class and byte order."""

    is64: bool
    ehdr: struct.Struct  # the header after e_ident
    phdr: struct.Struct
    shdr: struct.Struct
    sym: struct.Struct
    rel: struct.Struct
    rela: struct.Struct
    chdr: struct.Struct
    note: struct.Struct


def _layout(is64: bool, bo: str) -> _Layout:
    if is64:
        return _Layout(
            True,
            struct.Struct(bo + "HHIQQQIHHHHHH"),
            struct.Struct(bo + "IIQQQQQQ"),
            struct.Struct(bo + "IIQQQQIIQQ"),
            struct.Struct(bo + "IBBHQQ"),
            struct.Struct(bo + "QQ"),
            struct.Struct(bo + "QQq"),
            struct.Struct(bo + "IIQQ"),
            struct.Struct(bo + "III"),
        )
    return _Layout(
        False,
        struct.Struct(bo + "HHIIIIIHHHHHH"),
        struct.Struct(bo + "IIIIIIII"),
        struct.Struct(bo + "IIIIIIIIII"),
        struct.Struct(bo + "IIIBBH"),
        struct.Struct(bo + "II"),
        struct.Struct(bo + "IIi"),
        struct.Struct(bo + "III"),
        struct.Struct(bo + "III"),
    )


_LAYOUTS = {
    (c, d): _layout(c == _ELFCLASS64, "<" if d == _ELFDATA2LSB else ">")
    for c in (_ELFCLASS32, _ELFCLASS64)
    for d in (_ELFDATA2LSB, _ELFDATA2MSB)
}


class Segment(NamedTuple):
    """One program header."""

    type: int
    flags: int
    offset: int
    vaddr: int
    filesz: int
    memsz: int
    align: int


class Section(NamedTuple):
    """One section header, with its name resolved."""

    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    addralign: int
    entsize: int


class Symbol(NamedTuple):
    """A function symbol: link-time address, size in bytes (size-0 symbols are extended), name as stored."""

    addr: int
    size: int
    name: str


class _Header(NamedTuple):
    layout: _Layout
    e_type: int
    e_machine: int
    phoff: int
    shoff: int
    phentsize: int
    phnum: int
    shentsize: int
    shnum: int
    shstrndx: int


def _parse_header(head: bytes, label: str) -> _Header:
    if len(head) < 16 or head[:4] != _MAGIC:
        raise SymbolizeError(f"{label}: not an ELF file")
    layout = _LAYOUTS.get((head[4], head[5]))
    if layout is None:
        raise SymbolizeError(f"{label}: unsupported ELF class or byte order")
    if len(head) < 16 + layout.ehdr.size:
        raise SymbolizeError(f"{label}: truncated ELF header")
    f = layout.ehdr.unpack_from(head, 16)
    # e_type, e_machine, e_version, e_entry, e_phoff, e_shoff, e_flags, e_ehsize, e_phentsize, e_phnum, ...
    return _Header(layout, f[0], f[1], f[4], f[5], f[8], f[9], f[10], f[11], f[12])


class _Reader:
    """Bounded reads from an open file, served from the first block when possible."""

    def __init__(self, fd: int, size: int, head: bytes, label: str) -> None:
        self.fd = fd
        self.size = size
        self.head = head
        self.label = label

    def read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise SymbolizeError(f"{self.label}: truncated or malformed {what}")
        if offset + length <= len(self.head):
            return self.head[offset : offset + length]
        try:
            data = os.pread(self.fd, length, offset)
        except OSError as e:
            raise SymbolizeError(f"{self.label}: read failed: {e.strerror or e}") from None
        if len(data) != length:
            raise SymbolizeError(f"{self.label}: truncated {what}")
        return data


def _open_regular(path: str | os.PathLike[str]) -> tuple[int, int, str]:
    """Open a regular file for reading; (fd, size, label). O_NONBLOCK so a FIFO cannot hang us."""
    label = os.fsdecode(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SymbolizeError(f"{label}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise SymbolizeError(f"{label}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SymbolizeError(f"{label}: not a regular file")
    return fd, st.st_size, label


def _extended_counts(r: _Reader, h: _Header) -> tuple[int, int, int]:
    """(phnum, shnum, shstrndx), resolving the gABI escape values stored in section header 0."""
    phnum, shnum, shstrndx = h.phnum, h.shnum, h.shstrndx
    if h.shoff and (phnum == _PN_XNUM or shnum == 0 or shstrndx == _SHN_XINDEX):
        if h.shentsize < h.layout.shdr.size:
            raise SymbolizeError(f"{r.label}: malformed section header size")
        s0 = h.layout.shdr.unpack(r.read(h.shoff, h.layout.shdr.size, "section header 0"))
        size0, link0, info0 = s0[5], s0[6], s0[7]
        if phnum == _PN_XNUM:
            phnum = info0
        if shnum == 0:
            shnum = size0
        if shstrndx == _SHN_XINDEX:
            shstrndx = link0
    if phnum > _MAX_TABLE_ENTRIES or shnum > _MAX_TABLE_ENTRIES:
        raise SymbolizeError(f"{r.label}: implausible header counts")
    return phnum, shnum, shstrndx


def _read_segments(r: _Reader, h: _Header, phnum: int) -> list[Segment]:
    if not phnum or not h.phoff:
        return []
    st = h.layout.phdr
    if h.phentsize < st.size:
        raise SymbolizeError(f"{r.label}: malformed program header size")
    table = r.read(h.phoff, phnum * h.phentsize, "program headers")
    out = []
    for i in range(phnum):
        f = st.unpack_from(table, i * h.phentsize)
        if h.layout.is64:
            p_type, p_flags, p_offset, p_vaddr, _pa, p_filesz, p_memsz, p_align = f
        else:
            p_type, p_offset, p_vaddr, _pa, p_filesz, p_memsz, p_flags, p_align = f
        out.append(Segment(p_type, p_flags, p_offset, p_vaddr, p_filesz, p_memsz, p_align))
    return out


def _read_sections(r: _Reader, h: _Header, shnum: int, shstrndx: int) -> list[Section]:
    if not shnum or not h.shoff:
        return []
    st = h.layout.shdr
    if h.shentsize < st.size:
        raise SymbolizeError(f"{r.label}: malformed section header size")
    table = r.read(h.shoff, shnum * h.shentsize, "section headers")
    raw = [st.unpack_from(table, i * h.shentsize) for i in range(shnum)]
    names = b""
    if 0 < shstrndx < shnum:
        s = raw[shstrndx]
        if s[1] != _SHT_NOBITS and s[5] <= _MAX_SECTION_BYTES:
            names = r.read(s[4], s[5], "section name table")
    out = []
    for f in raw:
        sh_name = f[0]
        end = names.find(b"\0", sh_name) if sh_name < len(names) else -1
        name = names[sh_name:end].decode("utf-8", "replace") if end >= 0 else ""
        out.append(Section(name, *f[1:]))
    return out


def _align(n: int, a: int) -> int:
    return (n + a - 1) & ~(a - 1)


def _build_id_in_notes(data: bytes, note: struct.Struct, align: int) -> str | None:
    """The GNU build id among the notes in `data`; a note running past the end stops the walk."""
    pos, n = 0, len(data)
    while pos + 12 <= n:
        namesz, descsz, ntype = note.unpack_from(data, pos)
        name_at = pos + 12
        desc_at = _align(name_at + namesz, align)
        desc_end = desc_at + descsz
        if desc_end > n:
            return None
        if ntype == _NT_GNU_BUILD_ID and descsz and data[name_at : name_at + namesz] == b"GNU\0":
            return data[desc_at:desc_end].hex()
        pos = _align(desc_end, align)
    return None


def _note_align(a: int) -> int:
    # Notes are 4-byte aligned, except in 8-aligned containers (e.g. .note.gnu.property on 64-bit).
    return 8 if a == 8 else 4


def read_build_id(path: str | os.PathLike[str]) -> str | None:
    """Lowercase hex of the file's NT_GNU_BUILD_ID note, or None when it has none.

    Reads only the ELF header, program headers and PT_NOTE segments (section headers as a fallback, e.g. for
    debug files whose notes are not in a segment). Raises SymbolizeError on unreadable, non-ELF, truncated or
    malformed files.
    """
    fd, size, label = _open_regular(path)
    try:
        try:
            head = os.pread(fd, _HEAD_READ, 0)
        except OSError as e:
            raise SymbolizeError(f"{label}: read failed: {e.strerror or e}") from None
        h = _parse_header(head, label)
        r = _Reader(fd, size, head, label)
        phnum, shnum, shstrndx = _extended_counts(r, h)
        for seg in _read_segments(r, h, phnum):
            if seg.type == _PT_NOTE and 0 < seg.filesz <= _MAX_NOTE_BYTES and seg.offset + seg.filesz <= size:
                data = r.read(seg.offset, seg.filesz, "note")
                bid = _build_id_in_notes(data, h.layout.note, _note_align(seg.align))
                if bid:
                    return bid
        if not h.shoff or not shnum:
            return None
        # Section headers only; names are not needed to find SHT_NOTE.
        st = h.layout.shdr
        if h.shentsize < st.size:
            raise SymbolizeError(f"{label}: malformed section header size")
        table = r.read(h.shoff, shnum * h.shentsize, "section headers")
        for i in range(shnum):
            s = st.unpack_from(table, i * h.shentsize)
            sh_type, sh_offset, sh_size, sh_align = s[1], s[4], s[5], s[8]
            if sh_type == _SHT_NOTE and 0 < sh_size <= _MAX_NOTE_BYTES and sh_offset + sh_size <= size:
                data = r.read(sh_offset, sh_size, "note")
                bid = _build_id_in_notes(data, h.layout.note, _note_align(sh_align))
                if bid:
                    return bid
        return None
    finally:
        os.close(fd)


class ElfFile:
    """Symbols and layout of one ELF file. Open with `ElfFile.open(path)`; close with `close()` or `with`."""

    def __init__(
        self, path: str, fd: int, size: int, header: _Header, segments: list[Segment], sections: list[Section]
    ) -> None:
        # Takes ownership of fd; nothing below raises (derived fields swallow their own SymbolizeErrors).
        self._fd: int | None = fd
        # finalize, not __del__: it closes exactly once, also at interpreter exit.
        self._closer = weakref.finalize(self, os.close, fd)
        self.path = path
        self._size = size
        self._h = header
        self._label = os.path.basename(path) or path
        self.segments = segments
        self.sections = sections
        self._by_name: dict[str, Section] = {}
        for s in sections:
            self._by_name.setdefault(s.name, s)
        self._functions: list[Symbol] | None = None
        self.build_id = self._find_build_id()
        self.debuglink = self._read_debuglink()
        self.is_pie_or_dso = header.e_type == _ET_DYN
        self.has_dwarf_lines = self.dwarf_section("line") is not None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ElfFile:
        """Parse the headers of `path`; SymbolizeError on anything unreadable or malformed."""
        fd, size, label = _open_regular(path)
        try:
            try:
                head = os.pread(fd, _HEAD_READ, 0)
            except OSError as e:
                raise SymbolizeError(f"{label}: read failed: {e.strerror or e}") from None
            h = _parse_header(head, label)
            r = _Reader(fd, size, head, label)
            phnum, shnum, shstrndx = _extended_counts(r, h)
            segments = _read_segments(r, h, phnum)
            sections = _read_sections(r, h, shnum, shstrndx)
        except BaseException:
            os.close(fd)
            raise
        return cls(os.fsdecode(path), fd, size, h, segments, sections)

    @property
    def fd_path(self) -> str:
        """A path to exactly this open file for as long as it stays open, even once its own path is gone (a
        `/proc/PID/root/...` path of a process that exited, a file deleted or replaced)."""
        if self._fd is None:
            raise SymbolizeError(f"{self._label}: closed")
        return f"/proc/self/fd/{self._fd}"

    def close(self) -> None:
        """Release the file descriptor; later section reads raise SymbolizeError."""
        self._fd = None
        self._closer()

    def __enter__(self) -> ElfFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def machine(self) -> int:
        """e_machine (62 = x86-64, 183 = AArch64)."""
        return self._h.e_machine

    @property
    def is64(self) -> bool:
        """ELFCLASS64 (else ELFCLASS32)."""
        return self._h.layout.is64

    @property
    def little_endian(self) -> bool:
        """ELFDATA2LSB (else big-endian); DWARF in the file uses the same byte order."""
        return self._h.layout.ehdr.format[0] == "<"

    def section(self, name: str) -> Section | None:
        """The first section called `name`, if any."""
        return self._by_name.get(name)

    # --- layout -------------------------------------------------------------------------------------------

    def file_offset_to_vaddr(self, off: int) -> int | None:
        """Link-time address of file offset `off`, via the PT_LOAD segment whose file bytes contain it."""
        for s in self.segments:
            if s.type == _PT_LOAD and s.offset <= off < s.offset + s.filesz:
                return s.vaddr + (off - s.offset)
        return None

    def vaddr_to_file_offset(self, vaddr: int) -> int | None:
        """File offset of link-time address `vaddr` (where a uprobe on it goes)."""
        for s in self.segments:
            if s.type == _PT_LOAD and s.vaddr <= vaddr < s.vaddr + s.filesz:
                return s.offset + (vaddr - s.vaddr)
        return None

    def function_addresses(self, names: set[str]) -> dict[str, int]:
        """Link-time address of each of `names` that is a defined function in .symtab or .dynsym.

        Unlike functions(), aliases are kept: every name that is asked for and present is found."""
        out: dict[str, int] = {}
        for sec in self.sections:
            if sec.type not in (_SHT_SYMTAB, _SHT_DYNSYM):
                continue
            try:
                for value, _size, _rank, name in self._read_function_symbols(sec):
                    if name in names:
                        out.setdefault(name, value)
            except SymbolizeError:
                continue
        return out

    def debug_layout_vaddr(self, off: int) -> int | None:
        """Best guess of `file_offset_to_vaddr` for a debug-only file (objcopy --only-keep-debug).

        Such files keep the program headers' addresses but not their file offsets. GNU ld lays segments
        out so that vaddr - offset is the same for the text segments (the first PT_LOAD's page-aligned
        vaddr), which is what this assumes; use the real binary whenever it is available.
        """
        loads = [s for s in self.segments if s.type == _PT_LOAD and s.memsz]
        if not loads:
            return None
        first = min(loads, key=lambda s: s.vaddr)
        align = first.align if first.align and first.align & (first.align - 1) == 0 else 0x1000
        base = first.vaddr & ~(align - 1)
        vaddr = base + off
        for s in loads:
            if s.vaddr <= vaddr < s.vaddr + s.memsz:
                return vaddr
        return None

    # --- sections -----------------------------------------------------------------------------------------

    def read_section(self, sec: Section) -> bytes:
        """The contents of `sec`, decompressed when SHF_COMPRESSED (zlib) or a GNU .zdebug section."""
        if sec.type == _SHT_NOBITS or sec.size == 0:
            return b""
        if sec.size > _MAX_SECTION_BYTES or sec.offset + sec.size > self._size:
            raise SymbolizeError(f"{self._label}: section {sec.name or '?'} lies outside the file")
        if self._fd is None:
            raise SymbolizeError(f"{self._label}: file is closed")
        try:
            data = os.pread(self._fd, sec.size, sec.offset)
        except OSError as e:
            raise SymbolizeError(f"{self._label}: read failed: {e.strerror or e}") from None
        if len(data) != sec.size:
            raise SymbolizeError(f"{self._label}: truncated section {sec.name}")
        if sec.flags & _SHF_COMPRESSED:
            ch = self._h.layout.chdr
            if len(data) < ch.size:
                raise SymbolizeError(f"{self._label}: truncated compressed section {sec.name}")
            f = ch.unpack_from(data, 0)
            ch_type, ch_size = f[0], (f[2] if self.is64 else f[1])
            if ch_type != _ELFCOMPRESS_ZLIB:
                raise SymbolizeError(f"{self._label}: unsupported compression {ch_type} in {sec.name}")
            return self._inflate(data[ch.size :], ch_size, sec.name)
        if sec.name.startswith(".zdebug") and data[:4] == b"ZLIB" and len(data) >= 12:
            return self._inflate(data[12:], int.from_bytes(data[4:12], "big"), sec.name)
        return data

    def _inflate(self, data: bytes, size: int, name: str) -> bytes:
        if size > _MAX_SECTION_BYTES:
            raise SymbolizeError(f"{self._label}: implausible size of compressed {name}")
        try:
            # max_length bounds the output so a lying header cannot balloon memory.
            out = zlib.decompressobj().decompress(data, size + 1)
        except zlib.error:
            raise SymbolizeError(f"{self._label}: corrupt compressed section {name}") from None
        if len(out) != size:
            raise SymbolizeError(f"{self._label}: compressed section {name} has the wrong size")
        return out

    def is_compressed(self, sec: Section) -> bool:
        """Whether the section's bytes must be inflated (SHF_COMPRESSED or a GNU .zdebug section)."""
        return bool(sec.flags & _SHF_COMPRESSED) or sec.name.startswith(".zdebug")

    def read_section_range(self, sec: Section, offset: int, size: int) -> bytes:
        """Up to `size` bytes at `offset` within an uncompressed section (fewer at its end), without reading
        the rest of it: lets DWARF readers touch a few CUs of a multi-gigabyte .debug_info."""
        if self.is_compressed(sec):
            raise SymbolizeError(f"{self._label}: section {sec.name} is compressed")
        if sec.type == _SHT_NOBITS or offset < 0 or size <= 0 or offset >= sec.size:
            return b""
        if sec.offset + sec.size > self._size:
            raise SymbolizeError(f"{self._label}: section {sec.name or '?'} lies outside the file")
        return self._pread(sec.offset + offset, min(size, sec.size - offset))

    def dwarf_section(self, short: str) -> Section | None:
        """The `.debug_<short>` (or `.zdebug_<short>`) section when it holds data."""
        for name in (".debug_" + short, ".zdebug_" + short):
            s = self._by_name.get(name)
            if s is not None and s.type != _SHT_NOBITS and s.size > 0:
                return s
        return None

    def _find_build_id(self) -> str | None:
        try:
            for sec in self.sections:
                if sec.type == _SHT_NOTE and 0 < sec.size <= _MAX_NOTE_BYTES:
                    data = self.read_section(sec)
                    bid = _build_id_in_notes(data, self._h.layout.note, _note_align(sec.addralign))
                    if bid:
                        return bid
            for seg in self.segments:
                fits = seg.offset + seg.filesz <= self._size
                if seg.type == _PT_NOTE and 0 < seg.filesz <= _MAX_NOTE_BYTES and fits:
                    data = self._pread(seg.offset, seg.filesz)
                    bid = _build_id_in_notes(data, self._h.layout.note, _note_align(seg.align))
                    if bid:
                        return bid
        except SymbolizeError:
            return None
        return None

    def _pread(self, off: int, n: int) -> bytes:
        if self._fd is None:
            raise SymbolizeError(f"{self._label}: file is closed")
        try:
            return os.pread(self._fd, n, off)
        except OSError as e:
            raise SymbolizeError(f"{self._label}: read failed: {e.strerror or e}") from None

    def _read_debuglink(self) -> tuple[str, int] | None:
        sec = self._by_name.get(".gnu_debuglink")
        if sec is None:
            return None
        try:
            data = self.read_section(sec)
        except SymbolizeError:
            return None
        end = data.find(b"\0")
        crc_at = _align(end + 1, 4)
        if end <= 0 or crc_at + 4 > len(data):
            return None
        crc = int.from_bytes(data[crc_at : crc_at + 4], "little" if self.little_endian else "big")
        return os.fsdecode(data[:end]), crc

    # --- symbols ------------------------------------------------------------------------------------------

    def functions(self) -> list[Symbol]:
        """Function symbols (STT_FUNC, STT_GNU_IFUNC) of .symtab and .dynsym, plus `name@plt` PLT stubs.

        Sorted by address, one per address (among aliases: sized, global, fewer leading underscores, shorter
        name wins). A symbol of size 0 gets the size up to the next symbol or the end of its executable
        section. Tables lying outside the file are skipped. The list is cached; don't mutate it.
        """
        if self._functions is None:
            raw: list[tuple[int, int, int, str]] = []  # addr, size, binding rank, name
            for sec in self.sections:
                if sec.type in (_SHT_SYMTAB, _SHT_DYNSYM):
                    try:
                        raw.extend(self._read_function_symbols(sec))
                    except SymbolizeError:
                        continue
            try:
                raw.extend(self._plt_symbols())
            except SymbolizeError:
                pass
            self._functions = self._finish(raw)
        return self._functions

    def _strtab_for(self, sec: Section) -> bytes:
        if not 0 < sec.link < len(self.sections):
            return b""
        return self.read_section(self.sections[sec.link])

    def _iter_syms(self, data: bytes, entsize: int) -> Iterator[tuple[int, int, int, int, int]]:
        """(st_name, st_info, st_shndx, st_value, st_size) of each entry."""
        st = self._h.layout.sym
        count = len(data) // entsize
        if entsize == st.size:
            it = st.iter_unpack(memoryview(data)[: count * entsize])
        else:
            it = (st.unpack_from(data, i * entsize) for i in range(count))
        if self.is64:
            for name, info, _other, shndx, value, size in it:
                yield name, info, shndx, value, size
        else:
            for name, value, size, info, _other, shndx in it:
                yield name, info, shndx, value, size

    def _read_function_symbols(self, sec: Section) -> Iterator[tuple[int, int, int, str]]:
        entsize = sec.entsize or self._h.layout.sym.size
        if entsize < self._h.layout.sym.size:
            return
        data = self.read_section(sec)
        strtab = self._strtab_for(sec)
        thumb = self._h.e_machine == _EM_ARM
        for name_off, info, shndx, value, size in self._iter_syms(data, entsize):
            kind = info & 0xF
            if (kind != _STT_FUNC and kind != _STT_GNU_IFUNC) or not value:
                continue
            if shndx == _SHN_UNDEF or shndx == _SHN_ABS or shndx == _SHN_COMMON:
                continue
            end = strtab.find(b"\0", name_off)
            if end <= name_off:
                continue
            if thumb:
                value &= ~1  # bit 0 marks Thumb code, not part of the address
            bind = info >> 4
            rank = 0 if bind == _STB_GLOBAL else 1 if bind == _STB_WEAK else 2
            yield value, size, rank, strtab[name_off:end].decode("utf-8", "replace")

    def _plt_symbols(self) -> list[tuple[int, int, int, str]]:
        """`name@plt` for each lazy-binding PLT entry: entry i belongs to relocation i of .rela.plt."""
        if self._h.e_machine in (_EM_X86_64, _EM_386):
            header, entry = 16, 16
        elif self._h.e_machine == _EM_AARCH64:
            header, entry = 32, 16
        else:
            return []
        rel = self._by_name.get(".rela.plt") or self._by_name.get(".rel.plt")
        if rel is None or rel.type not in (_SHT_RELA, _SHT_REL) or not 0 < rel.link < len(self.sections):
            return []
        dynsym = self.sections[rel.link]
        rst = self._h.layout.rela if rel.type == _SHT_RELA else self._h.layout.rel
        relocs = self.read_section(rel)
        if not relocs or dynsym.type != _SHT_DYNSYM:
            return []
        count = len(relocs) // rst.size
        plt_sec, plt = self._by_name.get(".plt.sec"), self._by_name.get(".plt")
        if plt_sec is not None and plt_sec.size >= entry * count:
            base = plt_sec.addr  # IBT layout: callers enter through .plt.sec, which has no header
        elif plt is not None and plt.size >= header + entry * count:
            base = plt.addr + header
        else:
            return []
        syms = self.read_section(dynsym)
        strtab = self._strtab_for(dynsym)
        sst = self._h.layout.sym
        sym_ent = dynsym.entsize or sst.size
        shift = 32 if self.is64 else 8
        out = []
        for i in range(count):
            r_info = rst.unpack_from(relocs, i * rst.size)[1]
            idx = r_info >> shift
            if not idx or (idx + 1) * sym_ent > len(syms) or sym_ent < sst.size:
                continue  # e.g. IRELATIVE: no symbol to name the stub after
            name_off = sst.unpack_from(syms, idx * sym_ent)[0]
            end = strtab.find(b"\0", name_off)
            if end > name_off:
                name = strtab[name_off:end].decode("utf-8", "replace")
                out.append((base + i * entry, entry, 3, name + "@plt"))
        return out

    def _exec_ranges(self) -> list[tuple[int, int]]:
        ranges = [
            (s.addr, s.addr + s.size)
            for s in self.sections
            if s.flags & _SHF_EXECINSTR and s.flags & _SHF_ALLOC and s.size
        ]
        if not ranges:
            loads = [s for s in self.segments if s.type == _PT_LOAD and s.flags & _PF_X]
            ranges = [(s.vaddr, s.vaddr + s.memsz) for s in loads]
        ranges.sort()
        return ranges

    def _finish(self, raw: list[tuple[int, int, int, str]]) -> list[Symbol]:
        def preference(t: tuple[int, int, int, str]) -> tuple[int, int, int, int, int, str]:
            addr, size, rank, name = t
            return addr, size == 0, rank, len(name) - len(name.lstrip("_")), len(name), name

        raw.sort(key=preference)
        uniq: list[tuple[int, int, int, str]] = []
        for t in raw:
            if not uniq or uniq[-1][0] != t[0]:
                uniq.append(t)
        ranges = self._exec_ranges()
        starts = [a for a, _ in ranges]
        out = []
        for i, (addr, size, _rank, name) in enumerate(uniq):
            if size == 0:
                nxt = uniq[i + 1][0] if i + 1 < len(uniq) else None
                j = bisect.bisect_right(starts, addr) - 1
                limit = ranges[j][1] if j >= 0 and addr < ranges[j][1] else None
                ends = [e for e in (nxt, limit) if e is not None]
                size = min(ends) - addr if ends else 0
            out.append(Symbol(addr, size, name))
        return out
