"""The ELF container, parsed with `struct`: file header, program and section header tables (with the gABI's
extended numbering), bounded reads, and notes with the GNU build id. elf.py builds ElfFile and read_build_id on
these; cubin.py reads in-memory cubins with them. Every malformed-input path raises `Unreadable`.

`parse_header` is the project's one decoder of the ELF file header (e_ident, e_machine, e_flags, the table
offsets): the ELF reader, cubins, fatbin payloads, code objects copied from a target and imported AMDGPU code
objects all go through it; `sniff_header` is the same for callers that only ask what a blob is."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

from aiflame.core import limits
from aiflame.core.errors import Unreadable
from aiflame.core.safe_files import open_regular

__all__ = [
    "ELF_MAGIC",
    "Header",
    "Layout",
    "Reader",
    "Section",
    "Segment",
    "align_up",
    "build_id_in",
    "extended_counts",
    "open_elf",
    "parse_header",
    "read_sections",
    "read_segments",
    "sniff_header",
]

ELF_MAGIC = b"\x7fELF"
_ELFCLASS32, _ELFCLASS64 = 1, 2
_ELFDATA2LSB, _ELFDATA2MSB = 1, 2
ET_DYN = 3
PT_LOAD, PT_NOTE = 1, 4
PF_X = 1
SHT_SYMTAB, SHT_RELA, SHT_NOTE, SHT_NOBITS, SHT_REL, SHT_DYNSYM = 2, 4, 7, 8, 9, 11
SHF_ALLOC, SHF_EXECINSTR, SHF_COMPRESSED = 0x2, 0x4, 0x800
_SHN_XINDEX = 0xFFFF
_PN_XNUM = 0xFFFF
_NT_GNU_BUILD_ID = 3

_HEAD_READ = 4096  # one read covers the ELF header, program headers and notes of almost every binary
_MAX_NOTE_BYTES = 1 << 20
_MAX_TABLE_ENTRIES = 1 << 20  # sanity bound on e_phnum / e_shnum (extended numbering allows 2^32)


class Layout(NamedTuple):
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


def _formats(is64: bool, bo: str) -> Layout:
    if is64:
        return Layout(
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
    return Layout(
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


LAYOUTS = {
    (c, d): _formats(c == _ELFCLASS64, "<" if d == _ELFDATA2LSB else ">")
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


class Header(NamedTuple):
    """The ELF file header: e_ident's class and byte order (as `layout`), OS ABI and ABI version, then the fields
    after e_ident (e_version, e_entry and e_ehsize left out: no reader needs them)."""

    layout: Layout
    e_type: int
    e_machine: int
    phoff: int
    shoff: int
    phentsize: int
    phnum: int
    shentsize: int
    shnum: int
    shstrndx: int
    e_flags: int
    osabi: int  # e_ident[EI_OSABI]
    abi_version: int  # e_ident[EI_ABIVERSION]

    @property
    def little_endian(self) -> bool:
        return self.layout.ehdr.format[0] == "<"


def parse_header(head: bytes, label: str) -> Header:
    """The file header at the start of `head`; Unreadable (one line, prefixed with `label`) when `head` is
    not an ELF file, has a class or byte order other than 32/64-bit and little/big-endian, or is shorter than
    its class's header."""
    if len(head) < 16 or head[:4] != ELF_MAGIC:
        raise Unreadable(f"{label}: not an ELF file")
    layout = LAYOUTS.get((head[4], head[5]))
    if layout is None:
        raise Unreadable(f"{label}: unsupported ELF class or byte order ({head[4]}, {head[5]})")
    if len(head) < 16 + layout.ehdr.size:
        raise Unreadable(f"{label}: truncated ELF header ({len(head)} of {16 + layout.ehdr.size} bytes)")
    f = layout.ehdr.unpack_from(head, 16)
    # e_type, e_machine, e_version, e_entry, e_phoff, e_shoff, e_flags, e_ehsize, e_phentsize, e_phnum, ...
    return Header(layout, f[0], f[1], f[4], f[5], f[8], f[9], f[10], f[11], f[12], f[6], head[7], head[8])


def sniff_header(head: bytes) -> Header | None:
    """`parse_header`, or None where it would raise: for callers that only ask what a blob is."""
    try:
        return parse_header(head, "")
    except Unreadable:
        return None


class Reader:
    """Bounded reads from an open file, served from the first block when possible."""

    def __init__(self, fd: int, size: int, head: bytes, label: str) -> None:
        self.fd = fd
        self.size = size
        self.head = head
        self.label = label

    def read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise Unreadable(f"{self.label}: truncated or malformed {what}")
        if offset + length <= len(self.head):
            return self.head[offset : offset + length]
        try:
            data = os.pread(self.fd, length, offset)
        except OSError as e:
            raise Unreadable(f"{self.label}: read failed: {e.strerror or e}") from None
        if len(data) != length:
            raise Unreadable(f"{self.label}: truncated {what}")
        return data


def _open_regular(path: str | os.PathLike[str]) -> tuple[int, int, str]:
    """Open a regular file for reading; (fd, size, label). The path may come from a watched process: nothing but a
    regular file is opened at all (core/safe_files.py: no terminal, FIFO or device)."""
    label = os.fsdecode(path)
    try:
        fd, st = open_regular(path)
    except OSError as e:
        raise Unreadable(f"{label}: {e.strerror or e}") from None
    return fd, st.st_size, label


def open_elf(path: str | os.PathLike[str]) -> tuple[Reader, Header, int, int, int]:
    """Open `path` and parse its file header: a Reader over it (its `fd` is the caller's to close), the header,
    and (phnum, shnum, shstrndx). Unreadable, with nothing left open, when it is not a readable ELF file."""
    fd, size, label = _open_regular(path)
    try:
        try:
            head = os.pread(fd, _HEAD_READ, 0)
        except OSError as e:
            raise Unreadable(f"{label}: read failed: {e.strerror or e}") from None
        h = parse_header(head, label)
        r = Reader(fd, size, head, label)
        return (r, h, *extended_counts(r, h))
    except BaseException:
        os.close(fd)
        raise


def extended_counts(r: Reader, h: Header) -> tuple[int, int, int]:
    """(phnum, shnum, shstrndx), resolving the gABI escape values stored in section header 0."""
    phnum, shnum, shstrndx = h.phnum, h.shnum, h.shstrndx
    if h.shoff and (phnum == _PN_XNUM or shnum == 0 or shstrndx == _SHN_XINDEX):
        if h.shentsize < h.layout.shdr.size:
            raise Unreadable(f"{r.label}: malformed section header size")
        s0 = h.layout.shdr.unpack(r.read(h.shoff, h.layout.shdr.size, "section header 0"))
        size0, link0, info0 = s0[5], s0[6], s0[7]
        if phnum == _PN_XNUM:
            phnum = info0
        if shnum == 0:
            shnum = size0
        if shstrndx == _SHN_XINDEX:
            shstrndx = link0
    if phnum > _MAX_TABLE_ENTRIES or shnum > _MAX_TABLE_ENTRIES:
        raise Unreadable(f"{r.label}: implausible header counts")
    return phnum, shnum, shstrndx


def read_segments(r: Reader, h: Header, phnum: int) -> list[Segment]:
    if not phnum or not h.phoff:
        return []
    st = h.layout.phdr
    if h.phentsize < st.size:
        raise Unreadable(f"{r.label}: malformed program header size")
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


def read_sections(r: Reader, h: Header, shnum: int, shstrndx: int) -> list[Section]:
    if not shnum or not h.shoff:
        return []
    st = h.layout.shdr
    if h.shentsize < st.size:
        raise Unreadable(f"{r.label}: malformed section header size")
    table = r.read(h.shoff, shnum * h.shentsize, "section headers")
    raw = [st.unpack_from(table, i * h.shentsize) for i in range(shnum)]
    names = b""
    if 0 < shstrndx < shnum:
        s = raw[shstrndx]
        if s[1] != SHT_NOBITS and s[5] <= limits.current().section_bytes:
            names = r.read(s[4], s[5], "section name table")
    out = []
    for f in raw:
        sh_name = f[0]
        end = names.find(b"\0", sh_name) if sh_name < len(names) else -1
        name = names[sh_name:end].decode("utf-8", "replace") if end >= 0 else ""
        out.append(Section(name, *f[1:]))
    return out


def align_up(n: int, a: int) -> int:
    return (n + a - 1) & ~(a - 1)


def _build_id_in_notes(data: bytes, note: struct.Struct, align: int) -> str | None:
    """The GNU build id among the notes in `data`; a note running past the end stops the walk."""
    pos, n = 0, len(data)
    while pos + 12 <= n:
        namesz, descsz, ntype = note.unpack_from(data, pos)
        name_at = pos + 12
        desc_at = align_up(name_at + namesz, align)
        desc_end = desc_at + descsz
        if desc_end > n:
            return None
        if ntype == _NT_GNU_BUILD_ID and descsz and data[name_at : name_at + namesz] == b"GNU\0":
            return data[desc_at:desc_end].hex()
        pos = align_up(desc_end, align)
    return None


def build_id_in(areas: Iterable[tuple[int, int, int]], read: Callable[[int, int], bytes], note: struct.Struct,
                file_size: int) -> str | None:
    """Lowercase hex of the first GNU build id in the note areas, each (file offset, size, alignment), read with
    `read(offset, size)`. Empty, implausibly large or out-of-file areas are skipped."""
    for off, size, align in areas:
        if 0 < size <= _MAX_NOTE_BYTES and off + size <= file_size:
            # Notes are 4-byte aligned, except in 8-aligned containers (e.g. .note.gnu.property on 64-bit).
            bid = _build_id_in_notes(read(off, size), note, 8 if align == 8 else 4)
            if bid:
                return bid
    return None
