"""The Python reference's reading of CFI bytes: LEB128 numbers and DW_EH_PE pointers, and the CFA program (the
DW_CFA_* instructions of CIEs and FDEs) interpreted into table rules. cfi_fast.c does the same step for step.
Malformed bytes raise Unreadable saying what and at which offset; the callers up the way put the FDE, the section
and the file in front (parse.py, build.py)."""

from __future__ import annotations

from typing import NamedTuple

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.cfi.table import (
    _END,
    _INVALID,
    _S32_MAX,
    _S32_MIN,
    _SIGNAL,
    _U64,
    CFA_DEREF_RBP,
    CFA_INVALID,
    CFA_PLT,
    CFA_PLT10,
    CFA_RBP,
    CFA_RSP,
    MAX_STATE_DEPTH,
    RBP_AT_RBP,
    RBP_INVALID,
    RBP_OFFSET,
    RBP_UNCHANGED,
    Rule,
)

# --- reading primitives -----------------------------------------------------------------------------------


def _leb(d: bytes, pos: int, end: int, signed: bool) -> tuple[int, int]:
    """A LEB128 value at `pos` (at most 10 bytes, as a 64-bit value) and the position after it."""
    result = shift = 0
    while True:
        if pos >= end:
            raise Unreadable(f"truncated LEB128 at 0x{pos:x}")
        if shift >= 70:
            raise Unreadable(f"LEB128 longer than 10 bytes at 0x{pos:x}")
        b = d[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if not signed:
                return result & _U64, pos
            if shift < 64 and b & 0x40:
                result |= _U64 << shift
            result &= _U64
            return result - (1 << 64) if result >> 63 else result, pos


def _uleb(d: bytes, pos: int, end: int) -> tuple[int, int]:
    return _leb(d, pos, end, False)


def _sleb(d: bytes, pos: int, end: int) -> tuple[int, int]:
    return _leb(d, pos, end, True)


def _fixed(d: bytes, pos: int, end: int, n: int, signed: bool) -> tuple[int, int]:
    if pos + n > end:
        raise Unreadable(f"truncated value at 0x{pos:x}")
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
        raise Unreadable(f"unsupported pointer encoding 0x{enc:02x}")
    if enc & _PE_INDIRECT and not allow_indirect:
        raise Unreadable(f"indirect pointer encoding 0x{enc:02x} where an address is needed")
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
        raise Unreadable(f"unsupported pointer encoding 0x{enc:02x}")
    return v & _U64, pos



# --- the state a CFA program tracks ------------------------------------------------------------------


class _Cie(NamedTuple):
    caf: int
    daf: int
    fde_enc: int
    has_z: bool
    signal: bool
    state: _State  # after the initial instructions


class _State(NamedTuple):
    """The tracked part of a CFI row. Register rule kinds: 0 undefined/unset, 1 same value, 2 saved at
    CFA+off, 3 anything else, 4 saved at rbp+off (rbp's rule only). Offsets are exact; cfa_reg -1 means no CFA
    rule yet."""

    cfa_reg: int
    cfa_off: int
    cfa_expr: bytes | None
    rbp_kind: int
    rbp_off: int
    ra_kind: int
    ra_off: int


_R_UNDEF, _R_SAME, _R_OFFSET, _R_OTHER, _R_AT_RBP = range(5)
_NO_STATE = _State(-1, 0, None, _R_UNDEF, 0, _R_UNDEF, 0)
_REG_RBP, _REG_RSP, _REG_RA = 6, 7, 16



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
        except Unreadable:
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
    if s.rbp_kind == _R_AT_RBP and _S32_MIN <= s.rbp_off <= _S32_MAX:
        return Rule(cfa_type, RBP_AT_RBP, cfa_off, s.rbp_off)
    return Rule(cfa_type, RBP_INVALID, cfa_off, 0)


def _run(d: bytes, pos: int, end: int, cie: _Cie, rows: list[tuple[int, Rule]] | None, start: int = 0,
         stop: int = 0, signal: bool = False) -> tuple[_State, int]:
    """Interpret the instructions d[pos:end]: a CIE's when `rows` is None, else an FDE's, appending
    (location, rule) whenever the location advances and the rule changed. Locations run from `start` to
    `stop` (exclusive); advancing past `stop` is an error. Returns the final state and the number of
    locations visited below `stop` (the rows before dropping repeats)."""
    # The hot path of the reference engine: the state lives in locals, and the instructions that make up 92-99% of
    # those in libc, python3.11 and libLLVM are handled inline; `_other` does the rest on a _State.
    base = cie.state if rows is not None else _NO_STATE
    cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off = base
    caf, daf = cie.caf, cie.daf
    stack: list[_State] = []
    loc = start
    last: Rule | None = None
    visited = 0
    while pos < end:
        op = d[pos]
        pos += 1
        hi = op & 0xC0
        if hi == 0x40:  # advance_loc
            new = loc + (op & 0x3F) * caf
        elif op == 0x0E:  # def_cfa_offset
            cfa_off, pos = _uleb(d, pos, end)
            continue
        elif op == 0x00:  # nop
            continue
        elif hi == 0x80:  # offset
            v, pos = _uleb(d, pos, end)
            if op & 0x3F == _REG_RBP:
                rbp_k, rbp_off = _R_OFFSET, v * daf
            elif op & 0x3F == _REG_RA:
                ra_k, ra_off = _R_OFFSET, v * daf
            continue
        elif 0x02 <= op <= 0x04:  # advance_loc1, advance_loc2, advance_loc4
            v, pos = _fixed(d, pos, end, 1 << (op - 0x02), False)
            new = loc + v * caf
        else:
            s = _State(cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off)
            pos, s, to = _other(d, pos, end, op, cie, loc, s, stack)
            cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off = s
            if to is None:
                continue
            new = to
        # only the advances get here: the row up to `new` is complete
        if rows is None:
            raise Unreadable("advance in CIE initial instructions")
        if new > stop or new < loc:
            raise Unreadable(f"advance leaves the FDE range 0x{start:x}..0x{stop:x}")
        if new != loc:
            r = _rule(_State(cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off), signal)
            if r != last:
                rows.append((loc, r))
                last = r
            visited += 1
            loc = new
    final = _State(cfa_reg, cfa_off, cfa_expr, rbp_k, rbp_off, ra_k, ra_off)
    if rows is not None and loc < stop:
        r = _rule(final, signal)
        if r != last:
            rows.append((loc, r))
        visited += 1
    return final, visited


def _other(d: bytes, pos: int, end: int, op: int, cie: _Cie, loc: int, s: _State,
           stack: list[_State]) -> tuple[int, _State, int | None]:
    """One of the less common instructions (`op`, its operands at `pos`): the position after it, the state after
    it, and the location it advances to (None when it does not advance). `stack`: the remembered states."""
    if op == 0x0A:  # remember_state
        if len(stack) >= MAX_STATE_DEPTH:
            raise Unreadable(f"remember_state nested deeper than {MAX_STATE_DEPTH}")
        stack.append(s)
    elif op == 0x0B:  # restore_state
        if not stack:
            raise Unreadable("restore_state without remember_state")
        s = stack.pop()
    elif op in _CFA_OPS:
        pos, s = _cfa_op(d, pos, end, op, cie.daf, s)
    elif op in _REG_OPS or op & 0xC0 == 0xC0:
        pos, s = _reg_op(d, pos, end, op, cie, s)
    elif op == 0x2E:  # GNU_args_size: only for landing pads
        _, pos = _uleb(d, pos, end)
    elif op == 0x01:  # set_loc
        v, pos = _encoded(d, pos, end, cie.fde_enc, 0, None, False)
        if cie.fde_enc & 0x70 == _PE_PCREL:
            raise Unreadable("pc-relative DW_CFA_set_loc")
        return pos, s, v
    elif op == 0x1D:  # MIPS_advance_loc8
        v, pos = _fixed(d, pos, end, 8, False)
        return pos, s, loc + v * cie.caf
    elif op != 0x2D:  # GNU_window_save: SPARC/AArch64 only, no operands
        raise Unreadable(f"unknown CFA instruction 0x{op:02x} at 0x{pos - 1:x}")
    return pos, s, None


# def_cfa, def_cfa_register, def_cfa_expression, def_cfa_sf, def_cfa_offset_sf
_CFA_OPS = frozenset({0x0C, 0x0D, 0x0F, 0x12, 0x13})


def _cfa_op(d: bytes, pos: int, end: int, op: int, daf: int, s: _State) -> tuple[int, _State]:
    """An instruction of _CFA_OPS: it sets the CFA rule."""
    if op == 0x0C:  # def_cfa
        reg, pos = _uleb(d, pos, end)
        off, pos = _uleb(d, pos, end)
        return pos, s._replace(cfa_reg=reg, cfa_off=off, cfa_expr=None)
    if op == 0x0D:  # def_cfa_register
        reg, pos = _uleb(d, pos, end)
        return pos, s._replace(cfa_reg=reg, cfa_expr=None)
    if op == 0x12:  # def_cfa_sf
        reg, pos = _uleb(d, pos, end)
        v, pos = _sleb(d, pos, end)
        return pos, s._replace(cfa_reg=reg, cfa_off=v * daf, cfa_expr=None)
    if op == 0x13:  # def_cfa_offset_sf
        v, pos = _sleb(d, pos, end)
        return pos, s._replace(cfa_off=v * daf)
    # def_cfa_expression
    n, pos = _uleb(d, pos, end)
    if pos + n > end:
        raise Unreadable(f"expression runs past the end at 0x{pos:x}")
    return pos + n, s._replace(cfa_expr=d[pos : pos + n])


# restore_extended, undefined, same_value, register, offset_extended, offset_extended_sf,
# GNU_negative_offset_extended, val_offset, val_offset_sf, expression, val_expression (and restore, op & 0xC0)
_REG_OPS = frozenset({0x06, 0x07, 0x08, 0x09, 0x05, 0x11, 0x2F, 0x14, 0x15, 0x10, 0x16})


def _reg_op(d: bytes, pos: int, end: int, op: int, cie: _Cie, s: _State) -> tuple[int, _State]:
    """An instruction of _REG_OPS or a restore: it sets one register's rule (only RBP's and RA's are kept)."""
    if op & 0xC0 == 0xC0:  # restore
        reg = op & 0x3F
    else:
        reg, pos = _uleb(d, pos, end)
    if op & 0xC0 == 0xC0 or op == 0x06:  # restore, restore_extended: the rule after the CIE's instructions
        init = cie.state
        kind, off = (init.rbp_kind, init.rbp_off) if reg == _REG_RBP else (init.ra_kind, init.ra_off)
    elif op == 0x07 or op == 0x08:  # undefined, same_value
        kind, off = (_R_UNDEF if op == 0x07 else _R_SAME), 0
    elif op == 0x05 or op == 0x11 or op == 0x2F:  # offset_extended, _sf, GNU_negative_offset_extended
        if op == 0x11:
            v, pos = _sleb(d, pos, end)
        else:
            v, pos = _uleb(d, pos, end)
            if op == 0x2F:
                v = -v
        kind, off = _R_OFFSET, v * cie.daf
    elif op == 0x10 or op == 0x16:  # expression, val_expression
        n, pos = _uleb(d, pos, end)
        if pos + n > end:
            raise Unreadable(f"expression runs past the end at 0x{pos:x}")
        kind, off = _R_OTHER, 0
        if op == 0x10 and reg == _REG_RBP and n >= 2 and d[pos] == _OP_BREG6:
            # DW_OP_breg6 N alone: a stack-realigning prologue saved the caller's rbp at [rbp + N]
            try:
                v, after = _sleb(d, pos + 1, pos + n)
            except Unreadable:
                v, after = 0, -1
            if after == pos + n:
                kind, off = _R_AT_RBP, v
        pos += n
    else:  # register, val_offset (uleb), val_offset_sf (sleb)
        _, pos = (_sleb if op == 0x15 else _uleb)(d, pos, end)
        kind, off = _R_OTHER, 0
    if reg == _REG_RBP:
        return pos, s._replace(rbp_kind=kind, rbp_off=off)
    if reg == _REG_RA:
        return pos, s._replace(ra_kind=kind, ra_off=off)
    return pos, s
