"""Cubins (NVIDIA GPU ELF files, EM_CUDA): architecture, kernels, and the source line of each SASS instruction.

Each kernel is an STT_FUNC symbol at the start of its own `.text.<mangled name>` section, so a PC offset is an
offset into that section (16 bytes per instruction, what nvdisasm prints as `/*0040*/`). With `-lineinfo` the
cubin carries DWARF v3 `.debug_line` programs but no `.debug_info` CU, and every sequence starts at address 0:
which function a sequence describes is known only from the relocation (`.rel.debug_line` on sm_80,
`.rela.debug_line` on sm_90) applied to its DW_LNE_set_address. So the line programs are run here directly,
with those relocations (dwarf_lines.py's reader assumes host-style absolute addresses and drops sequences at 0),
through the header parser and state machine of dwarf_program.py.

The ELF headers are read with elf_format.py's bounded helpers over an in-memory buffer (cubins come out of
fatbins, never from a file of their own). Malformed input raises `Unreadable`.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import struct
from dataclasses import dataclass
from typing import NamedTuple

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.dwarf_forms import DWARF_ERRORS
from aiflame.symbolize.objfmt.dwarf_program import parse_line_header, run_line_program
from aiflame.symbolize.objfmt.elf_format import (
    Header,
    Reader,
    Section,
    extended_counts,
    parse_header,
    read_sections,
    sniff_header,
)

__all__ = ["EM_CUDA", "Cubin", "CubinLines", "Kernel", "LineRange", "cubin_arch", "parse_cubin"]

log = logging.getLogger(__name__)

EM_CUDA = 190
_ELFABIVERSION_CUDA_V1 = 7  # the last ELF ABI version with the SM in e_flags' low byte (bits 8-15 from ABI 8)
_STO_CUDA_ENTRY = 0x10
_SHT_SYMTAB, _SHT_RELA, _SHT_NOBITS, _SHT_REL = 2, 4, 8, 9
_STT_SECTION, _STT_FUNC = 3, 2
_SHN_LORESERVE = 0xFF00
_MAX_SECTION = 1 << 30


@dataclass(frozen=True)
class Kernel:
    """A function of a cubin: a `__global__` kernel (`entry`) or a `__device__` function compiled out of line."""

    name: str  # mangled, as in the symbol table
    section: str  # ".text." + name
    size: int  # bytes of SASS
    entry: bool  # st_other STO_CUDA_ENTRY
    symbol_index: int  # what `nvdisasm -fun` takes
    section_index: int
    value: int  # symbol value: its offset within the section (0 in every cubin nvcc writes)


class LineRange(NamedTuple):
    """Instructions at offsets [start, end) of a kernel come from `file`:`line`."""

    start: int
    end: int
    file: str
    line: int


class CubinLines:
    """Source lines of the SASS of one cubin, per kernel; built by `Cubin.lines()`."""

    def __init__(self, tables: dict[str, list[LineRange]]) -> None:
        self._tables = tables
        self._starts = {k: [r.start for r in rows] for k, rows in tables.items()}

    def lookup(self, kernel: str, offset: int) -> tuple[str, int] | None:
        """(file, line) of the instruction at byte `offset` of `kernel` (mangled name), or None."""
        starts = self._starts.get(kernel)
        if not starts:
            return None
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return None
        r = self._tables[kernel][i]
        return (r.file, r.line) if offset < r.end else None

    def table(self, kernel: str) -> list[LineRange]:
        """The whole table of `kernel`, sorted by offset, adjacent equal lines merged; [] without line info."""
        return list(self._tables.get(kernel, ()))

    def kernels(self) -> list[str]:
        """Names of the kernels that have line information."""
        return [k for k, rows in self._tables.items() if rows]

    def __contains__(self, kernel: object) -> bool:
        return bool(self._tables.get(kernel)) if isinstance(kernel, str) else False


class _Sym(NamedTuple):
    name: str
    info: int
    other: int
    shndx: int
    value: int
    size: int


class Cubin:
    """One parsed cubin: `arch` (90 for sm_90), `kernels` by mangled name, `digest` (sha256 hex of the bytes)."""

    def __init__(
        self,
        data: bytes,
        label: str,
        arch: int,
        sections: list[Section],
        symbols: list[_Sym],
        kernels: dict[str, Kernel],
        digest: str,
    ) -> None:
        self.data = data
        self.label = label
        self.arch = arch
        self.sections = sections
        self.kernels = kernels
        self.digest = digest
        self._symbols = symbols
        self._lines: CubinLines | None = None

    @property
    def has_code(self) -> bool:
        """Whether any `.text.*` section exists; nvcc also emits cubins without kernels, to be skipped."""
        return any(s.name.startswith(".text.") for s in self.sections)

    @property
    def has_lines(self) -> bool:
        """Whether the cubin carries a `.debug_line` section (built with -lineinfo or -G)."""
        return any(s.name == ".debug_line" and s.size for s in self.sections)

    def section_data(self, sec: Section) -> bytes:
        """The bytes of `sec`; Unreadable when it lies outside the cubin."""
        if sec.type == _SHT_NOBITS or not sec.size:
            return b""
        if sec.size > _MAX_SECTION or sec.offset + sec.size > len(self.data):
            raise Unreadable(f"{self.label}: section {sec.name or '?'} lies outside the cubin")
        return self.data[sec.offset : sec.offset + sec.size]

    def code(self, kernel: str) -> bytes:
        """The SASS bytes of `kernel`."""
        k = self.kernels[kernel]
        data = self.section_data(self.sections[k.section_index])
        return data[k.value : k.value + k.size]

    def lines(self) -> CubinLines:
        """Line tables of every kernel (parsed once); Unreadable when `.debug_line` is malformed."""
        if self._lines is None:
            self._lines = _LineReader(self).read()
        return self._lines


def parse_cubin(data: bytes, *, label: str = "cubin", digest: str | None = None) -> Cubin:
    """Parse the cubin in `data` (headers, symbols, kernels; line tables later, on `lines()`).

    `digest` saves rehashing when the caller has it (FatbinEntry.digest). Raises Unreadable when `data` is not
    a 64-bit little-endian EM_CUDA ELF or is malformed.
    """
    h = parse_header(data, label)
    if h.e_machine != EM_CUDA:
        raise Unreadable(f"{label}: not a cubin (e_machine {h.e_machine})")
    if not h.layout.is64 or not h.little_endian:
        raise Unreadable(f"{label}: not a 64-bit little-endian cubin")
    # All reads are bounded by len(data) and served from it; the descriptor is never used.
    r = Reader(-1, len(data), data, label)
    _phnum, shnum, shstrndx = extended_counts(r, h)
    sections = read_sections(r, h, shnum, shstrndx)
    cubin = Cubin(data, label, _arch(h), sections, [], {}, digest or hashlib.sha256(data).hexdigest())
    cubin._symbols = _read_symbols(cubin)
    cubin.kernels = _find_kernels(cubin)
    return cubin


def cubin_arch(data: bytes) -> int:
    """The SM a cubin is for (90 for sm_90), from its ELF header; 0 when `data` is not a 64-bit ELF. The one
    decoder of a cubin's SM: the CUPTI collector and `parse_cubin` both read it here."""
    h = sniff_header(data)
    return 0 if h is None or not h.layout.is64 else _arch(h)


def _arch(h: Header) -> int:
    # ELF ABI version <= 7 (CUDA before 12.8): e_flags = virtual SM << 16 | flags | SM; from ABI 8 the SM is in
    # bits 8-15 (sm_80: 0x00500550 from ptxas 12.9, 0x06005004 from ptxas 13.5).
    return h.e_flags & 0xFF if h.abi_version <= _ELFABIVERSION_CUDA_V1 else (h.e_flags >> 8) & 0xFF


def _read_symbols(cubin: Cubin) -> list[_Sym]:
    symtab = next((s for s in cubin.sections if s.type == _SHT_SYMTAB), None)
    if symtab is None:
        return []
    data = cubin.section_data(symtab)
    strtab = cubin.section_data(cubin.sections[symtab.link]) if 0 < symtab.link < len(cubin.sections) else b""
    st = struct.Struct("<IBBHQQ")
    entsize = symtab.entsize or st.size
    if entsize < st.size:
        raise Unreadable(f"{cubin.label}: symbol table entry size {entsize}")
    out = []
    for i in range(len(data) // entsize):
        name_off, info, other, shndx, value, size = st.unpack_from(data, i * entsize)
        end = strtab.find(b"\0", name_off) if name_off < len(strtab) else -1
        name = strtab[name_off:end].decode("utf-8", "replace") if end >= 0 else ""
        out.append(_Sym(name, info, other, shndx, value, size))
    return out


def _find_kernels(cubin: Cubin) -> dict[str, Kernel]:
    out: dict[str, Kernel] = {}
    for i, s in enumerate(cubin._symbols):
        if s.info & 0xF != _STT_FUNC or not s.name or not 0 < s.shndx < min(len(cubin.sections), _SHN_LORESERVE):
            continue  # undefined: a call into another cubin (relocatable device code)
        sec = cubin.sections[s.shndx]
        if sec.name.startswith(".text."):
            entry = bool(s.other & _STO_CUDA_ENTRY)
            out.setdefault(s.name, Kernel(s.name, sec.name, s.size, entry, i, s.shndx, s.value))
    return out


class _Reloc(NamedTuple):
    kernel: str
    base: int  # where the relocation's symbol lies relative to the kernel's start
    addend: int | None  # None for REL: the patched field holds it


class _Seq(NamedTuple):
    kernel: str | None
    rows: list[tuple[int, int, int]]  # (address, file index, line) in program order; last is the end marker
    files: list[str]


class _LineReader:
    """Runs the `.debug_line` programs of one cubin (DWARF 2-4 headers, 32- or 64-bit DWARF)."""

    def __init__(self, cubin: Cubin) -> None:
        self.c = cubin
        self.label = cubin.label

    def read(self) -> CubinLines:
        c = self.c
        idx = next((i for i, s in enumerate(c.sections) if s.name == ".debug_line"), None)
        if idx is None:
            return CubinLines({})
        data = c.section_data(c.sections[idx])
        relocs = self._relocations(idx)
        seqs: list[_Seq] = []
        pos = 0
        try:
            while pos + 4 <= len(data):
                pos = self._unit(data, pos, relocs, seqs)
        except DWARF_ERRORS as e:
            raise Unreadable(f"{self.label}: malformed .debug_line ({e})") from None
        return CubinLines(_tables(seqs))

    def _relocations(self, target: int) -> dict[int, _Reloc]:
        """Relocations against .debug_line, by the offset they patch."""
        c = self.c
        by_section = {k.section_index: k for k in c.kernels.values()}
        out: dict[int, _Reloc] = {}
        for sec in c.sections:
            if sec.type not in (_SHT_REL, _SHT_RELA) or sec.info != target:
                continue
            rela = sec.type == _SHT_RELA
            st = struct.Struct("<QQq" if rela else "<QQ")
            data = c.section_data(sec)
            for i in range(len(data) // st.size):
                f = st.unpack_from(data, i * st.size)
                sym_i = f[1] >> 32
                if not 0 < sym_i < len(c._symbols):
                    continue
                s = c._symbols[sym_i]
                kernel: Kernel | None = None
                if s.info & 0xF == _STT_FUNC:
                    kernel = c.kernels.get(s.name)
                elif s.info & 0xF == _STT_SECTION:
                    kernel = by_section.get(s.shndx)  # a section symbol: the addend is an offset into it
                if kernel is not None:
                    out[f[0]] = _Reloc(kernel.name, s.value - kernel.value, f[2] if rela else None)
        return out

    def _unit(
        self, data: bytes, pos: int, relocs: dict[int, _Reloc], seqs: list[_Seq]
    ) -> int:
        """Run the line program at `pos`; the offset of the next one."""
        prog = parse_line_header(data, pos, "little", max_version=4)
        if prog.end > len(data):
            raise ValueError("line program runs past the section")
        files = [_join(prog.dirs, d, name) for name, d in prog.files]

        def set_address(at: int, size: int) -> tuple[str | None, int]:
            # the relocation of the address field says whose address it is
            return self._relocated(relocs.get(at), int.from_bytes(data[at : at + size], "little"))

        def define_file(name: str, d: int) -> None:
            files.append(_join([], d, name))

        for kernel, rows in run_line_program(data, prog.program, prog.end, prog.header, "little", set_address,
                                             define_file):
            seqs.append(_Seq(kernel, rows, files))
        return prog.end

    @staticmethod
    def _relocated(reloc: _Reloc | None, field: int) -> tuple[str | None, int]:
        if reloc is None:
            return None, field  # not attributable to a kernel
        # REL keeps the addend in the patched field itself; RELA in the relocation.
        return reloc.kernel, reloc.base + (field if reloc.addend is None else reloc.addend)


def _join(dirs: list[str], d: int, name: str) -> str:
    # Joined as stored, without normalizing, which is what nvdisasm -g prints; there is no comp_dir here.
    if name.startswith("/") or not 0 < d <= len(dirs):
        return name
    directory = dirs[d - 1]
    return f"{directory.rstrip('/')}/{name}" if directory else name


def _tables(seqs: list[_Seq]) -> dict[str, list[LineRange]]:
    """Per kernel: the sequences' rows as non-overlapping ranges; at one address the last row wins, as in
    nvdisasm (the rows before it are inlined-at context)."""
    ranges: dict[str, list[LineRange]] = {}
    for seq in seqs:
        if seq.kernel is None:
            log.debug("line sequence without a relocation skipped")
            continue
        out = ranges.setdefault(seq.kernel, [])
        rows = seq.rows
        for i, (addr, fidx, line) in enumerate(rows[:-1]):
            nxt = rows[i + 1][0]
            if nxt <= addr or not line:
                continue  # superseded by a later row at the same address, or no line
            file = seq.files[fidx - 1] if 0 < fidx <= len(seq.files) else ""
            out.append(LineRange(addr, nxt, file, line))
    tables: dict[str, list[LineRange]] = {}
    for kernel, rs in ranges.items():
        rs.sort(key=lambda r: r.start)
        merged: list[LineRange] = []
        for r in rs:
            if merged and merged[-1].end > r.start:
                r = r._replace(start=merged[-1].end)  # overlapping sequences: the first one keeps its range
                if r.start >= r.end:
                    continue
            if merged and merged[-1].end == r.start and merged[-1][2:] == r[2:]:
                merged[-1] = merged[-1]._replace(end=r.end)
            else:
                merged.append(r)
        tables[kernel] = merged
    return tables
