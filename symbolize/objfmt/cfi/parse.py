"""The Python reference engine: the records of .eh_frame and .debug_frame (CIEs, FDEs), the .eh_frame_hdr search
table, which FDEs make the table, and the packing of their rows (`_build_py`). The CFA programs themselves are
interpreted by program.py; cfi_fast.c does all of it step for step, faster."""

from __future__ import annotations

import bisect
import os
from typing import NamedTuple

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.cfi.program import (
    _NO_STATE,
    _PE_FORMATS,
    _PE_OMIT,
    _REG_RA,
    _Cie,
    _encoded,
    _fixed,
    _run,
    _sleb,
    _uleb,
)
from aiflame.symbolize.objfmt.cfi.table import (
    _MAX_PC,
    _U64,
    CFA_KINDS,
    MAX_ROWS,
    MAX_RULES,
    NOT_COVERED,
    RBP_KINDS,
    ROW,
    CfiStats,
    Rule,
    UnwindTable,
)

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
            raise Unreadable(f"{name}: truncated record at 0x{pos:x}")
        length = int.from_bytes(d[pos : pos + 4], "little")
        if length == 0:
            pos += 4
            continue
        idsize, head = 4, 4
        if length == 0xFFFFFFFF:
            if pos + 12 > n:
                raise Unreadable(f"{name}: truncated record at 0x{pos:x}")
            length = int.from_bytes(d[pos + 4 : pos + 12], "little")
            idsize, head = 8, 12
        elif length >= 0xFFFFFFF0:
            raise Unreadable(f"{name}: reserved length 0x{length:x} at 0x{pos:x}")
        end = pos + head + length
        if end > n or length < idsize:
            raise Unreadable(f"{name}: record at 0x{pos:x} runs past the end of the section")
        id_pos = pos + head
        ident = int.from_bytes(d[id_pos : id_pos + idsize], "little")
        is_cie = ident == 0 if sec == _EH else ident == (1 << (8 * idsize)) - 1
        out[pos] = _Record(is_cie, ident, id_pos, id_pos + idsize, end)
        pos = end
    return out


def _printable(b: bytes) -> str:
    s = "".join(chr(c) if 0x20 <= c < 0x7F else "?" for c in b[:16])
    return s + "..." if len(b) > 16 else s



class _Fde(NamedTuple):
    start: int
    end: int
    sec: int
    offset: int
    prog: int  # first instruction byte
    prog_end: int
    cie: _Cie



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
                raise Unreadable(f"{_SECNAME[sec]} FDE at 0x{fde_off:x}: CIE pointer 0x{off:x} is not a CIE")
            cie = self.cies[key] = self._parse_cie(sec, off, rec)
        return cie

    def _parse_cie(self, sec: int, off: int, rec: _Record) -> _Cie:
        d, end = self.data[sec], rec.end
        where = f"{_SECNAME[sec]} CIE at 0x{off:x}"
        pos = rec.body
        try:
            if pos >= end:
                raise Unreadable("truncated")
            version = d[pos]
            pos += 1
            if version not in (1, 3, 4):
                raise Unreadable(f"unsupported version {version}")
            nul = d.find(b"\0", pos, end)
            if nul < 0:
                raise Unreadable("unterminated augmentation string")
            aug = d[pos:nul]
            pos = nul + 1
            if version == 4:
                if pos + 2 > end:
                    raise Unreadable("truncated")
                if d[pos] != 8 or d[pos + 1] != 0:
                    raise Unreadable(f"address size {d[pos]}, segment size {d[pos + 1]}")
                pos += 2
            caf, pos = _uleb(d, pos, end)
            daf, pos = _sleb(d, pos, end)
            if version == 1:
                ra, pos = _fixed(d, pos, end, 1, False)
            else:
                ra, pos = _uleb(d, pos, end)
            if ra != _REG_RA:
                raise Unreadable(f"return address column {ra} is not 16 (rip)")
            fde_enc, signal, has_z = 0, False, aug[:1] == b"z"
            if has_z:
                alen, pos = _uleb(d, pos, end)
                aend = pos + alen
                if aend > end:
                    raise Unreadable("augmentation data runs past the end")
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
                        raise Unreadable(f'unsupported augmentation "{_printable(aug)}"')
            proto = _Cie(caf, daf, fde_enc, has_z, signal, _NO_STATE)
            state, _ = _run(d, pos, end, proto, None)
        except Unreadable as e:
            raise Unreadable(f"{where}: {e}") from None
        return proto._replace(state=state)

    def fde(self, sec: int, off: int, rec: _Record) -> _Fde:
        d, end = self.data[sec], rec.end
        if sec == _EH:
            cie_off = rec.id_pos - rec.ident
            if cie_off < 0:
                raise Unreadable(f".eh_frame FDE at 0x{off:x}: CIE pointer 0x{rec.ident:x} points before the section")
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
                    raise Unreadable("augmentation data runs past the end")
            if start + length > _U64:
                raise Unreadable(f"range 0x{start:x}+0x{length:x} wraps around")
        except Unreadable as e:
            raise Unreadable(f"{_SECNAME[sec]} FDE at 0x{off:x}: {e}") from None
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
            raise Unreadable(f"points at 0x{eh_ptr:x}, not at .eh_frame (0x{inp.eh_addr:x})")
        if count_enc == _PE_OMIT or table_enc == _PE_OMIT:
            return None
        count, pos = _encoded(d, pos, len(d), count_enc, inp.hdr_addr, inp.hdr_addr, False)
        fmt = _PE_FORMATS.get(table_enc & 0x0F)
        if fmt is None or fmt[0] == 0:
            raise Unreadable(f"unsupported table encoding 0x{table_enc:02x}")
        if count * 2 * fmt[0] > len(d) - pos:
            raise Unreadable(f"claims {count} FDEs, more than it holds")
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
    except Unreadable as e:
        raise Unreadable(f".eh_frame_hdr: {e}") from None


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
                raise Unreadable(f".eh_frame_hdr: entry {i} points at 0x{addr:x}, not at an FDE")
            if off in seen:
                continue
            seen.add(off)
            f = p.fde(_EH, off, rec)
            if f.start != loc:
                raise Unreadable(f".eh_frame_hdr: entry {i} says 0x{loc:x}, its FDE at 0x{off:x} says 0x{f.start:x}")
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
            raise Unreadable(f"more than {inp.max_rows} rows")
        out.extend(ROW.pack(pc, idx, 0))
        r = rules[idx]
        cfa_kinds[r.cfa_type] += 1
        rbp_kinds[r.rbp_type] += 1
        last = idx

    for i, f in enumerate(taken):
        where = f"{_SECNAME[f.sec]} FDE at 0x{f.offset:x}"
        if f.end > _MAX_PC:
            raise Unreadable(f"{where} covers 0x{f.start:x}..0x{f.end:x}, above 4 GiB")
        frows: list[tuple[int, Rule]] = []
        try:
            _, visited = _run(p.data[f.sec], f.prog, f.prog_end, f.cie, frows, f.start, f.end, _fde_signal(inp, f))
        except Unreadable as e:
            raise Unreadable(f"{where}: {e}") from None
        rows_raw += visited
        covered += f.end - f.start
        for loc, r in frows:
            idx = index.get(r)
            if idx is None:
                if len(rules) >= MAX_RULES:
                    raise Unreadable(f"more than {MAX_RULES} distinct rules")
                idx = index[r] = len(rules)
                rules.append(r)
            if idx != last:
                emit(loc, idx)
        if (i + 1 == len(taken) or taken[i + 1].start != f.end) and last != 0:
            emit(f.end, 0)
    stats = CfiStats(source, len(fdes), len(taken), overlapping, rows_raw, len(out) // ROW.size, len(rules),
                     covered, tuple(cfa_kinds), tuple(rbp_kinds))
    return UnwindTable(bytes(out), tuple(rules), stats)
