"""Compact unwind tables for BPF, compiled from the DWARF CFI (.eh_frame, .debug_frame) of x86-64 ELF files.

A table is a sorted list of 8-byte rows `<IHH>` (u32 pc, u16 rule index, u16 spare = 0) into a short list of
distinct 12-byte rules `<BBxxii>` (cfa_type, rbp_type, s32 cfa_off, s32 rbp_off); rule 0 is always
"not covered". A row holds from its pc up to the next row's pc; every FDE whose end is not the start of the
next one is followed by a not-covered row, so a PC past an FDE (or before the first row) is not covered.
Only the CFA, RBP (DWARF register 6) and RA (16) are tracked: anything a BPF unwinder cannot follow with
"CFA = base + off, RA at CFA-8, RBP saved at CFA+off" becomes an explicit INVALID, END or SIGNAL rule.

Two engines build the same table: the pure-Python reference below, and `cfi_fast.c` (the same algorithm,
compiled on first use into the cache directory and called through ctypes), because on libtorch_cpu.so
(335k FDEs, 2.6 M rows) the reference takes ~10 s and 270 MB where the C engine takes ~0.4 s and ~110 MB.
Tests hold the two to identical rows, rules, stats and error messages.
`load_or_build` keeps built tables on disk, keyed by build id, and validates them when read back.

Every malformed-input path raises `CfiError` with one line naming the file, the section and the offset.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import json
import logging
import os
import stat
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

from aiflame.core.safe_files import FileRefused, read_regular, trusted_dir
from aiflame.symbolize.cache import default_cache_dir
from aiflame.symbolize.errors import SymbolizeError
from aiflame.symbolize.objfmt.elf import ElfFile

__all__ = [
    "CFA_DEREF_RBP", "CFA_END", "CFA_INVALID", "CFA_KINDS", "CFA_NONE", "CFA_PLT", "CFA_PLT10", "CFA_RBP",
    "CFA_RSP", "CFA_SIGNAL", "MAX_ROWS", "NOT_COVERED", "RBP_INVALID", "RBP_KINDS", "RBP_OFFSET",
    "RBP_UNCHANGED", "ROW", "RULE", "CfiError", "CfiStats", "FdeRows", "Rule", "UnwindTable",
    "build_from_sections", "build_table", "cache_path", "decode_table", "encode_table", "fde_rows", "load_or_build",
]

log = logging.getLogger(__name__)

# --- the layout BPF reads ---------------------------------------------------------------------------------

# cfa_type, and what cfa_off means for it:
#   NONE      not covered: no FDE here (a gap, or past the end of an FDE)
#   RSP, RBP  CFA = rsp + cfa_off, rbp + cfa_off; the return address is at CFA - 8
#   PLT       lazy PLT entry: CFA = rsp + 8 + ((rip & 15) >= 11 ? 8 : 0)   (cfa_off = 8)
#   PLT10     the same with >= 10                                            (cfa_off = 8)
#   DEREF_RBP stack realignment: CFA = *(rbp + cfa_off), from DW_OP_breg6 N; DW_OP_deref
#   END       the return address is undefined: the outermost frame (_start, a clone child)
#   INVALID   anything else: another expression, CFA in another register, RA not at CFA - 8
#   SIGNAL    a signal frame (CIE augmentation 'S', or the rt_sigreturn trampoline): registers are in the
#             ucontext on the stack
# rbp_type: UNCHANGED (rbp still holds the caller's: same value, never saved), OFFSET (saved at
# CFA + rbp_off), INVALID (an expression or register rule). END, INVALID and SIGNAL rules carry no offsets
# and rbp UNCHANGED, so that they dedupe to one rule each.
CFA_NONE, CFA_RSP, CFA_RBP, CFA_PLT, CFA_PLT10, CFA_DEREF_RBP, CFA_END, CFA_INVALID, CFA_SIGNAL = range(9)
CFA_KINDS = ("none", "rsp", "rbp", "plt", "plt10", "deref_rbp", "end", "invalid", "signal")
RBP_UNCHANGED, RBP_OFFSET, RBP_INVALID = range(3)
RBP_KINDS = ("unchanged", "offset", "invalid")

ROW = struct.Struct("<IHH")  # pc, rule index, spare (0)
RULE = struct.Struct("<BBxxii")  # cfa_type, rbp_type, cfa_off, rbp_off

MAX_ROWS = 8 << 20  # far above libtorch_cpu.so's 2.6 M; a bigger table would not fit the BPF maps anyway
MAX_RULES = 1 << 16  # the row's u16 index
MAX_STATE_DEPTH = 64  # DW_CFA_remember_state nesting; compilers use 1 or 2
_MAX_PC = 0xFFFFFFFF  # rows hold u32 addresses
_S32_MIN, _S32_MAX = -(1 << 31), (1 << 31) - 1
_U64 = (1 << 64) - 1


class CfiError(SymbolizeError):
    """The CFI of a file cannot be turned into a table; the message is one line naming the file and why."""


class Rule(NamedTuple):
    """How to find the caller's frame over one PC range. Offsets are zero when the kind carries none."""

    cfa_type: int
    rbp_type: int
    cfa_off: int
    rbp_off: int


NOT_COVERED = Rule(CFA_NONE, RBP_UNCHANGED, 0, 0)
_END = Rule(CFA_END, RBP_UNCHANGED, 0, 0)
_INVALID = Rule(CFA_INVALID, RBP_UNCHANGED, 0, 0)
_SIGNAL = Rule(CFA_SIGNAL, RBP_UNCHANGED, 0, 0)


@dataclass(frozen=True)
class CfiStats:
    """What went into a table. Kind counts are over the final rows, indexed by CFA_* / RBP_* values."""

    source: str  # "eh_frame_hdr" or "eh_frame" (walked), "+debug_frame" when that added FDEs; "" if none
    fdes: int  # FDEs found (distinct)
    fdes_used: int  # non-empty and not overlapping an earlier one
    fdes_overlapping: int  # dropped: starts inside an FDE already taken (.eh_frame wins over .debug_frame)
    rows_raw: int  # rows of the CFA programs, one per location, before dropping repeats
    rows: int  # packed rows, gap markers included
    rules: int
    covered_bytes: int  # text bytes inside used FDEs
    cfa_kinds: tuple[int, ...]
    rbp_kinds: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        """A plain dict (for the cache file and the bench)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, doc: object) -> CfiStats:
        """Inverse of to_json; ValueError on anything malformed."""
        if not isinstance(doc, dict) or set(doc) != set(cls.__dataclass_fields__):
            raise ValueError("stats fields")
        ints = [k for k in doc if k not in ("source", "cfa_kinds", "rbp_kinds")]
        if not isinstance(doc["source"], str) or not all(type(doc[k]) is int and doc[k] >= 0 for k in ints):
            raise ValueError("stats values")
        kinds = {}
        for k, n in (("cfa_kinds", len(CFA_KINDS)), ("rbp_kinds", len(RBP_KINDS))):
            v = doc[k]
            if not isinstance(v, list) or len(v) != n or not all(type(x) is int and x >= 0 for x in v):
                raise ValueError(k)
            kinds[k] = tuple(v)
        return cls(**{**doc, **kinds})


class UnwindTable:
    """Packed rows and the rules they index; see the module docstring for the layout."""

    def __init__(self, rows: bytes, rules: tuple[Rule, ...], stats: CfiStats) -> None:
        self.rows = rows
        self.rules = rules
        self.stats = stats
        self._pcs: memoryview | None = None

    def __len__(self) -> int:
        return len(self.rows) // ROW.size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UnwindTable):
            return NotImplemented
        return (self.rows, self.rules, self.stats) == (other.rows, other.rules, other.stats)

    __hash__ = None  # type: ignore[assignment]  # mutable cache of pcs; equality by value

    def rules_bytes(self) -> bytes:
        """The rules packed as `RULE`, in index order (what goes into the BPF rule array)."""
        return b"".join(RULE.pack(*r) for r in self.rules)

    def iter_rows(self) -> Iterator[tuple[int, Rule]]:
        """(pc, rule) of each row."""
        for pc, idx, _spare in ROW.iter_unpack(self.rows):
            yield pc, self.rules[idx]

    def lookup(self, pc: int) -> Rule:
        """The rule at link-time address `pc`; NOT_COVERED outside every FDE."""
        if self._pcs is None:
            self._pcs = memoryview(self.rows).cast("I")[::2]
        i = bisect.bisect_right(self._pcs, pc) - 1
        if i < 0:
            return NOT_COVERED
        idx: int = ROW.unpack_from(self.rows, i * ROW.size)[1]
        return self.rules[idx]


# --- reading primitives -----------------------------------------------------------------------------------


class _Bad(Exception):
    """Raised deep in the parser; turned into CfiError with the file name at the top."""


def _uleb(d: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise _Bad(f"truncated LEB128 at 0x{pos:x}")
        if shift >= 70:
            raise _Bad(f"LEB128 longer than 10 bytes at 0x{pos:x}")
        b = d[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return result & _U64, pos


def _sleb(d: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise _Bad(f"truncated LEB128 at 0x{pos:x}")
        if shift >= 70:
            raise _Bad(f"LEB128 longer than 10 bytes at 0x{pos:x}")
        b = d[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if shift < 64 and b & 0x40:
                result |= _U64 << shift
            result &= _U64
            return result - (1 << 64) if result >> 63 else result, pos


def _fixed(d: bytes, pos: int, end: int, n: int, signed: bool) -> tuple[int, int]:
    if pos + n > end:
        raise _Bad(f"truncated value at 0x{pos:x}")
    return int.from_bytes(d[pos : pos + n], "little", signed=signed), pos + n


# DW_EH_PE value formats: (size, signed); size 0 means LEB128.
_PE_FORMATS = {0x00: (8, False), 0x01: (0, False), 0x02: (2, False), 0x03: (4, False), 0x04: (8, False),
               0x09: (0, True), 0x0A: (2, True), 0x0B: (4, True), 0x0C: (8, True)}
_PE_OMIT, _PE_PCREL, _PE_DATAREL, _PE_INDIRECT = 0xFF, 0x10, 0x30, 0x80


def _encoded(d: bytes, pos: int, end: int, enc: int, pc_base: int, data_base: int | None,
             allow_indirect: bool) -> tuple[int, int]:
    """A DW_EH_PE-encoded pointer at `pos`. `pc_base` is the address of d[0]; datarel needs `data_base`."""
    fmt = _PE_FORMATS.get(enc & 0x0F)
    app = enc & 0x70
    if fmt is None:
        raise _Bad(f"unsupported pointer encoding 0x{enc:02x}")
    if enc & _PE_INDIRECT and not allow_indirect:
        raise _Bad(f"indirect pointer encoding 0x{enc:02x} where an address is needed")
    start = pos
    size, signed = fmt
    if size:
        v, pos = _fixed(d, pos, end, size, signed)
    else:
        v, pos = (_sleb if signed else _uleb)(d, pos, end)
    if app == _PE_PCREL:
        v += pc_base + start
    elif app == _PE_DATAREL and data_base is not None:
        v += data_base
    elif app:
        raise _Bad(f"unsupported pointer encoding 0x{enc:02x}")
    return v & _U64, pos


# --- what a file gives us ---------------------------------------------------------------------------------


class _Input(NamedTuple):
    """The sections one build needs, read from the ELF file."""

    label: str
    eh: bytes
    eh_addr: int
    hdr: bytes
    hdr_addr: int
    dbg: bytes
    fd: int  # for the 10 bytes of code that tell a signal trampoline; -1 when closed
    code: tuple[tuple[int, int, int], ...]  # executable PT_LOAD (vaddr, file offset, filesz)
    max_rows: int = MAX_ROWS


_EM_X86_64, _ET_REL, _PT_LOAD, _PF_X, _SHT_NOBITS = 62, 1, 1, 1, 8


# --- records ----------------------------------------------------------------------------------------------

_EH, _DEBUG = 0, 1
_SECNAME = (".eh_frame", ".debug_frame")


class _Record(NamedTuple):
    is_cie: bool
    ident: int  # CIE id, or the FDE's CIE pointer as stored
    id_pos: int
    body: int  # first byte after the id
    end: int


def _walk(d: bytes, sec: int) -> dict[int, _Record]:
    """Every record of the section by offset; zero terminators are skipped (readelf does the same)."""
    out: dict[int, _Record] = {}
    pos, n = 0, len(d)
    name = _SECNAME[sec]
    while pos < n:
        if pos + 4 > n:
            if not any(d[pos:]):
                break  # zero padding after the last record
            raise _Bad(f"{name}: truncated record at 0x{pos:x}")
        length = int.from_bytes(d[pos : pos + 4], "little")
        if length == 0:
            pos += 4
            continue
        idsize, head = 4, 4
        if length == 0xFFFFFFFF:
            if pos + 12 > n:
                raise _Bad(f"{name}: truncated record at 0x{pos:x}")
            length = int.from_bytes(d[pos + 4 : pos + 12], "little")
            idsize, head = 8, 12
        elif length >= 0xFFFFFFF0:
            raise _Bad(f"{name}: reserved length 0x{length:x} at 0x{pos:x}")
        end = pos + head + length
        if end > n or length < idsize:
            raise _Bad(f"{name}: record at 0x{pos:x} runs past the end of the section")
        id_pos = pos + head
        ident = int.from_bytes(d[id_pos : id_pos + idsize], "little")
        is_cie = ident == 0 if sec == _EH else ident == (1 << (8 * idsize)) - 1
        out[pos] = _Record(is_cie, ident, id_pos, id_pos + idsize, end)
        pos = end
    return out


def _printable(b: bytes) -> str:
    s = "".join(chr(c) if 0x20 <= c < 0x7F else "?" for c in b[:16])
    return s + "..." if len(b) > 16 else s


class _Cie(NamedTuple):
    caf: int
    daf: int
    fde_enc: int
    has_z: bool
    signal: bool
    state: _State  # after the initial instructions


class _Fde(NamedTuple):
    start: int
    end: int
    sec: int
    offset: int
    prog: int  # first instruction byte
    prog_end: int
    cie: _Cie


class _State(NamedTuple):
    """The tracked part of a CFI row. Register rule kinds: 0 undefined/unset, 1 same value, 2 saved at
    CFA+off, 3 anything else. Offsets are exact; cfa_reg -1 means no CFA rule yet."""

    cfa_reg: int
    cfa_off: int
    cfa_expr: bytes | None
    rbp_kind: int
    rbp_off: int
    ra_kind: int
    ra_off: int


_R_UNDEF, _R_SAME, _R_OFFSET, _R_OTHER = range(4)
_NO_STATE = _State(-1, 0, None, _R_UNDEF, 0, _R_UNDEF, 0)
_REG_RBP, _REG_RSP, _REG_RA = 6, 7, 16


class _Parser:
    """Records of both sections, CIEs parsed once each.

    Both sections are walked record by record even when .eh_frame_hdr lists the FDEs: a table entry or CIE
    pointer must then land on a record start, so hostile pointers cannot make records overlap and the work
    stays linear in the section size."""

    def __init__(self, inp: _Input) -> None:
        self.inp = inp
        self.data = (inp.eh, inp.dbg)
        self.records = (_walk(inp.eh, _EH), {} if not inp.dbg else _walk(inp.dbg, _DEBUG))
        self.cies: dict[tuple[int, int], _Cie] = {}

    def cie(self, sec: int, off: int, fde_off: int) -> _Cie:
        key = (sec, off)
        cie = self.cies.get(key)
        if cie is None:
            rec = self.records[sec].get(off)
            if rec is None or not rec.is_cie:
                raise _Bad(f"{_SECNAME[sec]} FDE at 0x{fde_off:x}: CIE pointer 0x{off:x} is not a CIE")
            cie = self.cies[key] = self._parse_cie(sec, off, rec)
        return cie

    def _parse_cie(self, sec: int, off: int, rec: _Record) -> _Cie:
        d, end = self.data[sec], rec.end
        where = f"{_SECNAME[sec]} CIE at 0x{off:x}"
        pos = rec.body
        try:
            if pos >= end:
                raise _Bad("truncated")
            version = d[pos]
            pos += 1
            if version not in (1, 3, 4):
                raise _Bad(f"unsupported version {version}")
            nul = d.find(b"\0", pos, end)
            if nul < 0:
                raise _Bad("unterminated augmentation string")
            aug = d[pos:nul]
            pos = nul + 1
            if version == 4:
                if pos + 2 > end:
                    raise _Bad("truncated")
                if d[pos] != 8 or d[pos + 1] != 0:
                    raise _Bad(f"address size {d[pos]}, segment size {d[pos + 1]}")
                pos += 2
            caf, pos = _uleb(d, pos, end)
            daf, pos = _sleb(d, pos, end)
            if version == 1:
                ra, pos = _fixed(d, pos, end, 1, False)
            else:
                ra, pos = _uleb(d, pos, end)
            if ra != _REG_RA:
                raise _Bad(f"return address column {ra} is not 16 (rip)")
            fde_enc, signal, has_z = 0, False, aug[:1] == b"z"
            if has_z:
                alen, pos = _uleb(d, pos, end)
                aend = pos + alen
                if aend > end:
                    raise _Bad("augmentation data runs past the end")
                for ch in aug[1:]:
                    if ch == 0x52:  # R: FDE pointer encoding
                        fde_enc, pos = _fixed(d, pos, aend, 1, False)
                    elif ch == 0x50:  # P: personality routine; only its size matters
                        penc, pos = _fixed(d, pos, aend, 1, False)
                        _, pos = _encoded(d, pos, aend, penc, 0, 0, True)
                    elif ch == 0x4C:  # L: LSDA encoding
                        _, pos = _fixed(d, pos, aend, 1, False)
                    elif ch == 0x53:  # S: signal frame
                        signal = True
                    elif ch not in (0x42, 0x47):  # B, G: AArch64 markers without data
                        break  # unknown: 'z' says how long the data is, so skip the rest
                pos = aend
            else:
                for ch in aug:  # without 'z' only letters that carry no data can be skipped
                    if ch == 0x53:
                        signal = True
                    elif ch not in (0x42, 0x47):
                        raise _Bad(f'unsupported augmentation "{_printable(aug)}"')
            proto = _Cie(caf, daf, fde_enc, has_z, signal, _NO_STATE)
            state, _ = _run(d, pos, end, proto, None)
        except _Bad as e:
            raise _Bad(f"{where}: {e}") from None
        return proto._replace(state=state)

    def fde(self, sec: int, off: int, rec: _Record) -> _Fde:
        d, end = self.data[sec], rec.end
        if sec == _EH:
            cie_off = rec.id_pos - rec.ident
            if cie_off < 0:
                raise _Bad(f".eh_frame FDE at 0x{off:x}: CIE pointer 0x{rec.ident:x} points before the section")
        else:
            cie_off = rec.ident
        cie = self.cie(sec, cie_off, off)
        try:
            pos = rec.body
            if sec == _EH:
                start, pos = _encoded(d, pos, end, cie.fde_enc, self.inp.eh_addr, None, False)
                length, pos = _encoded(d, pos, end, cie.fde_enc & 0x0F, 0, None, False)
            else:
                start, pos = _fixed(d, pos, end, 8, False)
                length, pos = _fixed(d, pos, end, 8, False)
            if cie.has_z:
                alen, pos = _uleb(d, pos, end)
                pos += alen
                if pos > end:
                    raise _Bad("augmentation data runs past the end")
            if start + length > _U64:
                raise _Bad(f"range 0x{start:x}+0x{length:x} wraps around")
        except _Bad as e:
            raise _Bad(f"{_SECNAME[sec]} FDE at 0x{off:x}: {e}") from None
        return _Fde(start, start + length, sec, off, pos, end, cie)


def _hdr_entries(inp: _Input) -> list[tuple[int, int]] | None:
    """(initial location, FDE address) pairs of .eh_frame_hdr; None when there is no usable table."""
    d = inp.hdr
    if len(d) < 4 or d[0] != 1:
        return None
    ptr_enc, count_enc, table_enc = d[1], d[2], d[3]
    try:
        eh_ptr, pos = _encoded(d, 4, len(d), ptr_enc, inp.hdr_addr, inp.hdr_addr, False)
        if eh_ptr != inp.eh_addr:
            raise _Bad(f"points at 0x{eh_ptr:x}, not at .eh_frame (0x{inp.eh_addr:x})")
        if count_enc == _PE_OMIT or table_enc == _PE_OMIT:
            return None
        count, pos = _encoded(d, pos, len(d), count_enc, inp.hdr_addr, inp.hdr_addr, False)
        fmt = _PE_FORMATS.get(table_enc & 0x0F)
        if fmt is None or fmt[0] == 0:
            raise _Bad(f"unsupported table encoding 0x{table_enc:02x}")
        if count * 2 * fmt[0] > len(d) - pos:
            raise _Bad(f"claims {count} FDEs, more than it holds")
        if table_enc == 0x3B:  # datarel sdata4: what every linker writes
            base = inp.hdr_addr
            raw = memoryview(d)[pos : pos + 8 * count].cast("i")
            return [((raw[2 * i] + base) & _U64, (raw[2 * i + 1] + base) & _U64) for i in range(count)]
        out = []
        for _ in range(count):
            loc, pos = _encoded(d, pos, len(d), table_enc, inp.hdr_addr, inp.hdr_addr, False)
            fde, pos = _encoded(d, pos, len(d), table_enc, inp.hdr_addr, inp.hdr_addr, False)
            out.append((loc, fde))
        return out
    except _Bad as e:
        raise _Bad(f".eh_frame_hdr: {e}") from None


def _collect(p: _Parser) -> tuple[list[_Fde], str]:
    """Every distinct FDE: those .eh_frame_hdr lists (else all of .eh_frame), then those of .debug_frame.
    The table is what the runtime unwinders search, so an FDE it leaves out is dead to them too."""
    inp = p.inp
    eh_recs = p.records[_EH]
    fdes: list[_Fde] = []
    source = ""
    entries = _hdr_entries(inp) if inp.eh else None
    if entries is not None:
        source = "eh_frame_hdr"
        seen: set[int] = set()
        for i, (loc, addr) in enumerate(entries):
            off = addr - inp.eh_addr
            rec = eh_recs.get(off)
            if rec is None or rec.is_cie:
                raise _Bad(f".eh_frame_hdr: entry {i} points at 0x{addr:x}, not at an FDE")
            if off in seen:
                continue
            seen.add(off)
            f = p.fde(_EH, off, rec)
            if f.start != loc:
                raise _Bad(f".eh_frame_hdr: entry {i} says 0x{loc:x}, its FDE at 0x{off:x} says 0x{f.start:x}")
            fdes.append(f)
    elif inp.eh:
        source = "eh_frame"
        fdes.extend(p.fde(_EH, off, rec) for off, rec in eh_recs.items() if not rec.is_cie)
    n_eh = len(fdes)
    fdes.extend(p.fde(_DEBUG, off, rec) for off, rec in p.records[_DEBUG].items() if not rec.is_cie)
    if len(fdes) > n_eh:
        source += "+debug_frame"
    return fdes, source


def _select(fdes: list[_Fde]) -> tuple[list[_Fde], int]:
    """Non-empty FDEs sorted by start, none overlapping: .eh_frame first (by start, then offset), then the
    .debug_frame FDEs that overlap nothing taken. Returns (taken, number dropped for overlapping)."""
    overlapping = 0
    taken: list[_Fde] = []
    for sec in (_EH, _DEBUG):
        cand = sorted((f for f in fdes if f.sec == sec and f.end > f.start), key=lambda f: (f.start, f.offset))
        if sec == _EH:
            for f in cand:
                if taken and f.start < taken[-1].end:
                    overlapping += 1
                else:
                    taken.append(f)
            continue
        starts = [f.start for f in taken]
        extra: list[_Fde] = []
        for f in cand:
            i = bisect.bisect_right(starts, f.start)
            hit = (i > 0 and taken[i - 1].end > f.start) or (i < len(taken) and taken[i].start < f.end)
            if hit or (extra and f.start < extra[-1].end):
                overlapping += 1
            else:
                extra.append(f)
        if extra:
            taken = sorted(taken + extra, key=lambda f: f.start)
    return taken, overlapping


# --- the CFA program --------------------------------------------------------------------------------------

_PLT_EXPR = {
    # DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_lit11|lit10; DW_OP_ge; DW_OP_lit3;
    # DW_OP_shl; DW_OP_plus: CFA = rsp + 8 + ((rip & 15) >= 11|10) * 8, the linker's lazy PLT entry.
    bytes.fromhex("7708800" "03f1a3b2a332422"): Rule(CFA_PLT, RBP_UNCHANGED, 8, 0),
    bytes.fromhex("7708800" "03f1a3a2a332422"): Rule(CFA_PLT10, RBP_UNCHANGED, 8, 0),
}
_OP_BREG6, _OP_DEREF = 0x76, 0x06


def _classify_expr(e: bytes) -> tuple[int, int]:
    """(cfa_type, cfa_off) of a DW_CFA_def_cfa_expression."""
    plt = _PLT_EXPR.get(e)
    if plt is not None:
        return plt.cfa_type, plt.cfa_off
    if len(e) >= 3 and e[0] == _OP_BREG6 and e[-1] == _OP_DEREF:
        # DW_OP_breg6 N; DW_OP_deref: a stack-realigning prologue saved the CFA at rbp+N.
        try:
            off, pos = _sleb(e, 1, len(e) - 1)
        except _Bad:
            return CFA_INVALID, 0
        if pos == len(e) - 1:
            return CFA_DEREF_RBP, off
    return CFA_INVALID, 0


def _rule(s: _State, signal: bool) -> Rule:
    """The table rule of a CFI row (the mapping documented on the CFA_* and RBP_* kinds)."""
    if signal:
        return _SIGNAL
    if s.ra_kind == _R_UNDEF:
        return _END
    if s.ra_kind != _R_OFFSET or s.ra_off != -8:
        return _INVALID
    if s.cfa_expr is not None:
        cfa_type, cfa_off = _classify_expr(s.cfa_expr)
    elif s.cfa_reg == _REG_RSP:
        cfa_type, cfa_off = CFA_RSP, s.cfa_off
    elif s.cfa_reg == _REG_RBP:
        cfa_type, cfa_off = CFA_RBP, s.cfa_off
    else:
        return _INVALID
    if cfa_type == CFA_INVALID or not _S32_MIN <= cfa_off <= _S32_MAX:
        return _INVALID
    if s.rbp_kind == _R_UNDEF or s.rbp_kind == _R_SAME:
        return Rule(cfa_type, RBP_UNCHANGED, cfa_off, 0)
    if s.rbp_kind == _R_OFFSET and _S32_MIN <= s.rbp_off <= _S32_MAX:
        return Rule(cfa_type, RBP_OFFSET, cfa_off, s.rbp_off)
    return Rule(cfa_type, RBP_INVALID, cfa_off, 0)


def _run(d: bytes, pos: int, end: int, cie: _Cie, rows: list[tuple[int, Rule]] | None, start: int = 0,
         stop: int = 0, signal: bool = False) -> tuple[_State, int]:
    """Interpret the instructions d[pos:end]: a CIE's when `rows` is None, else an FDE's, appending
    (location, rule) whenever the location advances and the rule changed. Locations run from `start` to
    `stop` (exclusive); advancing past `stop` is an error. Returns the final state and the number of
    locations visited below `stop` (the rows before dropping repeats)."""
    fde = rows is not None
    base = cie.state if fde else _NO_STATE
    cfa_reg, cfa_off, cfa_expr = base.cfa_reg, base.cfa_off, base.cfa_expr
    rbp_k, rbp_off, ra_k, ra_off = base.rbp_kind, base.rbp_off, base.ra_kind, base.ra_off
    init = cie.state
    caf, daf = cie.caf, cie.daf
    stack: list[_State] = []
    loc = start
    last: Rule | None = None
    visited = 0

    def advance(new: int) -> None:
        nonlocal loc, last, visited
        if not fde:
            raise _Bad("advance in CIE initial instructions")
        if new > stop or new < loc:
            raise _Bad(f"advance leaves the FDE range 0x{start:x}..0x{stop:x}")
        if new == loc:
            return
        assert rows is not None
        r = _rule(_State(cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off), signal)
        if r != last:
            rows.append((loc, r))
            last = r
        visited += 1
        loc = new

    def set_reg(reg: int, kind: int, off: int) -> None:
        nonlocal rbp_k, rbp_off, ra_k, ra_off
        if reg == _REG_RBP:
            rbp_k, rbp_off = kind, off
        elif reg == _REG_RA:
            ra_k, ra_off = kind, off

    while pos < end:
        op = d[pos]
        pos += 1
        hi = op & 0xC0
        if hi == 0x40:  # advance_loc
            advance(loc + (op & 0x3F) * caf)
        elif hi == 0x80:  # offset
            v, pos = _uleb(d, pos, end)
            set_reg(op & 0x3F, _R_OFFSET, v * daf)
        elif hi == 0xC0:  # restore
            reg = op & 0x3F
            if reg == _REG_RBP:
                rbp_k, rbp_off = init.rbp_kind, init.rbp_off
            elif reg == _REG_RA:
                ra_k, ra_off = init.ra_kind, init.ra_off
        elif op == 0x0E:  # def_cfa_offset
            cfa_off, pos = _uleb(d, pos, end)
        elif op == 0x00:  # nop
            pass
        elif op == 0x0A:  # remember_state
            if len(stack) >= MAX_STATE_DEPTH:
                raise _Bad(f"remember_state nested deeper than {MAX_STATE_DEPTH}")
            stack.append(_State(cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off))
        elif op == 0x0B:  # restore_state
            if not stack:
                raise _Bad("restore_state without remember_state")
            cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off = stack.pop()
        elif op == 0x02:  # advance_loc1
            v, pos = _fixed(d, pos, end, 1, False)
            advance(loc + v * caf)
        elif op == 0x03:  # advance_loc2
            v, pos = _fixed(d, pos, end, 2, False)
            advance(loc + v * caf)
        elif op == 0x04:  # advance_loc4
            v, pos = _fixed(d, pos, end, 4, False)
            advance(loc + v * caf)
        elif op == 0x0C:  # def_cfa
            cfa_reg, pos = _uleb(d, pos, end)
            cfa_off, pos = _uleb(d, pos, end)
            cfa_expr = None
        elif op == 0x0D:  # def_cfa_register
            cfa_reg, pos = _uleb(d, pos, end)
            cfa_expr = None
        elif op == 0x12:  # def_cfa_sf
            cfa_reg, pos = _uleb(d, pos, end)
            v, pos = _sleb(d, pos, end)
            cfa_off, cfa_expr = v * daf, None
        elif op == 0x13:  # def_cfa_offset_sf
            v, pos = _sleb(d, pos, end)
            cfa_off = v * daf
        elif op == 0x0F:  # def_cfa_expression
            n, pos = _uleb(d, pos, end)
            if pos + n > end:
                raise _Bad(f"expression runs past the end at 0x{pos:x}")
            cfa_expr, pos = d[pos : pos + n], pos + n
        elif op == 0x10 or op == 0x16:  # expression, val_expression
            reg, pos = _uleb(d, pos, end)
            n, pos = _uleb(d, pos, end)
            if pos + n > end:
                raise _Bad(f"expression runs past the end at 0x{pos:x}")
            pos += n
            set_reg(reg, _R_OTHER, 0)
        elif op == 0x05 or op == 0x11 or op == 0x2F:  # offset_extended, _sf, GNU_negative_offset_extended
            reg, pos = _uleb(d, pos, end)
            if op == 0x11:
                v, pos = _sleb(d, pos, end)
            else:
                v, pos = _uleb(d, pos, end)
                if op == 0x2F:
                    v = -v
            set_reg(reg, _R_OFFSET, v * daf)
        elif op == 0x14 or op == 0x15:  # val_offset, val_offset_sf
            reg, pos = _uleb(d, pos, end)
            _, pos = (_uleb if op == 0x14 else _sleb)(d, pos, end)
            set_reg(reg, _R_OTHER, 0)
        elif op == 0x06:  # restore_extended
            reg, pos = _uleb(d, pos, end)
            if reg == _REG_RBP:
                rbp_k, rbp_off = init.rbp_kind, init.rbp_off
            elif reg == _REG_RA:
                ra_k, ra_off = init.ra_kind, init.ra_off
        elif op == 0x07:  # undefined
            reg, pos = _uleb(d, pos, end)
            set_reg(reg, _R_UNDEF, 0)
        elif op == 0x08:  # same_value
            reg, pos = _uleb(d, pos, end)
            set_reg(reg, _R_SAME, 0)
        elif op == 0x09:  # register
            reg, pos = _uleb(d, pos, end)
            _, pos = _uleb(d, pos, end)
            set_reg(reg, _R_OTHER, 0)
        elif op == 0x2E:  # GNU_args_size: only for landing pads
            _, pos = _uleb(d, pos, end)
        elif op == 0x01:  # set_loc
            v, pos = _encoded(d, pos, end, cie.fde_enc, 0, None, False)
            if cie.fde_enc & 0x70 == _PE_PCREL:
                raise _Bad("pc-relative DW_CFA_set_loc")
            advance(v)
        elif op == 0x1D:  # MIPS_advance_loc8
            v, pos = _fixed(d, pos, end, 8, False)
            advance(loc + v * caf)
        elif op == 0x2D:  # GNU_window_save: SPARC/AArch64 only, no operands
            pass
        else:
            raise _Bad(f"unknown CFA instruction 0x{op:02x} at 0x{pos - 1:x}")
    if rows is not None and loc < stop:
        r = _rule(_State(cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off), signal)
        if r != last:
            rows.append((loc, r))
        visited += 1
    return _State(cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off), visited


# --- the table --------------------------------------------------------------------------------------------

_TRAMPOLINE = bytes.fromhex("48c7c00f000000" "0f05")  # mov $15,%rax; syscall: rt_sigreturn


def _is_trampoline(inp: _Input, start: int, end: int) -> bool:
    """Whether a 9-16 byte FDE is a sigreturn trampoline (glibc starts its FDE one nop early)."""
    if not 9 <= end - start <= 16 or inp.fd < 0:
        return False
    for vaddr, off, size in inp.code:
        if vaddr <= start and start + 10 <= vaddr + size:
            try:
                code = os.pread(inp.fd, 10, off + start - vaddr)
            except OSError:
                return False
            return code.startswith(_TRAMPOLINE) or code[1:].startswith(_TRAMPOLINE)
    return False


def _fde_signal(inp: _Input, f: _Fde) -> bool:
    return f.cie.signal or _is_trampoline(inp, f.start, f.end)


def _build_py(inp: _Input) -> UnwindTable:
    """The reference engine: parse, select and interpret the FDEs, then pack the rows."""
    p = _Parser(inp)
    fdes, source = _collect(p)
    taken, overlapping = _select(fdes)
    index = {NOT_COVERED: 0}
    rules = [NOT_COVERED]
    cfa_kinds = [0] * len(CFA_KINDS)
    rbp_kinds = [0] * len(RBP_KINDS)
    out = bytearray()
    rows_raw = covered = 0
    last = -1

    def emit(pc: int, idx: int) -> None:
        nonlocal last
        if len(out) >= inp.max_rows * ROW.size:
            raise _Bad(f"more than {inp.max_rows} rows")
        out.extend(ROW.pack(pc, idx, 0))
        r = rules[idx]
        cfa_kinds[r.cfa_type] += 1
        rbp_kinds[r.rbp_type] += 1
        last = idx

    for i, f in enumerate(taken):
        where = f"{_SECNAME[f.sec]} FDE at 0x{f.offset:x}"
        if f.end > _MAX_PC:
            raise _Bad(f"{where} covers 0x{f.start:x}..0x{f.end:x}, above 4 GiB")
        frows: list[tuple[int, Rule]] = []
        try:
            _, visited = _run(p.data[f.sec], f.prog, f.prog_end, f.cie, frows, f.start, f.end, _fde_signal(inp, f))
        except _Bad as e:
            raise _Bad(f"{where}: {e}") from None
        rows_raw += visited
        covered += f.end - f.start
        for loc, r in frows:
            idx = index.get(r)
            if idx is None:
                if len(rules) >= MAX_RULES:
                    raise _Bad(f"more than {MAX_RULES} distinct rules")
                idx = index[r] = len(rules)
                rules.append(r)
            if idx != last:
                emit(loc, idx)
        if (i + 1 == len(taken) or taken[i + 1].start != f.end) and last != 0:
            emit(f.end, 0)
    stats = CfiStats(source, len(fdes), len(taken), overlapping, rows_raw, len(out) // ROW.size, len(rules),
                     covered, tuple(cfa_kinds), tuple(rbp_kinds))
    return UnwindTable(bytes(out), tuple(rules), stats)


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
        try:
            self.elf = ElfFile.open(path)
        except CfiError:
            raise
        except SymbolizeError as e:
            raise CfiError(str(e)) from None
        try:
            self.fd = os.open(self.elf.fd_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            self.elf.close()
            raise CfiError(f"{label}: {e.strerror or e}") from None
        self._inp: _Input | None = None

    @property
    def inp(self) -> _Input:
        if self._inp is None:
            self._inp = self._input(self.label)
        return self._inp

    def _input(self, label: str) -> _Input:
        elf = self.elf
        if elf.machine != _EM_X86_64 or not elf.is64 or not elf.little_endian:
            raise CfiError(f"{label}: not an x86-64 ELF file")
        if int.from_bytes(os.pread(self.fd, 2, 16), "little") == _ET_REL:
            raise CfiError(f"{label}: relocatable object (addresses are not final)")
        try:

            def sec(name: str) -> tuple[bytes, int]:
                s = elf.section(name)
                if s is None or s.type == _SHT_NOBITS or not s.size:
                    return b"", 0
                return elf.read_section(s), s.addr

            eh, eh_addr = sec(".eh_frame")
            hdr, hdr_addr = sec(".eh_frame_hdr") if eh else (b"", 0)
            dsec = elf.dwarf_section("frame")
            dbg = elf.read_section(dsec) if dsec is not None else b""
        except CfiError:
            raise
        except SymbolizeError as e:
            raise CfiError(str(e)) from None
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
        try:
            p = _Parser(o.inp)
            for sec in (_EH, _DEBUG):
                for off, rec in p.records[sec].items():
                    if rec.is_cie:
                        continue
                    f = p.fde(sec, off, rec)
                    rows: list[tuple[int, Rule]] = []
                    try:
                        _run(p.data[sec], f.prog, f.prog_end, f.cie, rows, f.start, f.end, _fde_signal(o.inp, f))
                    except _Bad as e:
                        raise _Bad(f"{_SECNAME[sec]} FDE at 0x{off:x}: {e}") from None
                    yield FdeRows(_SECNAME[sec], off, f.start, f.end, rows)
        except _Bad as e:
            raise CfiError(f"{o.inp.label}: {e}") from None


Engine = Literal["auto", "c", "python"]


def _build(inp: _Input, engine: Engine) -> UnwindTable:
    lib = None if engine == "python" else _fast_lib()
    if lib is None and engine == "c":
        raise CfiError(f"{inp.label}: the C engine is unavailable ({_fast_state.error})")
    try:
        return _build_py(inp) if lib is None else _build_c(lib, inp)
    except _Bad as e:
        raise CfiError(f"{inp.label}: {e}") from None


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
    An x86-64 file without CFI gives an empty table. Raises CfiError."""
    with _Opened(path) as o:
        return _build(o.inp, engine)


# --- the C engine -----------------------------------------------------------------------------------------

_C_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cfi_fast.c")
_C_FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC")
_N_STATS = 7 + len(CFA_KINDS) + len(RBP_KINDS)


class _CInput(ctypes.Structure):
    """struct cfi_input of cfi_fast.c."""

    _fields_ = [
        ("eh", ctypes.c_char_p), ("eh_len", ctypes.c_uint64), ("eh_addr", ctypes.c_uint64),
        ("hdr", ctypes.c_char_p), ("hdr_len", ctypes.c_uint64), ("hdr_addr", ctypes.c_uint64),
        ("dbg", ctypes.c_char_p), ("dbg_len", ctypes.c_uint64),
        ("fd", ctypes.c_int64), ("ncode", ctypes.c_uint64), ("code", ctypes.POINTER(ctypes.c_uint64)),
        ("max_rows", ctypes.c_uint64),
    ]


class _CResult(ctypes.Structure):
    """struct cfi_result of cfi_fast.c."""

    _fields_ = [
        ("rows", ctypes.c_void_p), ("nrows", ctypes.c_uint64), ("rules", ctypes.c_void_p),
        ("nrules", ctypes.c_uint64), ("stats", ctypes.c_uint64 * _N_STATS), ("source", ctypes.c_char * 32),
        ("error", ctypes.c_char * 512),
    ]


class _FastState:
    """The compiled engine, loaded once per process; `error` says why it is not there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        self.lib: ctypes.CDLL | None = None
        self.error = ""


_fast_state = _FastState()


def _private_dir(path: str, create: bool = True) -> None:
    """Create `path` (0700) if needed; CfiError unless only we (and root) can change it or any directory above
    it (core/safe_files.py trusted_dir): we load code from it, and a user who owns a directory on the way (a
    home directory kept by sudo) could otherwise swap in one of theirs. Paths under it are then stable."""
    try:
        os.close(trusted_dir(os.path.abspath(path), create=create, mode=0o700))
    except FileRefused as e:
        raise CfiError(f"{path}: not a private directory ({e})") from None
    except OSError as e:
        raise CfiError(f"{path}: not a private directory ({e.strerror or e})") from None


def _compiled_path(cache_dir: str | None = None) -> str:
    """Where the engine built from this exact source and these flags lives."""
    with open(_C_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(_C_FLAGS).encode()).hexdigest()[:16]
    return os.path.join(cache_dir or default_cache_dir(), "cfi", f"cfi_fast-{digest}.so")


def _compile(so: str) -> None:
    """cc the engine to `so` atomically (temp name + rename), so a concurrent loader never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-cfi_fast-", suffix=".so", dir=os.path.dirname(so))
    os.close(fd)
    try:
        proc = subprocess.run(["cc", *_C_FLAGS, "-o", tmp, _C_SOURCE], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["?"])[0]
            raise CfiError(f"cc failed on {_C_SOURCE}: {first}")
        os.replace(tmp, so)
        tmp = ""
    finally:
        if tmp:
            os.unlink(tmp)


def _load_fast(cache_dir: str | None = None) -> ctypes.CDLL:
    so = _compiled_path(cache_dir)
    _private_dir(os.path.dirname(so))
    try:
        st = os.lstat(so)
    except FileNotFoundError:
        _compile(so)
        st = os.lstat(so)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise CfiError(f"{so}: not a regular file only we can write to")
    lib = ctypes.CDLL(so)
    lib.cfi_build.argtypes = [ctypes.POINTER(_CInput), ctypes.POINTER(_CResult)]
    lib.cfi_build.restype = ctypes.c_int
    lib.cfi_free.argtypes = [ctypes.POINTER(_CResult)]
    lib.cfi_free.restype = None
    lib.cfi_sizes.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    lib.cfi_sizes.restype = None
    lib.cfi_check_rows.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64]
    lib.cfi_check_rows.restype = ctypes.c_int
    sizes = (ctypes.c_uint64 * 2)()
    lib.cfi_sizes(sizes)
    if tuple(sizes) != (ctypes.sizeof(_CInput), ctypes.sizeof(_CResult)):
        raise CfiError(f"{so}: struct sizes {tuple(sizes)} differ from cfi.py's")
    return lib


def _fast_lib() -> ctypes.CDLL | None:
    """The C engine, compiled on first use; None (with the reason logged once) when it cannot be had."""
    s = _fast_state
    with s.lock:
        if not s.tried:
            s.tried = True
            try:
                s.lib = _load_fast()
            except (OSError, subprocess.SubprocessError, CfiError) as e:
                s.error = str(e)
                log.warning("CFI C engine unavailable, using the slower Python one: %s", e)
        return s.lib


def _build_c(lib: ctypes.CDLL, inp: _Input) -> UnwindTable:
    flat = [v for seg in inp.code for v in seg]
    code = (ctypes.c_uint64 * max(1, len(flat)))(*flat)
    cin = _CInput(inp.eh, len(inp.eh), inp.eh_addr, inp.hdr, len(inp.hdr), inp.hdr_addr, inp.dbg, len(inp.dbg),
                  inp.fd, len(inp.code), code, inp.max_rows)
    res = _CResult()
    if lib.cfi_build(ctypes.byref(cin), ctypes.byref(res)) != 0:
        raise _Bad(res.error.decode("utf-8", "replace"))
    try:
        rows = ctypes.string_at(res.rows, res.nrows * ROW.size) if res.nrows else b""
        packed = ctypes.string_at(res.rules, res.nrules * RULE.size)
    finally:
        lib.cfi_free(ctypes.byref(res))
    rules = tuple(Rule(*r) for r in RULE.iter_unpack(packed))
    st = list(res.stats)
    n = len(CFA_KINDS)
    stats = CfiStats(res.source.decode(), st[0], st[1], st[2], st[3], st[4], st[5], st[6], tuple(st[7 : 7 + n]),
                     tuple(st[7 + n :]))
    return UnwindTable(rows, rules, stats)


# --- the on-disk cache ------------------------------------------------------------------------------------

_MAGIC = b"AIFLCFI\0"
_FORMAT_VERSION = 1  # bump whenever the rows a file gives could change
_HEAD = struct.Struct("<8sIIIII32s")  # magic, version, key, stats, rules, rows lengths, SHA-256 of the rest
_SAFE_KEY = frozenset("0123456789abcdefghijklmnopqrstuvwxyz-")


def cache_path(key: str, cache_dir: str | None = None) -> str:
    """The cache file of a table keyed `key` (a build id, or "sha256-" and the file's digest)."""
    if not key or len(key) > 128 or not set(key) <= _SAFE_KEY:
        raise ValueError(f"bad cache key {key!r}")
    return os.path.join(cache_dir or default_cache_dir(), "cfi", key + ".cfi")


def encode_table(key: str, table: UnwindTable) -> bytes:
    """The cache file's bytes: header, key, stats (JSON), rules, rows."""
    k = key.encode()
    st = json.dumps(table.stats.to_json(), sort_keys=True).encode()
    rules = table.rules_bytes()
    body = k + st + rules + table.rows
    head = _HEAD.pack(_MAGIC, _FORMAT_VERSION, len(k), len(st), len(table.rules), len(table),
                      hashlib.sha256(body).digest())
    return head + body


def decode_table(data: bytes, key: str, check_with_c: bool = True) -> UnwindTable:
    """Inverse of encode_table, checking everything a BPF loader relies on; ValueError when anything is off.
    The row checks run in the C engine when it is there (`check_with_c`), else in Python."""
    if len(data) < _HEAD.size:
        raise ValueError("short header")
    magic, version, klen, slen, nrules, nrows, digest = _HEAD.unpack_from(data)
    if magic != _MAGIC or version != _FORMAT_VERSION:
        raise ValueError("other format or version")
    if not 0 < nrules <= MAX_RULES or nrows > MAX_ROWS:
        raise ValueError("counts out of range")
    at = _HEAD.size
    if len(data) != at + klen + slen + nrules * RULE.size + nrows * ROW.size:
        raise ValueError("length mismatch")
    body = memoryview(data)[at:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    if bytes(body[:klen]) != key.encode():
        raise ValueError("other key")
    stats = CfiStats.from_json(json.loads(bytes(body[klen : klen + slen])))
    at = klen + slen
    rules = tuple(Rule(*r) for r in RULE.iter_unpack(body[at : at + nrules * RULE.size]))
    rows = bytes(body[at + nrules * RULE.size :])
    if rules[0] != NOT_COVERED or len(set(rules)) != nrules:
        raise ValueError("rules")
    if any(r.cfa_type >= len(CFA_KINDS) or r.rbp_type >= len(RBP_KINDS) for r in rules):
        raise ValueError("rule kinds")
    if (stats.rows, stats.rules) != (nrows, nrules):
        raise ValueError("stats disagree with the table")
    lib = _fast_lib() if check_with_c else None
    bad = _check_rows_py(rows, nrows, nrules) if lib is None else lib.cfi_check_rows(rows, nrows, nrules)
    if bad:
        raise ValueError(_ROW_PROBLEMS[bad])
    return UnwindTable(rows, rules, stats)


_ROW_PROBLEMS = {1: "rows not strictly increasing", 2: "spare field set", 3: "row rule indices",
                 4: "repeated rows"}


def _check_rows_py(rows: bytes, nrows: int, nrules: int) -> int:
    """cfi_check_rows of cfi_fast.c (0 or a _ROW_PROBLEMS key), for when the C engine is not there. memoryview
    slices and map() keep it at ~0.3 s for libtorch_cpu.so's 2.6 M rows; the C one takes ~5 ms."""
    if not nrows:
        return 0
    pcs, idx = memoryview(rows).cast("I")[::2], memoryview(rows).cast("H")[2::4]
    if not all(map(int.__lt__, pcs, pcs[1:])):
        return 1
    if rows[6::8] != bytes(nrows) or rows[7::8] != bytes(nrows):
        return 2
    if max(idx) >= nrules:
        return 3
    if any(map(int.__eq__, idx, idx[1:])):
        return 4
    return 3 if idx[0] == 0 or idx[nrows - 1] != 0 else 0


def _read_cached(path: str, key: str) -> UnwindTable | None:
    limit = _HEAD.size + 4096 + MAX_RULES * RULE.size + MAX_ROWS * ROW.size
    try:
        _private_dir(os.path.dirname(path), create=False)
        data = read_regular(path, limit, follow=False)
    except FileNotFoundError:
        return None
    except (OSError, CfiError, FileRefused) as e:
        log.debug("CFI cache %s ignored: %s", path, e)
        return None
    try:
        return decode_table(data, key)
    except (ValueError, TypeError, struct.error) as e:
        log.info("CFI cache %s is corrupt (%s); rebuilding", path, e)
        return None


def _write_cached(path: str, key: str, table: UnwindTable) -> None:
    """Atomic (temp file + rename); failures are logged and ignored: the cache only saves time."""
    tmp = ""
    try:
        _private_dir(os.path.dirname(path))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".cfi", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(encode_table(key, table))
        os.replace(tmp, path)
        tmp = ""
    except (OSError, CfiError) as e:
        log.debug("CFI cache %s not written: %s", path, e)
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _content_key(fd: int) -> str:
    h = hashlib.sha256()
    off = 0
    while chunk := os.pread(fd, 1 << 20, off):
        h.update(chunk)
        off += len(chunk)
    return "sha256-" + h.hexdigest()


def load_or_build(path: str | os.PathLike[str], cache_dir: str | None = None, engine: Engine = "auto") -> UnwindTable:
    """The table of `path` from the cache under `cache_dir` (default: default_cache_dir()/cfi), keyed by
    build id or else the SHA-256 of the content; built and stored when absent, stale or corrupt."""
    with _Opened(path) as o:
        bid = o.elf.build_id
        key = bid if bid and set(bid) <= _SAFE_KEY else _content_key(o.fd)
        cpath = cache_path(key, cache_dir)
        table = _read_cached(cpath, key)
        if table is None:
            table = _build(o.inp, engine)
            _write_cached(cpath, key, table)
        return table
