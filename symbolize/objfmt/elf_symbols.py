"""Function symbols of an ELF file: `.symtab` and `.dynsym` (unpacked with `struct.iter_unpack`, an order of
magnitude faster than pyelftools on binaries with 10^5 symbols), `name@plt` stubs from the PLT relocations, and
sizes for symbols that have none. ElfFile.functions() and function_addresses() are these, cached there."""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf_format import (
    PF_X,
    PT_LOAD,
    SHF_ALLOC,
    SHF_EXECINSTR,
    SHT_DYNSYM,
    SHT_REL,
    SHT_RELA,
    SHT_SYMTAB,
    Section,
)

if TYPE_CHECKING:
    from aiflame.symbolize.objfmt.elf import ElfFile

__all__ = ["Symbol", "function_addresses", "function_symbols"]

_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_STB_GLOBAL, _STB_WEAK = 1, 2
_SHN_UNDEF, _SHN_ABS, _SHN_COMMON = 0, 0xFFF1, 0xFFF2
_NOT_DEFINED = (_SHN_UNDEF, _SHN_ABS, _SHN_COMMON)
_MAX_NAME_OFFSETS = 256  # names at more places in a string table than this: every entry is read instead
_SEARCH_BYTES_PER_ENTRY = 1000  # string-table bytes searched that cost about as much as reading one entry
_EM_386, _EM_ARM, _EM_X86_64, _EM_AARCH64 = 3, 40, 62, 183


class Symbol(NamedTuple):
    """A function symbol: link-time address, size in bytes (size-0 symbols are extended), name as stored."""

    addr: int
    size: int
    name: str


def function_symbols(elf: ElfFile) -> list[Symbol]:
    """Function symbols (STT_FUNC, STT_GNU_IFUNC) of .symtab and .dynsym, plus `name@plt` PLT stubs.

    Sorted by address, one per address (among aliases: sized, global, fewer leading underscores, shorter name
    wins). A symbol of size 0 gets the size up to the next symbol or the end of its executable section. Tables
    lying outside the file are skipped.
    """
    raw: list[tuple[int, int, int, str]] = []  # addr, size, binding rank, name
    for sec in elf.sections:
        if sec.type in (SHT_SYMTAB, SHT_DYNSYM):
            try:
                raw.extend(_read_function_symbols(elf, sec))
            except Unreadable:
                continue
    try:
        raw.extend(_plt_symbols(elf))
    except Unreadable:
        pass
    return _finish(elf, raw)


def function_addresses(elf: ElfFile, names: set[str], together: bool = False) -> dict[str, int]:
    """Link-time address of each of `names` that is a defined function in .symtab or .dynsym.

    Unlike function_symbols(), aliases are kept: every name that is asked for and present is found. .dynsym is
    searched first and .symtab only for names still missing that .dynsym does not import (a name in both has one
    address; an imported name is defined elsewhere): a library's exported calls are found without reading its
    full symbol table, which is time a target stays stopped at its library open. `together`: the names are one
    library's API, so one of them imported means the rest are not here either (a CUDA library that links the
    runtime dynamically holds no static copy of it)."""
    out: dict[str, int] = {}
    imported: set[str] = set()
    tables = sorted((s for s in elf.sections if s.type in (SHT_SYMTAB, SHT_DYNSYM)), key=lambda s: s.type != SHT_DYNSYM)
    for sec in tables:
        wanted = names - out.keys() - imported
        if not wanted or (together and imported):
            break
        try:
            for name, info, shndx, value in _named_entries(elf, sec, wanted):
                if _is_function(info, shndx, value):
                    out.setdefault(name, value)
                elif shndx == _SHN_UNDEF and sec.type == SHT_DYNSYM:
                    imported.add(name)
        except Unreadable:
            continue
    if elf.machine == _EM_ARM:
        out = {n: v & ~1 for n, v in out.items()}  # bit 0 marks Thumb code, not part of the address
    return out


def _is_function(info: int, shndx: int, value: int) -> bool:
    """A defined function (or IFUNC) with an address."""
    kind = info & 0xF
    return (kind == _STT_FUNC or kind == _STT_GNU_IFUNC) and value != 0 and shndx not in _NOT_DEFINED


def _named_entries(elf: ElfFile, sec: Section, names: set[str]) -> Iterator[tuple[str, int, int, int]]:
    """(name, st_info, st_shndx, st_value) of the entries of symbol table `sec` named one of `names`, in table
    order. Found by byte searches where that pays (the entries whose st_name points at one of the names), else by
    reading every entry."""
    entsize = sec.entsize or elf.layout.sym.size
    if entsize < elf.layout.sym.size:
        return
    data = elf.read_section(sec)
    strtab = _strtab_for(elf, sec)
    picked = _entries_named(data, entsize, strtab, names, elf.layout.sym.format[0])
    for name_off, info, shndx, value, _size in _iter_syms(elf, data, entsize, picked):
        end = strtab.find(b"\0", name_off)
        if end <= name_off:
            continue
        name = strtab[name_off:end].decode("utf-8", "replace")
        if name in names:
            yield name, info, shndx, value


def _entries_named(data: bytes, entsize: int, strtab: bytes, names: set[str], order: str) -> list[int] | None:
    """Indexes of the entries of symbol table `data` whose st_name (each entry's first word) points at one of
    `names` in `strtab`, at its own string or at the tail of a longer one (linkers merge string tails). Byte
    searches instead of unpacking every entry (libtorch_cuda has 200k symbols, read while its opener is stopped);
    None when the names lie at too many places for that to pay (each place is a search of the whole table)."""
    if len(names) * len(strtab) > _SEARCH_BYTES_PER_ENTRY * (len(data) // entsize):
        return None  # reading every entry costs less
    offsets: set[int] = set()
    for name in names:
        if not name:
            continue  # no function has an empty name
        key = name.encode("utf-8", "replace") + b"\0"
        at = strtab.find(key)
        while at >= 0:
            offsets.add(at)
            if len(offsets) > _MAX_NAME_OFFSETS:
                return None
            at = strtab.find(key, at + 1)
    hits: list[int] = []
    end = len(data) // entsize * entsize
    for off in offsets:
        pat = struct.pack(order + "I", off)
        at = data.find(pat, 0, end)
        while at >= 0:
            if at % entsize == 0:
                hits.append(at // entsize)
            at = data.find(pat, at + 1, end)
    return sorted(hits)


def _strtab_for(elf: ElfFile, sec: Section) -> bytes:
    if not 0 < sec.link < len(elf.sections):
        return b""
    return elf.read_section(elf.sections[sec.link])


def _iter_syms(elf: ElfFile, data: bytes, entsize: int,
               picked: list[int] | None = None) -> Iterator[tuple[int, int, int, int, int]]:
    """(st_name, st_info, st_shndx, st_value, st_size) of each entry, or of the entries `picked` (indexes)."""
    st = elf.layout.sym
    count = len(data) // entsize
    it: Iterator[tuple[int, ...]]
    if picked is not None:
        it = (st.unpack_from(data, i * entsize) for i in picked)
    elif entsize == st.size:
        it = st.iter_unpack(memoryview(data)[: count * entsize])
    else:
        it = (st.unpack_from(data, i * entsize) for i in range(count))
    if elf.is64:
        for name, info, _other, shndx, value, size in it:
            yield name, info, shndx, value, size
    else:
        for name, value, size, info, _other, shndx in it:
            yield name, info, shndx, value, size


def _read_function_symbols(elf: ElfFile, sec: Section) -> Iterator[tuple[int, int, int, str]]:
    entsize = sec.entsize or elf.layout.sym.size
    if entsize < elf.layout.sym.size:
        return
    data = elf.read_section(sec)
    strtab = _strtab_for(elf, sec)
    thumb = elf.machine == _EM_ARM
    for name_off, info, shndx, value, size in _iter_syms(elf, data, entsize):
        if not _is_function(info, shndx, value):
            continue
        end = strtab.find(b"\0", name_off)
        if end <= name_off:
            continue
        if thumb:
            value &= ~1  # bit 0 marks Thumb code, not part of the address
        bind = info >> 4
        rank = 0 if bind == _STB_GLOBAL else 1 if bind == _STB_WEAK else 2
        yield value, size, rank, strtab[name_off:end].decode("utf-8", "replace")


def _plt_symbols(elf: ElfFile) -> list[tuple[int, int, int, str]]:
    """`name@plt` for each lazy-binding PLT entry: entry i belongs to relocation i of .rela.plt."""
    if elf.machine in (_EM_X86_64, _EM_386):
        header, entry = 16, 16
    elif elf.machine == _EM_AARCH64:
        header, entry = 32, 16
    else:
        return []
    rel = elf.section(".rela.plt") or elf.section(".rel.plt")
    if rel is None or rel.type not in (SHT_RELA, SHT_REL) or not 0 < rel.link < len(elf.sections):
        return []
    dynsym = elf.sections[rel.link]
    rst = elf.layout.rela if rel.type == SHT_RELA else elf.layout.rel
    relocs = elf.read_section(rel)
    if not relocs or dynsym.type != SHT_DYNSYM:
        return []
    count = len(relocs) // rst.size
    plt_sec, plt = elf.section(".plt.sec"), elf.section(".plt")
    if plt_sec is not None and plt_sec.size >= entry * count:
        base = plt_sec.addr  # IBT layout: callers enter through .plt.sec, which has no header
    elif plt is not None and plt.size >= header + entry * count:
        base = plt.addr + header
    else:
        return []
    syms = elf.read_section(dynsym)
    strtab = _strtab_for(elf, dynsym)
    sst = elf.layout.sym
    sym_ent = dynsym.entsize or sst.size
    shift = 32 if elf.is64 else 8
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


def _exec_ranges(elf: ElfFile) -> list[tuple[int, int]]:
    ranges = [
        (s.addr, s.addr + s.size)
        for s in elf.sections
        if s.flags & SHF_EXECINSTR and s.flags & SHF_ALLOC and s.size
    ]
    if not ranges:
        loads = [s for s in elf.segments if s.type == PT_LOAD and s.flags & PF_X]
        ranges = [(s.vaddr, s.vaddr + s.memsz) for s in loads]
    ranges.sort()
    return ranges


def _finish(elf: ElfFile, raw: list[tuple[int, int, int, str]]) -> list[Symbol]:
    def preference(t: tuple[int, int, int, str]) -> tuple[int, int, int, int, int, str]:
        addr, size, rank, name = t
        return addr, size == 0, rank, len(name) - len(name.lstrip("_")), len(name), name

    raw.sort(key=preference)
    uniq: list[tuple[int, int, int, str]] = []
    for t in raw:
        if not uniq or uniq[-1][0] != t[0]:
            uniq.append(t)
    ranges = _exec_ranges(elf)
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
