"""Compact unwind tables for BPF, compiled from the DWARF CFI (.eh_frame, .debug_frame) of x86-64 ELF files.

A table is a sorted list of 8-byte rows `<IHH>` (u32 pc, u16 rule index, u16 spare = 0) into a short list of
distinct 12-byte rules `<BBxxii>` (cfa_type, rbp_type, s32 cfa_off, s32 rbp_off); rule 0 is always
"not covered". A row holds from its pc up to the next row's pc; every FDE whose end is not the start of the
next one is followed by a not-covered row, so a PC past an FDE (or before the first row) is not covered.
Only the CFA, RBP (DWARF register 6) and RA (16) are tracked: anything a BPF unwinder cannot follow with
"CFA = base + off, RA at CFA-8, RBP saved at CFA+off" becomes an explicit INVALID, END or SIGNAL rule.

Two engines build the same table: the pure-Python reference, and `cfi_fast.c` (the same algorithm,
compiled on first use into the cache directory and called through ctypes), because on libtorch_cpu.so
(335k FDEs, 2.6 M rows) the reference takes ~10 s and 270 MB where the C engine takes ~0.4 s and ~110 MB.
Tests hold the two to identical rows, rules, stats and error messages.
`load_or_build` keeps built tables on disk, keyed by build id, and validates them when read back.

Every malformed-input path raises `Unreadable` (core/errors.py) with one line naming the file, the section and
the offset.

The modules, bottom up:
- `table`: the layout BPF reads (rule kinds, ROW, RULE), `Rule`, `CfiStats`, `UnwindTable`;
- `program`: the Python reference's reading primitives (LEB128, DW_EH_PE pointers) and CFA program interpreter;
- `parse`: the Python reference's walk of the sections: CIE/FDE records, .eh_frame_hdr, FDE selection, packing;
- `fast`: compiling `cfi_fast.c` and calling it through ctypes;
- `build`: opening an ELF file and building its table with either engine (`build_table`, `fde_rows`);
- `cache`: the on-disk cache file (`encode_table`, `decode_table`), `load_or_build` and `load_cached`.
Names with a leading underscore are private to this package; its public names are re-exported here.
"""

from aiflame.symbolize.objfmt.cfi.build import Engine, FdeRows, build_from_sections, build_table, fde_rows
from aiflame.symbolize.objfmt.cfi.cache import cache_path, decode_table, encode_table, load_cached, load_or_build
from aiflame.symbolize.objfmt.cfi.table import (
    CFA_DEREF_RBP,
    CFA_END,
    CFA_INVALID,
    CFA_KINDS,
    CFA_NONE,
    CFA_PLT,
    CFA_PLT10,
    CFA_RBP,
    CFA_RSP,
    CFA_SIGNAL,
    MAX_ROWS,
    MAX_RULES,
    MAX_STATE_DEPTH,
    NOT_COVERED,
    RBP_AT_RBP,
    RBP_INVALID,
    RBP_KINDS,
    RBP_OFFSET,
    RBP_UNCHANGED,
    ROW,
    RULE,
    CfiStats,
    Rule,
    UnwindTable,
)

__all__ = [
    "CFA_DEREF_RBP", "CFA_END", "CFA_INVALID", "CFA_KINDS", "CFA_NONE", "CFA_PLT", "CFA_PLT10", "CFA_RBP", "CFA_RSP",
    "CFA_SIGNAL", "MAX_ROWS", "MAX_RULES", "MAX_STATE_DEPTH", "NOT_COVERED", "RBP_AT_RBP", "RBP_INVALID", "RBP_KINDS",
    "RBP_OFFSET", "RBP_UNCHANGED", "ROW", "RULE", "CfiStats", "Engine", "FdeRows", "Rule", "UnwindTable",
    "build_from_sections", "build_table", "cache_path", "decode_table", "encode_table", "fde_rows", "load_cached",
    "load_or_build",
]
