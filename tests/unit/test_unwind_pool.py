"""agent/kernel/unwind.py without BPF: the row pool (allocation, sharing, LRU eviction), rules deduplicated
across files, and what each process's unwind_proc says. The maps are dicts, the pool a bytearray, the tables
synthetic; the files are copies of a real ELF (the loader reads its segments for the bias)."""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aiflame.agent.kernel.bpf_object import BpfMap, BpfObject
from aiflame.agent.kernel.unwind import ROWS_EVICTED, UnwindMap, UnwindProc, UnwindTables
from aiflame.core.raw import Mapping
from aiflame.symbolize.objfmt.cfi import (
    CFA_RBP,
    CFA_RSP,
    NOT_COVERED,
    RBP_OFFSET,
    RBP_UNCHANGED,
    ROW,
    RULE,
    CfiError,
    CfiStats,
    Rule,
    UnwindTable,
)

R1 = Rule(CFA_RSP, RBP_UNCHANGED, 8, 0)
R2 = Rule(CFA_RSP, RBP_UNCHANGED, 16, 0)
R3 = Rule(CFA_RBP, RBP_OFFSET, 16, -16)
_U32 = struct.Struct("<I")


@dataclass
class DictMap(BpfMap):
    data: dict[bytes, bytes] = field(default_factory=dict)

    def update(self, key: bytes, value: bytes) -> None:
        self.data[key] = value

    def delete(self, key: bytes) -> bool:
        return self.data.pop(key, None) is not None


def _map(name: str, max_entries: int) -> DictMap:
    return DictMap(name, -1, 2, max_entries, 4, 8, [])


def table(rules: tuple[Rule, ...], n: int, first_pc: int = 0x1000) -> UnwindTable:
    """`n` rows from `first_pc`, 16 bytes apart, cycling through `rules` (local indices)."""
    rows = b"".join(ROW.pack(first_pc + 16 * i, i % len(rules), 0) for i in range(n))
    stats = CfiStats("eh_frame_hdr", n, n, 0, n, n, len(rules), 16 * n, (), ())
    return UnwindTable(rows, rules, stats)


class _Tables(UnwindTables):
    def _file_of(self, pid: int, m: Mapping) -> str:
        return m.path  # the file itself, not /proc/PID/map_files (no such process here)


@dataclass
class Pool:
    tables: UnwindTables
    maps: dict[str, DictMap]
    pool: bytearray
    built: list[str]

    def proc(self, pid: int) -> list[UnwindMap]:
        p = UnwindProc.from_buffer_copy(self.maps["unwind_procs"].data[_U32.pack(pid)])
        return list(p.m[:p.n])

    def rows(self, first: int, n: int) -> list[tuple[int, int]]:
        """(pc, global rule index) of pool rows [first, first + n)."""
        return [(pc, rule) for pc, rule, _ in ROW.iter_unpack(bytes(self.pool[first * 8:(first + n) * 8]))]

    def rule(self, idx: int) -> Rule:
        return Rule(*RULE.unpack(self.maps["unwind_rules"].data[_U32.pack(idx)]))


def make_pool(capacity: int, tables: dict[str, UnwindTable | Exception]) -> Pool:
    maps = {"unwind_rows": _map("unwind_rows", capacity), "unwind_rules": _map("unwind_rules", 65536),
            "unwind_procs": _map("unwind_procs", 8192)}
    built: list[str] = []

    def table_for(path: str) -> UnwindTable:
        name = Path(os.path.realpath(path)).name  # the loader passes the open file (/proc/self/fd/N)
        built.append(name)
        t = tables[name]
        if isinstance(t, Exception):
            raise t
        return t

    pool = bytearray(capacity * 8)
    obj = BpfObject(progs={}, maps=dict[str, BpfMap](maps))
    return Pool(_Tables(obj, table_for, pool=pool), maps, pool, built)


@pytest.fixture
def files(tmp_path: Path) -> Callable[[str], str]:
    """A distinct ELF file (its own inode: its own table key) per name."""
    def make(name: str) -> str:
        p = tmp_path / name
        if not p.exists():
            shutil.copy("/usr/bin/true", p)
        return str(p)
    return make


def mapping(path: str, start: int, size: int = 0x10000) -> Mapping:
    return Mapping(start, start + size, 0, path, perms="r-xp")


def test_shared_tables_and_rules_deduplicated(files: Callable[[str], str]) -> None:
    p = make_pool(64, {"a": table((R1, R2), 5), "b": table((R2, R3, R1), 6, first_pc=0x2000)})
    a, b = files("a"), files("b")
    p.tables.add_process(1, [mapping(b, 0x7000_0000), mapping(a, 0x5000_0000)])
    p.tables.add_process(2, [mapping(a, 0x6000_0000), mapping("[vdso]", 0x7fff_0000),
                             Mapping(0x100, 0x200, 0, a, perms="rw-p")])
    assert p.built == ["a", "b"]  # each file's table built once, in address order
    assert p.tables.stats.loaded == 2 and p.tables.stats.tables == 2 and p.tables.stats.rows_used == 11
    # Rules: NOT_COVERED is 0, then each distinct rule once, the same index for every file using it.
    assert {p.rule(i) for i in range(4)} == {NOT_COVERED, R1, R2, R3} and len(p.maps["unwind_rules"].data) == 4
    assert p.rule(0) == NOT_COVERED
    one = p.proc(1)
    assert [(m.start, m.end, m.bias) for m in one] == [(0x5000_0000, 0x5001_0000, 0x5000_0000),
                                                       (0x7000_0000, 0x7001_0000, 0x7000_0000)]
    ma, mb = one
    assert (ma.first_row, ma.nrows, mb.first_row, mb.nrows) == (0, 5, 5, 6)
    rows_a, rows_b = p.rows(0, 5), p.rows(5, 6)
    assert [pc for pc, _ in rows_a] == [0x1000 + 16 * i for i in range(5)]
    assert [p.rule(r) for _, r in rows_a] == [(R1, R2)[i % 2] for i in range(5)]
    assert [p.rule(r) for _, r in rows_b] == [(R2, R3, R1)[i % 3] for i in range(6)]
    assert rows_a[0][1] == rows_b[2][1]  # R1: one global index for both files
    # Process 2 maps the same file elsewhere: the same rows, its own bias; only executable file mappings count.
    two = p.proc(2)
    assert [(m.start, m.bias, m.first_row, m.nrows) for m in two] == [(0x6000_0000, 0x6000_0000, 0, 5)]
    p.tables.remove_process(2)
    assert _U32.pack(2) not in p.maps["unwind_procs"].data


def test_eviction_unused_first_then_least_recent(files: Callable[[str], str]) -> None:
    p = make_pool(10, {n: table((R1,), 4, first_pc=0x1000 * (i + 1)) for i, n in enumerate("abcd")})
    p.tables.add_process(1, [mapping(files("a"), 0x1000_0000)])
    p.tables.add_process(2, [mapping(files("b"), 0x2000_0000)])
    p.tables.remove_process(2)  # b's table stays in the pool, unused
    p.tables.add_process(3, [mapping(files("c"), 0x3000_0000)])  # no room: b goes, not the older a
    assert p.tables.stats.evicted == 1 and p.proc(1)[0].nrows == 4 and p.proc(3)[0].first_row == 4
    p.tables.add_process(4, [mapping(files("d"), 0x4000_0000)])  # a and c both in use: a is older
    assert p.tables.stats.evicted == 2
    gone = p.proc(1)[0]
    assert (gone.first_row, gone.nrows) == (ROWS_EVICTED, 0)  # the unwinder says "evicted", walks with FP
    assert (p.proc(3)[0].first_row, p.proc(4)[0].first_row) == (4, 0)
    assert p.rows(0, 4)[0][0] == 0x4000  # d's rows where a's were
    # Process 1 described again: a is loaded anew (the least recent, c, makes room) and counted again.
    p.tables.add_process(1, [mapping(files("a"), 0x1000_0000)])
    assert p.tables.stats.loaded == 5 and p.tables.stats.evicted == 3
    assert p.proc(1)[0].nrows == 4 and p.proc(3)[0].first_row == ROWS_EVICTED
    assert p.built == ["a", "b", "c", "d", "a"]


def test_freed_neighbours_merge(files: Callable[[str], str]) -> None:
    p = make_pool(12, {"a": table((R1,), 4), "b": table((R2,), 4), "c": table((R3,), 4), "big": table((R1,), 9)})
    for pid, n in ((1, "a"), (2, "b"), (3, "c")):
        p.tables.add_process(pid, [mapping(files(n), pid << 28)])
    p.tables.remove_process(1)
    p.tables.remove_process(2)
    # a and b are unused: evicting both frees rows 0-7 as one range; with c in use, 9 rows need all 12
    p.tables.add_process(4, [mapping(files("big"), 4 << 28)])
    assert p.tables.stats.evicted == 3 and p.proc(4)[0].first_row == 0 and p.proc(4)[0].nrows == 9
    assert p.proc(3)[0].first_row == ROWS_EVICTED


def test_files_without_a_usable_table_fall_back(files: Callable[[str], str]) -> None:
    p = make_pool(8, {"huge": table((R1,), 9), "bad": CfiError("bad: CIE pointer outside .eh_frame"),
                      "ok": table((R1,), 3)})
    huge, bad, ok = files("huge"), files("bad"), files("ok")
    for pid in (1, 2):
        p.tables.add_process(pid, [mapping(huge, 0x1000_0000), mapping(bad, 0x2000_0000), mapping(ok, 0x3000_0000)])
    assert p.built == ["huge", "bad", "ok"]  # a failed file is not tried again (another process, a re-read)
    assert "do not fit the table pool" in p.tables.stats.errors[huge]
    assert p.tables.stats.errors[bad] == "bad: CIE pointer outside .eh_frame"
    assert [(m.first_row, m.nrows) for m in p.proc(2)] == [(0, 0), (0, 0), (0, 3)]  # frame pointers, then rows
    assert p.tables.stats.evicted == 0  # the pool was not emptied for a table that could never fit
