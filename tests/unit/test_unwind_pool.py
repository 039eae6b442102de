"""agent/kernel/unwind.py without BPF: the row pool (allocation, sharing, LRU eviction), rules deduplicated
across files, and what each process's unwind_proc says. The maps are dicts, the pool a bytearray, the tables
synthetic; the files are copies of a real ELF (the loader reads its segments for the bias)."""

from __future__ import annotations

import bisect
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiflame.agent.kernel.bpf_object import BpfMap, BpfObject
from aiflame.agent.kernel.unwind import (
    DEFER_BYTES,
    MAX_BACKGROUND,
    MAX_PAGE_ROWS,
    PAGE_SHIFT,
    REWANT_NS,
    REWANT_WINDOW_NS,
    ROWS_EVICTED,
    ROWS_PENDING,
    STOP_EVICTED,
    VDSO,
    UnwindMap,
    UnwindProc,
    UnwindTables,
    page_index,
)
from aiflame.agent.kernel.vdso import own_vdso, vdso_file
from aiflame.core.errors import Unreadable
from aiflame.core.raw import Mapping
from aiflame.symbolize.objfmt.cfi import (
    CFA_RBP,
    CFA_RSP,
    NOT_COVERED,
    RBP_OFFSET,
    RBP_UNCHANGED,
    ROW,
    RULE,
    CfiStats,
    Rule,
    UnwindTable,
)
from aiflame.symbolize.objfmt.cfi import fast as cfi_fast
from aiflame.symbolize.objfmt.elf import ElfFile

HANG_S = 60  # a wait that only a bug makes this long
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
    vdso: tuple[str, int] | None = None  # the vDSO's stand-in file, and its size

    def _file_of(self, pid: int, m: Mapping) -> str:
        if m.path == VDSO:
            return super()._file_of(pid, m)
        return m.path  # the file itself, not /proc/PID/map_files (no such process here)

    def _vdso(self) -> tuple[str, int] | None:
        return self.vdso


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


def make_pool(capacity: int, tables: dict[str, UnwindTable | Exception], index_entries: int = 4096,
              cached: dict[str, UnwindTable] | None = None, gates: dict[str, threading.Event] | None = None) -> Pool:
    """`cached`: the tables the on-disk cache holds (none by default); `gates`: builds that wait for their event
    (background builds held until the test lets them finish)."""
    maps = {"unwind_rows": _map("unwind_rows", capacity), "unwind_rules": _map("unwind_rules", 65536),
            "unwind_procs": _map("unwind_procs", 8192)}
    built: list[str] = []

    def table_for(path: str) -> UnwindTable:
        name = Path(os.path.realpath(path)).name  # the loader passes the open file (/proc/self/fd/N)
        if gates and name in gates:
            assert gates[name].wait(HANG_S), f"{name}'s build never let go"
        built.append(name)
        t = tables[name]
        if isinstance(t, Exception):
            raise type(t)(str(t).replace("PATH", os.path.basename(path)))  # as the CFI parsers name a file
        return t

    def cached_for(path: str) -> UnwindTable | None:
        return (cached or {}).get(Path(os.path.realpath(path)).name)

    pool = bytearray(capacity * 8)
    obj = BpfObject(progs={}, maps=dict[str, BpfMap](maps))
    uw = _Tables(obj, table_for, pool=pool, index_pool=bytearray(4 * index_entries), cached_for=cached_for)
    uw.rewant_ns = 0  # the first stop at an evicted table brings it back (test_an_evicted_table_comes_back_...)
    return Pool(uw, maps, pool, built)


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
    a_id = p.proc(1)[0].table_id
    assert a_id and p.proc(2)[0].table_id not in (0, a_id)
    p.tables.remove_process(2)  # b's table stays in the pool, unused
    p.tables.add_process(3, [mapping(files("c"), 0x3000_0000)])  # no room: b goes, not the older a
    assert p.tables.stats.evicted == 1 and p.proc(1)[0].nrows == 4 and p.proc(3)[0].first_row == 4
    p.tables.add_process(4, [mapping(files("d"), 0x4000_0000)])  # a and c both in use: a is older
    assert p.tables.stats.evicted == 2
    gone = p.proc(1)[0]
    assert (gone.first_row, gone.nrows) == (ROWS_EVICTED, 0)  # the unwinder says "evicted", walks with FP
    assert (p.proc(3)[0].first_row, p.proc(4)[0].first_row) == (4, 0)
    assert p.rows(0, 4)[0][0] == 0x4000  # d's rows where a's were
    # BPF's rule cache is tagged by table id: the rows now d's must never answer for a's id
    assert p.proc(4)[0].table_id not in (0, a_id) and gone.table_id == 0
    # Process 1 described again: a stays evicted (seeing a file mapped again does not load it: no churn) ...
    p.tables.add_process(1, [mapping(files("a"), 0x1000_0000)])
    assert p.tables.stats.loaded == 4 and p.proc(1)[0].first_row == ROWS_EVICTED and p.built == list("abcd")
    # ... until a walk stops at it: then it is loaded anew (the least recent, c, makes room) and counted again.
    p.tables.note_walk(1, (0x1000_0040,), STOP_EVICTED)
    assert p.tables.catch_up() == 1 and p.tables.catch_up() == 0
    assert p.tables.stats.loaded == 5 and p.tables.stats.evicted == 3 and p.tables.stats.reloaded == 1
    assert p.tables.stats.evicted_again == 0
    assert p.proc(1)[0].nrows == 4 and p.proc(3)[0].first_row == ROWS_EVICTED
    assert p.proc(1)[0].table_id not in (a_id, p.proc(4)[0].table_id)  # loaded anew: a new id
    assert p.built == ["a", "b", "c", "d", "a"]
    p.tables.add_process(5, [mapping(files("c"), 0x3000_0000)])  # c back on demand: d (never executed) goes
    p.tables.note_walk(5, (0x3000_0040,), STOP_EVICTED)
    assert p.tables.catch_up() == 1 and p.tables.stats.evicted_again == 0
    assert p.proc(4)[0].first_row == ROWS_EVICTED
    p.tables.note_walk(5, (0x3000_0040,), 1)  # c runs; then d is wanted back: a goes, a second time
    p.tables.note_walk(4, (0x4000_0040,), STOP_EVICTED)
    assert p.tables.catch_up() == 1 and p.tables.stats.evicted_again == 1
    assert p.proc(1)[0].first_row == ROWS_EVICTED and p.proc(5)[0].nrows == 4
    assert p.built == ["a", "b", "c", "d", "a", "c", "d"]


def test_an_evicted_table_comes_back_only_when_walks_keep_stopping_at_it(files: Callable[[str], str]) -> None:
    """Found on the CPU proxy with cuDNN mapped: one sample in libtriton's constructors at torch's import
    brought back its 2.4 M rows, which evicted 13 tables that had run, some of them twice before the steps
    began. Code run once brings nothing back: walks must stop at the table REWANT_NS apart within
    REWANT_WINDOW_NS."""
    p = make_pool(8, {n: table((R1,), 4, first_pc=0x1000 * (i + 1)) for i, n in enumerate("abc")})
    now = [10**12]
    p.tables.clock = lambda: now[0]
    p.tables.rewant_ns = REWANT_NS
    p.tables.add_process(1, [mapping(files(n), (i + 1) << 28) for i, n in enumerate("abc")])
    assert p.tables.stats.evicted == 1 and p.proc(1)[0].first_row == ROWS_EVICTED  # a: never executed, evicted
    p.tables.note_walk(1, (0x1000_0040,), STOP_EVICTED)  # the first stop at a
    now[0] += REWANT_NS // 2
    p.tables.note_walk(1, (0x1000_0040,), STOP_EVICTED)  # a burst of samples within a second: not yet
    assert p.tables.catch_up() == 0 and p.proc(1)[0].first_row == ROWS_EVICTED
    now[0] += REWANT_WINDOW_NS  # the next stop comes after the window: a first stop again
    p.tables.note_walk(1, (0x1000_0040,), STOP_EVICTED)
    assert p.tables.catch_up() == 0
    now[0] += REWANT_NS  # a second later, still stopping there: a comes back
    p.tables.note_walk(1, (0x1000_0040,), STOP_EVICTED)
    assert p.tables.catch_up() == 1 and p.proc(1)[0].nrows == 4 and p.tables.stats.reloaded == 1
    assert not p.tables._first_stops


def test_an_evicted_table_that_fits_the_free_space_comes_back_at_once(files: Callable[[str], str]) -> None:
    """Found on the same proxy: libgomp's table, evicted before OpenMP's first parallel region, kept its worker
    threads' walks short for a second (118 samples). Bringing back a table that fits the free space costs no
    other table."""
    p = make_pool(8, {"a": table((R1,), 2, first_pc=0x1000), "b": table((R1,), 4, first_pc=0x2000),
                      "c": table((R1,), 4, first_pc=0x3000)})
    p.tables.clock = lambda: 10**12  # time stands still: only the free space decides
    p.tables.rewant_ns = REWANT_NS
    p.tables.add_process(1, [mapping(files(n), (i + 1) << 28) for i, n in enumerate("abc")])
    assert p.tables.stats.evicted == 2 and p.proc(1)[2].nrows == 4  # c needed 4 rows in a row: a and b went
    p.tables.note_walk(1, (0x1000_0040,), STOP_EVICTED)  # a (2 rows) fits the 4 rows left free
    p.tables.note_walk(1, (0x2000_0040,), STOP_EVICTED)  # so does b (4 rows), but not both
    assert p.tables.catch_up() == 1 and p.proc(1)[0].nrows == 2  # a came first; b no longer fits: nothing evicted
    assert p.proc(1)[1].first_row == ROWS_EVICTED and p.proc(1)[2].nrows == 4 and p.tables.stats.evicted == 2
    p.tables.note_walk(1, (0x2000_0040,), STOP_EVICTED)  # b stays out until walks keep stopping there
    assert p.tables.catch_up() == 0 and p.proc(1)[1].first_row == ROWS_EVICTED


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
    p = make_pool(8, {"huge": table((R1,), 9), "bad": Unreadable("bad: CIE pointer outside .eh_frame"),
                      "ok": table((R1,), 3), "empty": table((R1,), 0)})
    huge, bad, ok, empty = files("huge"), files("bad"), files("ok"), files("empty")
    for pid in (1, 2):
        p.tables.add_process(pid, [mapping(huge, 0x1000_0000), mapping(bad, 0x2000_0000), mapping(ok, 0x3000_0000)])
    assert p.built == ["huge", "bad", "ok"]  # a failed file is not tried again (another process, a re-read)
    assert "do not fit the table pool" in p.tables.stats.errors[huge]
    p.tables.add_process(3, [mapping(empty, 0x4000_0000)])
    assert p.tables.stats.errors[empty] == f"{empty}: no CFI rows"  # not "its 0 rows do not fit"
    assert p.tables.stats.errors[bad] == "bad: CIE pointer outside .eh_frame"
    assert [(m.first_row, m.nrows) for m in p.proc(2)] == [(0, 0), (0, 0), (0, 3)]  # frame pointers, then rows
    assert p.tables.stats.evicted == 0  # the pool was not emptied for a table that could never fit


def test_a_file_seen_before_is_not_opened_again(files: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-reading a process's mappings (every snapshot), or a second process mapping a loaded file, costs a stat
    of the mapped file, not an ELF open; the bias is the same as when the file was opened."""
    p = make_pool(64, {"a": table((R1,), 5)})
    a = files("a")
    p.tables.add_process(1, [mapping(a, 0x5000_0000)])
    opened: list[str] = []
    real_open = ElfFile.open

    def counting_open(path: str) -> ElfFile:
        opened.append(path)
        return real_open(path)

    monkeypatch.setattr(ElfFile, "open", counting_open)
    p.tables.add_process(1, [mapping(a, 0x5000_0000)])
    p.tables.add_process(2, [mapping(a, 0x6000_0000)])
    assert opened == []
    assert [(m.bias, m.nrows) for m in p.proc(2)] == [(0x6000_0000, 5)]
    Path(a).touch()  # a changed file (new mtime) is opened again
    os.utime(a, ns=(1, 1))
    p.tables.add_process(3, [mapping(a, 0x7000_0000)])
    assert opened == [a]


def _search(addrs: list[int], shift: int, base: int, index: list[int], addr: int) -> int:
    """The BPF row search (uw_search_rule) with a page index: the last row at or below addr, -1 for none."""
    if addr < base:
        return -1
    k = (addr - base) >> shift
    lo, hi = (index[k], index[k + 1]) if k < len(index) - 1 else (len(addrs), len(addrs))
    while lo < hi:
        mid = (lo + hi) // 2
        if addrs[mid] <= addr:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@given(st.sets(st.integers(0, 1 << 24), min_size=1, max_size=300), st.lists(st.integers(0, (1 << 24) + 9000)))
def test_the_page_index_search_finds_what_a_full_search_does(pcs: set[int], probes: list[int]) -> None:
    addrs = sorted(pcs)
    rows = b"".join(ROW.pack(a, 1, 0) for a in addrs)
    paged = page_index(rows)
    assert paged is not None
    shift, base, index = paged
    npages = len(index) - 1
    assert base <= addrs[0] and npages == ((addrs[-1] - base) >> shift) + 1
    assert shift == PAGE_SHIFT or npages <= max(4 * len(addrs), 16)  # larger pages only for sparse rows
    for addr in probes + addrs + [a - 1 for a in addrs]:
        assert _search(addrs, shift, base, list(index), addr) == bisect.bisect_right(addrs, addr) - 1


def test_rows_too_dense_for_the_search_steps_get_no_index() -> None:
    dense = b"".join(ROW.pack(0x1000 + i, 1, 0) for i in range(4096))  # one row per byte of a 4 KiB page: fits
    assert page_index(dense) is not None
    assert page_index(dense + b"".join(ROW.pack(0x2000 + i, 1, 0) for i in range(4096))) is not None
    assert MAX_PAGE_ROWS >= 4096  # so no real table (at most one row per byte) is ever refused at 4 KiB pages


def test_tables_get_a_page_index_in_its_own_pool(files: Callable[[str], str]) -> None:
    """Each table's index takes npages + 1 entries of the index pool, in turn."""
    p = make_pool(2000, {"a": table((R1,), 5, first_pc=0x1000), "b": table((R2,), 600, first_pc=0x3000),
                         "c": table((R1,), 20, first_pc=0x10000)}, index_entries=16)
    for pid, name in enumerate("abc", 1):
        p.tables.add_process(pid, [mapping(files(name), 0x5000_0000)])
    index = memoryview(p.tables._index).cast("I")
    (ma,), (mb,), (mc,) = p.proc(1), p.proc(2), p.proc(3)
    assert (ma.index_first, ma.page_base, ma.npages, list(index[0:2])) == (0, 0x1000, 1, [0, 5])
    # b: rows 0x3000 ... 0x5570, 16 bytes apart: pages 0x3000, 0x4000, 0x5000 hold 256, 256 and 88 rows
    assert (mb.index_first, mb.page_base, mb.npages, list(index[2:6])) == (2, 0x3000, 3, [0, 256, 512, 600])
    assert (mc.index_first, mc.npages, mc.nrows) == (6, 1, 20)  # 8 entries left


def test_an_index_that_never_fits_leaves_the_file_to_frame_pointers(files: Callable[[str], str]) -> None:
    """Sparse rows get larger pages; a table whose index cannot fit even after evicting every other table is
    not loaded (the walker would have to search it whole), and says so."""
    wide = UnwindTable(b"".join(ROW.pack(0x1000 + 0x900 * i, 0, 0) for i in range(25)), (R1,),
                       CfiStats("eh_frame_hdr", 25, 25, 0, 25, 25, 1, 0, (), ()))  # 14 pages: 15 entries
    sparse = UnwindTable(ROW.pack(0x1000, 0, 0) + ROW.pack(0x101000, 0, 0), (R1,),
                         CfiStats("eh_frame_hdr", 2, 2, 0, 2, 2, 1, 0, (), ()))  # 257 pages of 4 KiB for 2 rows
    p = make_pool(100, {"wide": wide, "sparse": sparse}, index_entries=12)
    p.tables.add_process(1, [mapping(files("sparse"), 0x5000_0000), mapping(files("wide"), 0x6000_0000)])
    sparse_map, wide_map = p.proc(1)
    assert (sparse_map.nrows, sparse_map.page_shift, sparse_map.npages) == (2, 17, 9)  # 128 KiB pages
    assert wide_map.nrows == 0 and "do not fit" in p.tables.stats.errors[files("wide")]


def test_executed_tables_are_kept_and_evicted_ones_come_back_on_demand(files: Callable[[str], str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # a torch process maps more CFI rows than the pool holds but runs a few of its files: the executed tables
    # stay, those never executed make room, and a table that does not fit without evicting an executed one
    # waits (as if evicted) for a walk to stop at it
    names = "abcde"
    p = make_pool(12, {n: table((R1,), 4, first_pc=0x1000 * (i + 1)) for i, n in enumerate(names)})
    maps = [mapping(files(n), (i + 1) << 28) for i, n in enumerate(names)]
    p.tables.add_process(1, maps[:3])  # a, b, c fill the pool
    p.tables.note_walk(1, (0x1000_0010, 0x1000_0020, 0x3000_0010), 1)  # the walk went through a and c
    p.tables.add_process(1, maps[:4])  # d is mapped: b (never executed) makes room, not a or c
    starts = {m.start: m for m in p.proc(1)}
    assert starts[2 << 28].first_row == ROWS_EVICTED and starts[4 << 28].nrows == 4
    assert p.tables.stats.evicted == 1
    p.tables.note_walk(1, (0x4000_0010,), 1)
    p.tables.add_process(1, maps)  # e is mapped: a, c, d all executed: e is not loaded, nothing is evicted
    starts = {m.start: m for m in p.proc(1)}
    assert starts[5 << 28].first_row == ROWS_EVICTED and p.tables.stats.deferred == 1
    assert p.tables.stats.evicted == 1 and p.built == list("abcde")
    opened: list[str] = []
    real_open = ElfFile.open

    def counted_open(path: str) -> ElfFile:
        opened.append(path)
        return real_open(path)

    monkeypatch.setattr(ElfFile, "open", staticmethod(counted_open))
    for _ in range(3):  # described again and again (every library a process maps): no churn, no ELF opened
        p.tables.add_process(1, maps)
    assert p.tables.stats.evicted == 1 and p.tables.stats.loaded == 4 and opened == []
    # a walk stops at e (the leaf frame in e, its table evicted): e comes back, the least recently executed
    # table (a: its walk is the oldest) makes room, and every process mapping e is told
    p.tables.note_walk(1, (0x3000_0010,), 1)
    p.tables.note_walk(1, (0x4000_0010,), 1)
    p.tables.add_process(2, [maps[4]])
    p.tables.note_walk(1, (0x5000_0010, 0x3000_0020), STOP_EVICTED)  # stopped in the outermost frame's file
    p.tables.note_walk(1, (0x5000_0010,), 1)  # a stop elsewhere wants nothing
    assert p.tables.catch_up() == 0  # e's frame was not where the walk stopped: c's was, and c is loaded
    p.tables.note_walk(1, (0x3000_0020, 0x5000_0010), STOP_EVICTED)
    assert p.tables.catch_up() == 1
    starts = {m.start: m for m in p.proc(1)}
    assert starts[5 << 28].nrows == 4 and starts[1 << 28].first_row == ROWS_EVICTED
    assert p.proc(2)[0].nrows == 4 and p.proc(2)[0].table_id == starts[5 << 28].table_id
    assert p.tables.stats.reloaded == 1 and p.tables.stats.evicted == 2 and p.tables.stats.evicted_again == 0
    # addresses outside every mapping, unknown pids and empty walks are ignored
    p.tables.note_walk(1, (0x10, 0x9000_0000), STOP_EVICTED)
    p.tables.note_walk(99, (0x1000_0010,), STOP_EVICTED)
    p.tables.note_walk(1, (), STOP_EVICTED)
    assert p.tables.catch_up() == 0


@contextmanager
def python_engine() -> Iterator[None]:
    """The table work done without the C engine (as on a host without a compiler)."""
    saved = cfi_fast._fast_state
    s = cfi_fast._FastState()
    s.tried, s.error = True, "cc: not found"
    cfi_fast._fast_state = s
    try:
        yield
    finally:
        cfi_fast._fast_state = saved


def test_the_c_engine_is_there_for_the_pool() -> None:
    """The equivalence tests below compare C with Python: they mean something only when C is there."""
    assert cfi_fast._fast_lib() is not None, cfi_fast._fast_state.error


@given(st.sets(st.integers(0, 1 << 26), min_size=1, max_size=400))
def test_page_indexes_in_c_and_python_agree(pcs: set[int]) -> None:
    rows = b"".join(ROW.pack(a, 1, 0) for a in sorted(pcs))
    with python_engine():
        slow = page_index(rows)
    assert page_index(rows) == slow


def test_rows_renumbered_in_c_and_python_alike(files: Callable[[str], str]) -> None:
    """The pool holds each row with its global rule index, whichever engine wrote it."""
    tables = {"a": table((R1, R2), 50), "b": table((R3, R2, R1), 301, first_pc=0x2000)}
    pools = []
    for engine in (python_engine, nullcontext):
        with engine():
            p = make_pool(1000, dict(tables))
            p.tables.add_process(1, [mapping(files("a"), 0x5000_0000), mapping(files("b"), 0x6000_0000)])
            pools.append(bytes(p.pool))
    assert pools[0] == pools[1]
    p = make_pool(1000, dict(tables))
    p.tables.add_process(1, [mapping(files("a"), 0x5000_0000), mapping(files("b"), 0x6000_0000)])
    (ma, mb) = p.proc(1)
    rules = {pc: rule for pc, rule in p.rows(ma.first_row, ma.nrows) + p.rows(mb.first_row, mb.nrows)}
    # R2 is one global rule in both files; a's row 1 and b's row 1 hold it
    assert rules[0x1010] == rules[0x2010] != rules[0x1000]


def test_the_vdso_gets_a_table_from_our_own_copy(tmp_path: Path) -> None:
    """A target's [vdso] is described with the table of the agent's own vDSO image when the sizes agree (the
    same kernel maps the same image); of another size (a 32-bit process) it stays undescribed, with no error."""
    found = vdso_file(str(tmp_path / "cache"))
    assert found is not None, "this kernel maps a vDSO into every process"
    path, size = found
    assert Path(path).read_bytes() == own_vdso() and oct(os.stat(Path(path).parent).st_mode & 0o777) == "0o700"
    assert vdso_file(str(tmp_path / "cache")) == found  # written once, by its content's name
    p = make_pool(100, {Path(path).name: table((R1, R2), 7)})
    assert isinstance(p.tables, _Tables)
    p.tables.vdso = found
    p.tables.add_process(1, [Mapping(0x7FFF_0000, 0x7FFF_0000 + size, 0, VDSO, perms="r-xp")])
    p.tables.add_process(2, [Mapping(0x7FFF_0000, 0x7FFF_0000 + 2 * size, 0, VDSO, perms="r-xp")])
    (m,) = p.proc(1)
    assert (m.start, m.bias, m.nrows) == (0x7FFF_0000, 0x7FFF_0000, 7)  # the image's addresses start at 0
    assert p.proc(2) == [] and not p.tables.stats.errors


def _caught_up(p: Pool, n: int) -> None:
    """catch_up until it has stored `n` tables built in the background."""
    deadline, got = time.monotonic() + HANG_S, 0
    while got < n:
        assert time.monotonic() < deadline, f"{got} of {n} background builds stored"
        got += p.tables.catch_up()
        time.sleep(0.005)


def test_a_large_table_not_cached_is_built_in_the_background_while_its_target_is_held(
        files: Callable[[str], str]) -> None:
    gate = threading.Event()
    p = make_pool(64, {"small": table((R1,), 3), "big": table((R2,), 5, first_pc=0x2000),
                       "bad": Unreadable("PATH: CIE pointer outside .eh_frame"), "later": table((R1,), 4)},
                  cached={"hot": table((R3,), 2)}, gates={"big": gate})
    try:
        _background_builds(p, gate, files)
    finally:
        gate.set()
        p.tables.close()


def _background_builds(p: Pool, gate: threading.Event, files: Callable[[str], str]) -> None:
    small, big, hot, bad, later = files("small"), files("big"), files("hot"), files("bad"), files("later")
    with ElfFile.open(small) as elf:
        eh = elf.section(".eh_frame")
    assert eh is not None and 0 < eh.size < DEFER_BYTES  # every file here is a copy of /usr/bin/true
    maps = [mapping(small, 0x1000_0000), mapping(big, 0x2000_0000)]
    # Not held stopped: built at once, whatever the size.
    p.tables.defer_bytes = 1
    p.tables.add_process(1, [mapping(later, 0x5000_0000)])
    assert p.built == ["later"] and p.tables.stats.background == 0
    # Held: a table under the threshold is built at once; one at or over it, not cached, in the background: the
    # call returns with the build still waiting, its mapping walked as code without CFI meanwhile.
    p.tables.defer_bytes = eh.size + 1
    p.tables.add_process(1, maps[:1], stopped=True)
    assert p.built == ["later", "small"]
    p.tables.defer_bytes = eh.size
    p.tables.add_process(1, maps, stopped=True)
    assert p.tables.stats.background == 1 and p.built == ["later", "small"]
    assert [(m.first_row == ROWS_PENDING, m.nrows) for m in p.proc(1)] == [(False, 3), (True, 0)]
    assert p.tables.catch_up() == 0 and p.tables.building  # the daemon drains often meanwhile
    # Seen again while it builds (another process, a re-read of the maps): not built twice.
    p.tables.add_process(2, [mapping(big, 0x3000_0000)], stopped=True)
    p.tables.add_process(1, maps)
    assert p.tables.stats.background == 1 and [(m.first_row, m.nrows) for m in p.proc(2)] == [(ROWS_PENDING, 0)]
    gate.set()
    _caught_up(p, 1)
    assert p.built == ["later", "small", "big"] and not p.tables.building
    ma, mb = p.proc(1)
    assert (ma.nrows, mb.nrows) == (3, 5) and [p.rule(r) for _, r in p.rows(mb.first_row, 5)] == [R2] * 5
    assert [m.nrows for m in p.proc(2)] == [5]  # every process mapping it is told
    # Cached: read at once, never built; a background build that fails leaves its file to frame pointers, with
    # its error under the file's own name (not the descriptor the build read).
    p.tables.add_process(3, [mapping(hot, 0x4000_0000), mapping(bad, 0x6000_0000)], stopped=True)
    assert [m.nrows for m in p.proc(3)] == [2, 0] and "hot" not in p.built
    assert p.proc(3)[1].first_row == ROWS_PENDING
    deadline = time.monotonic() + HANG_S
    while bad not in p.tables.stats.errors:
        assert time.monotonic() < deadline, "the failed build was never noted"
        p.tables.catch_up()
        time.sleep(0.005)
    assert p.tables.stats.errors[bad] == f"{bad}: CIE pointer outside .eh_frame"
    assert (p.proc(3)[1].first_row, p.proc(3)[1].nrows) == (0, 0)
    p.tables.add_process(3, [mapping(bad, 0x6000_0000)], stopped=True)
    assert p.built.count("bad") == 1 and p.tables.stats.background == 2  # not tried again


def test_background_builds_in_flight_are_bounded(files: Callable[[str], str]) -> None:
    # a target opening many large libraries at once: past MAX_BACKGROUND builds in flight (each holding its file
    # open), the next is built during the stop as before
    gate = threading.Event()
    names = [f"lib{i}" for i in range(MAX_BACKGROUND + 1)]
    p = make_pool(4096, {n: table((R1,), 3) for n in names}, gates={n: gate for n in names})
    p.tables.defer_bytes = 1
    try:
        for i, n in enumerate(names[:-1]):
            p.tables.add_process(i + 1, [mapping(files(n), 0x1000_0000)], stopped=True)
        assert p.tables.stats.background == MAX_BACKGROUND and p.built == []
        gate.set()  # the last one is built at once, in this thread: its gate must let it go
        p.tables.add_process(99, [mapping(files(names[-1]), 0x1000_0000)], stopped=True)
        assert p.tables.stats.background == MAX_BACKGROUND and [m.nrows for m in p.proc(99)] == [3]
        _caught_up(p, MAX_BACKGROUND)
    finally:
        gate.set()
        p.tables.close()
