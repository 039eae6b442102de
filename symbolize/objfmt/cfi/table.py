"""The unwind table BPF reads: the rule kinds and the row and rule layouts (shared with bpf/unwind.h, which a
test keeps equal), `Rule`, `CfiStats` and `UnwindTable`. The package docstring describes the table as a whole."""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

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
# CFA + rbp_off), INVALID (another expression or a register rule: the caller's rbp is unknown), AT_RBP (saved at
# the frame's own rbp + rbp_off, from DW_CFA_expression rbp: DW_OP_breg6 N: a stack-realigning prologue, which
# pairs it with DEREF_RBP). END, INVALID and SIGNAL rules carry no offsets and rbp UNCHANGED, so that they
# dedupe to one rule each.
CFA_NONE, CFA_RSP, CFA_RBP, CFA_PLT, CFA_PLT10, CFA_DEREF_RBP, CFA_END, CFA_INVALID, CFA_SIGNAL = range(9)
CFA_KINDS = ("none", "rsp", "rbp", "plt", "plt10", "deref_rbp", "end", "invalid", "signal")
RBP_UNCHANGED, RBP_OFFSET, RBP_INVALID, RBP_AT_RBP = range(4)
RBP_KINDS = ("unchanged", "offset", "invalid", "at_rbp")

ROW = struct.Struct("<IHH")  # pc, rule index, spare (0)
RULE = struct.Struct("<BBxxii")  # cfa_type, rbp_type, cfa_off, rbp_off

MAX_ROWS = 8 << 20  # far above libtorch_cpu.so's 2.6 M; a bigger table would not fit the BPF maps anyway
MAX_RULES = 1 << 16  # the row's u16 index
MAX_STATE_DEPTH = 64  # DW_CFA_remember_state nesting; compilers use 1 or 2
_MAX_PC = 0xFFFFFFFF  # rows hold u32 addresses
_S32_MIN, _S32_MAX = -(1 << 31), (1 << 31) - 1
_U64 = (1 << 64) - 1


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
