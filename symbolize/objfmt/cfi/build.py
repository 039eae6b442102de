"""Building a table from an ELF file (or raw sections) with either engine: `build_table`, `build_from_sections`,
and `fde_rows` (the reference's rows per FDE, for tests against other CFI readers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Literal, NamedTuple

from aiflame.core.errors import HostError, Unreadable
from aiflame.symbolize.objfmt.cfi import fast
from aiflame.symbolize.objfmt.cfi.parse import _DEBUG, _EH, _SECNAME, _build_py, _fde_signal, _Input, _Parser
from aiflame.symbolize.objfmt.cfi.program import _run
from aiflame.symbolize.objfmt.cfi.table import MAX_ROWS, Rule, UnwindTable
from aiflame.symbolize.objfmt.elf import ElfFile

_EM_X86_64, _ET_REL, _PT_LOAD, _PF_X, _SHT_NOBITS = 62, 1, 1, 1, 8


class FdeRows(NamedTuple):
    """One FDE's rows as the reference interpreter sees them, before any table-wide merging."""

    section: str
    offset: int
    start: int
    end: int
    rows: list[tuple[int, Rule]]  # (location, rule), a new row only where the rule changes


class _Opened:
    """An ElfFile with an fd of our own for code reads; its sections are read on first use of `inp`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.label = label = os.path.basename(os.fsdecode(path))
        self.elf = ElfFile.open(path)
        try:
            self.fd = os.open(self.elf.fd_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            self.elf.close()
            raise Unreadable(f"{label}: {e.strerror or e}") from None
        self._inp: _Input | None = None

    @property
    def inp(self) -> _Input:
        if self._inp is None:
            self._inp = self._input(self.label)
        return self._inp

    def _input(self, label: str) -> _Input:
        elf = self.elf
        if elf.machine != _EM_X86_64 or not elf.is64 or not elf.little_endian:
            raise Unreadable(f"{label}: not an x86-64 ELF file")
        if int.from_bytes(os.pread(self.fd, 2, 16), "little") == _ET_REL:
            raise Unreadable(f"{label}: relocatable object (addresses are not final)")

        def sec(name: str) -> tuple[bytes, int]:
            s = elf.section(name)
            if s is None or s.type == _SHT_NOBITS or not s.size:
                return b"", 0
            return elf.read_section(s), s.addr

        eh, eh_addr = sec(".eh_frame")
        hdr, hdr_addr = sec(".eh_frame_hdr") if eh else (b"", 0)
        dsec = elf.dwarf_section("frame")
        dbg = elf.read_section(dsec) if dsec is not None else b""
        code = tuple((s.vaddr, s.offset, s.filesz) for s in elf.segments if s.type == _PT_LOAD and s.flags & _PF_X)
        return _Input(label, eh, eh_addr, hdr, hdr_addr, dbg, self.fd, code)

    def close(self) -> None:
        os.close(self.fd)
        self.elf.close()

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fde_rows(path: str | os.PathLike[str]) -> Iterator[FdeRows]:
    """Rows of every FDE of .eh_frame (all of them, listed in .eh_frame_hdr or not) and .debug_frame, in
    section order, by the reference interpreter. For tests against other CFI readers."""
    with _Opened(path) as o:
        inp = o.inp  # its errors name the file already; the parser's below get it put in front
        try:
            p = _Parser(inp)
            for sec in (_EH, _DEBUG):
                for off, rec in p.records[sec].items():
                    if rec.is_cie:
                        continue
                    f = p.fde(sec, off, rec)
                    rows: list[tuple[int, Rule]] = []
                    try:
                        _run(p.data[sec], f.prog, f.prog_end, f.cie, rows, f.start, f.end, _fde_signal(inp, f))
                    except Unreadable as e:
                        raise Unreadable(f"{_SECNAME[sec]} FDE at 0x{off:x}: {e}") from None
                    yield FdeRows(_SECNAME[sec], off, f.start, f.end, rows)
        except Unreadable as e:
            raise Unreadable(f"{inp.label}: {e}") from None


Engine = Literal["auto", "c", "python"]


def _build(inp: _Input, engine: Engine) -> UnwindTable:
    lib = None if engine == "python" else fast._fast_lib()
    if lib is None and engine == "c":
        raise HostError(f"{inp.label}: the C engine is unavailable ({fast._fast_state.error})")
    try:
        return _build_py(inp) if lib is None else fast._build_c(lib, inp)
    except Unreadable as e:
        raise Unreadable(f"{inp.label}: {e}") from None


def build_from_sections(label: str, eh_frame: bytes, eh_frame_addr: int, eh_frame_hdr: bytes = b"",
                        eh_frame_hdr_addr: int = 0, debug_frame: bytes = b"", engine: Engine = "auto",
                        max_rows: int = MAX_ROWS) -> UnwindTable:
    """The table of raw section contents (e.g. a vDSO image read from memory, or test input); `label` names
    them in errors. Without the file's code, only CIE augmentation 'S' marks signal frames."""
    return _build(_Input(label, eh_frame, eh_frame_addr, eh_frame_hdr, eh_frame_hdr_addr, debug_frame, -1, (),
                         max_rows), engine)


def build_table(path: str | os.PathLike[str], engine: Engine = "auto") -> UnwindTable:
    """The unwind table of the ELF file at `path`, built now (no cache). `engine`: "c" (cfi_fast.c, compiled
    on first use), "python" (the reference), or "auto" (C when a compiler is there, else Python).
    An x86-64 file without CFI gives an empty table. Raises Unreadable."""
    with _Opened(path) as o:
        return _build(o.inp, engine)


