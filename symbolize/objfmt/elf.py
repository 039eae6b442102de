"""Reading ELF files for symbolization: build ids, load segments, raw (and compressed) sections; the function
symbols are elf_symbols.py's, the header and table formats elf_format.py's, DWARF lines dwarf_lines.py's.

`read_build_id` runs for every mapping of every profiled process at capture time and must read only a few hundred
bytes, so everything is parsed with `struct`, not pyelftools. Files are read with `pread`, never mmap: a binary
truncated while we hold it would turn an mmap access into SIGBUS for the whole agent. Every malformed-input path
raises `Unreadable`.
"""

from __future__ import annotations

import os
import weakref

from aiflame.core import limits
from aiflame.core.errors import Unreadable
from aiflame.core.limits import charge
from aiflame.symbolize.objfmt.elf_format import (
    ET_DYN,
    PT_LOAD,
    PT_NOTE,
    SHF_COMPRESSED,
    SHT_NOBITS,
    SHT_NOTE,
    Header,
    Layout,
    Section,
    Segment,
    align_up,
    build_id_in,
    open_elf,
    read_sections,
    read_segments,
)
from aiflame.symbolize.objfmt.elf_symbols import Symbol, function_addresses, function_symbols
from aiflame.symbolize.objfmt.inflate import inflate_zlib

__all__ = ["ElfFile", "read_build_id"]

EM_X86_64 = 62  # e_machine
_ELFCOMPRESS_ZLIB = 1


def read_build_id(path: str | os.PathLike[str]) -> str | None:
    """Lowercase hex of the file's NT_GNU_BUILD_ID note, or None when it has none.

    Reads only the ELF header, program headers and PT_NOTE segments (section headers as a fallback, e.g. for
    debug files whose notes are not in a segment). Raises Unreadable on unreadable, non-ELF, truncated or
    malformed files.
    """
    r, h, phnum, shnum, _shstrndx = open_elf(path)

    def read(off: int, n: int) -> bytes:
        return r.read(off, n, "note")

    try:
        segments = read_segments(r, h, phnum)
        bid = build_id_in(((s.offset, s.filesz, s.align) for s in segments if s.type == PT_NOTE), read,
                          h.layout.note, r.size)
        if bid or not h.shoff or not shnum:
            return bid
        # Section headers only; names are not needed to find SHT_NOTE.
        st = h.layout.shdr
        if h.shentsize < st.size:
            raise Unreadable(f"{r.label}: malformed section header size")
        table = r.read(h.shoff, shnum * h.shentsize, "section headers")
        raw = (st.unpack_from(table, i * h.shentsize) for i in range(shnum))
        # sh_type, sh_offset, sh_size, sh_addralign
        return build_id_in(((f[4], f[5], f[8]) for f in raw if f[1] == SHT_NOTE), read, h.layout.note, r.size)
    finally:
        os.close(r.fd)


class ElfFile:
    """Symbols and layout of one ELF file. Open with `ElfFile.open(path)`; close with `close()` or `with`."""

    def __init__(
        self, path: str, fd: int, size: int, header: Header, segments: list[Segment], sections: list[Section]
    ) -> None:
        # Takes ownership of fd; nothing below raises (derived fields swallow their own Unreadable errors).
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
        self.is_pie_or_dso = header.e_type == ET_DYN
        self.has_dwarf_lines = self.dwarf_section("line") is not None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ElfFile:
        """Parse the headers of `path`; Unreadable on anything unreadable or malformed."""
        r, h, phnum, shnum, shstrndx = open_elf(path)
        try:
            segments = read_segments(r, h, phnum)
            sections = read_sections(r, h, shnum, shstrndx)
        except BaseException:
            os.close(r.fd)
            raise
        return cls(os.fsdecode(path), r.fd, r.size, h, segments, sections)

    @property
    def fd_path(self) -> str:
        """A path to exactly this open file for as long as it stays open, even once its own path is gone (a
        `/proc/PID/root/...` path of a process that exited, a file deleted or replaced)."""
        if self._fd is None:
            raise Unreadable(f"{self._label}: closed")
        return f"/proc/self/fd/{self._fd}"

    def close(self) -> None:
        """Release the file descriptor; later section reads raise Unreadable."""
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
    def layout(self) -> Layout:
        """The struct formats of this file's class and byte order."""
        return self._h.layout

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
            if s.type == PT_LOAD and s.offset <= off < s.offset + s.filesz:
                return s.vaddr + (off - s.offset)
        return None

    def vaddr_to_file_offset(self, vaddr: int) -> int | None:
        """File offset of link-time address `vaddr` (where a uprobe on it goes)."""
        for s in self.segments:
            if s.type == PT_LOAD and s.vaddr <= vaddr < s.vaddr + s.filesz:
                return s.offset + (vaddr - s.vaddr)
        return None

    def function_addresses(self, names: set[str], together: bool = False) -> dict[str, int]:
        """Link-time address of each of `names` that is a defined function in .symtab or .dynsym (aliases kept:
        every name asked for and present is found). `together`: one library's API (elf_symbols.py)."""
        return function_addresses(self, names, together)

    def debug_layout_vaddr(self, off: int) -> int | None:
        """Best guess of `file_offset_to_vaddr` for a debug-only file (objcopy --only-keep-debug).

        Such files keep the program headers' addresses but not their file offsets. GNU ld lays segments
        out so that vaddr - offset is the same for the text segments (the first PT_LOAD's page-aligned
        vaddr), which is what this assumes; use the real binary whenever it is available.
        """
        loads = [s for s in self.segments if s.type == PT_LOAD and s.memsz]
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
        """The contents of `sec`, decompressed when SHF_COMPRESSED (zlib) or a GNU .zdebug section. Both the
        bytes read and the bytes inflated are capped by core/limits.py (section_bytes, and the allowance of the
        process being served)."""
        if sec.type == SHT_NOBITS or sec.size == 0:
            return b""
        if sec.offset + sec.size > self._size:
            raise Unreadable(f"{self._label}: section {sec.name or '?'} lies outside the file")
        if self._fd is None:
            raise Unreadable(f"{self._label}: file is closed")
        what = f"{self._label}: section {sec.name or '?'}"
        charge(sec.size, what, limits.current().section_bytes)  # Refused (an Unreadable) when too large
        try:
            data = os.pread(self._fd, sec.size, sec.offset)
        except OSError as e:
            raise Unreadable(f"{self._label}: read failed: {e.strerror or e}") from None
        if len(data) != sec.size:
            raise Unreadable(f"{self._label}: truncated section {sec.name}")
        if sec.flags & SHF_COMPRESSED:
            ch = self._h.layout.chdr
            if len(data) < ch.size:
                raise Unreadable(f"{self._label}: truncated compressed section {sec.name}")
            f = ch.unpack_from(data, 0)
            ch_type, ch_size = f[0], (f[2] if self.is64 else f[1])
            if ch_type != _ELFCOMPRESS_ZLIB:
                raise Unreadable(f"{self._label}: unsupported compression {ch_type} in {sec.name}")
            return inflate_zlib(memoryview(data)[ch.size:], ch_size, limits.current().section_bytes, what)
        if sec.name.startswith(".zdebug") and data[:4] == b"ZLIB" and len(data) >= 12:
            return inflate_zlib(memoryview(data)[12:], int.from_bytes(data[4:12], "big"),
                                limits.current().section_bytes, what)
        return data

    def is_compressed(self, sec: Section) -> bool:
        """Whether the section's bytes must be inflated (SHF_COMPRESSED or a GNU .zdebug section)."""
        return bool(sec.flags & SHF_COMPRESSED) or sec.name.startswith(".zdebug")

    def read_section_range(self, sec: Section, offset: int, size: int) -> bytes:
        """Up to `size` bytes at `offset` within an uncompressed section (fewer at its end), without reading
        the rest of it: lets DWARF readers touch a few CUs of a multi-gigabyte .debug_info."""
        if self.is_compressed(sec):
            raise Unreadable(f"{self._label}: section {sec.name} is compressed")
        if sec.type == SHT_NOBITS or offset < 0 or size <= 0 or offset >= sec.size:
            return b""
        if sec.offset + sec.size > self._size:
            raise Unreadable(f"{self._label}: section {sec.name or '?'} lies outside the file")
        return self.pread(sec.offset + offset, min(size, sec.size - offset))

    def dwarf_section(self, short: str) -> Section | None:
        """The `.debug_<short>` (or `.zdebug_<short>`) section when it holds data."""
        for name in (".debug_" + short, ".zdebug_" + short):
            s = self._by_name.get(name)
            if s is not None and s.type != SHT_NOBITS and s.size > 0:
                return s
        return None

    def _find_build_id(self) -> str | None:
        note = self._h.layout.note
        try:
            return (build_id_in(((s.offset, s.size, s.addralign) for s in self.sections if s.type == SHT_NOTE),
                                self.pread, note, self._size)
                    or build_id_in(((s.offset, s.filesz, s.align) for s in self.segments if s.type == PT_NOTE),
                                   self.pread, note, self._size))
        except Unreadable:
            return None

    def pread(self, off: int, n: int) -> bytes:
        """Up to `n` bytes of the file at `off` (fewer at its end)."""
        if self._fd is None:
            raise Unreadable(f"{self._label}: file is closed")
        try:
            return os.pread(self._fd, n, off)
        except OSError as e:
            raise Unreadable(f"{self._label}: read failed: {e.strerror or e}") from None

    def _read_debuglink(self) -> tuple[str, int] | None:
        sec = self._by_name.get(".gnu_debuglink")
        if sec is None:
            return None
        try:
            data = self.read_section(sec)
        except Unreadable:
            return None
        end = data.find(b"\0")
        crc_at = align_up(end + 1, 4)
        if end <= 0 or crc_at + 4 > len(data):
            return None
        crc = int.from_bytes(data[crc_at : crc_at + 4], "little" if self.little_endian else "big")
        return os.fsdecode(data[:end]), crc

    # --- symbols ------------------------------------------------------------------------------------------

    def functions(self) -> list[Symbol]:
        """Function symbols, sorted by address, one per address, sized (elf_symbols.function_symbols). The list is
        cached; don't mutate it."""
        if self._functions is None:
            self._functions = function_symbols(self)
        return self._functions
