"""The BPF unwinder's tables (bpf/unwind.h): one pool of CFI rows shared by every process, rules deduplicated
across files, and each target's executable mappings. Runs in the agent when a process's mappings are read, never
on the sampling path. A file's table is built (or read from the on-disk cache) once and written into the pool
once, however many processes map it. A CUDA torch process maps more CFI rows than the pool holds (8.1 M rows for
~90 files, bench/torch_tables.py) but executes a fraction of them: walks tell which tables are executed
(note_walk), and when the pool is full the tables never executed go first, then the least recently executed.
An evicted table is not loaded again when its file is seen mapped again, only when a walk stops at it (its
processes' mappings walk with frame pointers meanwhile, and samples say so): a steady job does not churn. While a
target is held stopped (a probe's stop at a library open), a large table not in the on-disk cache is built in a
background thread, the target continued, and the table stored by the next catch_up: its mapping walks as code
without CFI meanwhile (frame pointers, else a scan for the return address). A file whose CFI cannot be read
falls back to frame pointers alone, with its error kept once for the summary and `doctor`.

Over 400 lines on purpose: the row pool, the shared rule table and each process's mappings are one state
(UnwindTables) that loading, eviction and the walks' feedback change together; apart, each would reach into the
others."""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import struct
import time
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise

from aiflame.agent.kernel.bpf_object import BpfObject
from aiflame.agent.kernel.vdso import vdso_file
from aiflame.core.errors import AiflameError, TargetGone
from aiflame.core.raw import Mapping
from aiflame.symbolize.objfmt.cfi import NOT_COVERED, RULE, Rule, UnwindTable, load_cached, load_or_build
from aiflame.symbolize.objfmt.cfi.fast import page_starts, renumber_rules
from aiflame.symbolize.objfmt.elf import ElfFile

log = logging.getLogger(__name__)

MAX_MAPS = 256  # AIFLAME_UNWIND_MAPS
MAX_RULES = 65536  # AIFLAME_UNWIND_RULES
ROWS_EVICTED = 0xFFFFFFFF  # UW_ROWS_EVICTED
ROWS_JIT = 0xFFFFFFFE  # UW_ROWS_JIT
ROWS_PENDING = 0xFFFFFFFD  # UW_ROWS_PENDING: a table being built
JIT = "[jit]"  # the key of anonymous executable memory: no table, scanned past in BPF
VDSO = "[vdso]"  # the kernel's vDSO mapping: its table is read from our own copy (agent/kernel/vdso.py)
STOP_EVICTED = 8  # UW_STOP_EVICTED (core/unwind.STOPS)
REWANT_NS = 1_000_000_000  # an evicted table comes back once walks stopped at it this long apart ...
REWANT_WINDOW_NS = 10_000_000_000  # ... within this long (a first stop older than that counts no more)
# at a stop, a table not cached whose .eh_frame is this large or larger is built in the background: ~30 ms of the
# C engine's build per MiB, 0.5 s for libtorch_cpu's 17 MiB
DEFER_BYTES = 1 << 20
# background builds in flight at most (each holds its file open): past them, built during the stop, so a target
# opening thousands of large libraries cannot run the agent out of descriptors
MAX_BACKGROUND = 16
# struct unwind_map: start, end, bias, first_row, nrows, index_first, page_base, npages, page_shift, table_id, pad
_MAP = struct.Struct("<QQQIIIIIIII")
PAGE_SHIFT = 12  # a page index has one entry per 4 KiB of a file's code, or per larger page where that is sparse
MAX_PAGE_ROWS = (1 << 13) - 1  # AIFLAME_ROW_STEPS (13) binary-search steps find a row among this many
_PROC_HEAD = struct.Struct("<II")  # n, flags
_U32 = struct.Struct("<I")



class UnwindMap(ctypes.Structure):
    """Mirror of struct unwind_map (a test checks it against the C layout)."""

    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("bias", ctypes.c_uint64),
                ("first_row", ctypes.c_uint32), ("nrows", ctypes.c_uint32), ("index_first", ctypes.c_uint32),
                ("page_base", ctypes.c_uint32), ("npages", ctypes.c_uint32), ("page_shift", ctypes.c_uint32),
                ("table_id", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


class UnwindProc(ctypes.Structure):
    """Mirror of struct unwind_proc."""

    _fields_ = [("n", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("m", UnwindMap * MAX_MAPS)]


@dataclass
class _Loaded:
    """A table in the pools: its rows, and its page index (npages + 1 entries of pages of 1 << page_shift bytes
    from ELF address page_base)."""

    first: int
    nrows: int
    index_first: int
    page_base: int
    npages: int
    page_shift: int
    table_id: int  # never reused: BPF's cached rows of an evicted table can never match another's
    users: set[int] = field(default_factory=set)
    used_ns: int = 0  # when a process was last seen mapping it
    ran_ns: int = 0  # when a walk last went through it (0: never)


class _FreeList:
    """First-fit allocation of slot ranges in a fixed pool."""

    def __init__(self, capacity: int) -> None:
        self.free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # (start, length), by start

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i:i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def release(self, start: int, n: int) -> None:
        self.free.append((start, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, ln in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((s, ln))
        self.free = merged


def page_index(rows: bytes) -> tuple[int, int, array[int]] | None:
    """(page shift, ELF address of page 0, the index of the first row at or above each page's start for npages + 1
    pages): the rows of page k are [index[k], index[k + 1]), so the walker searches those few instead of all.
    Pages are 4 KiB, larger where the rows are sparse (at most 4 pages per row, or 16); None when some page would
    hold more rows than the walker's search steps cover."""
    addrs = memoryview(rows).cast("I")[0::2]
    first, last = addrs[0], addrs[-1]
    for shift in range(PAGE_SHIFT, 32):  # at 31 a u32 address space is 2 pages
        base = first & ~((1 << shift) - 1)
        npages = ((last - base) >> shift) + 1
        if npages > max(4 * len(addrs), 16):
            continue
        fast = page_starts(rows, base, shift, npages)
        if fast is not None:
            index, most = fast
        else:
            pcs = array("I", addrs)
            index = array("I", (bisect.bisect_left(pcs, base + (k << shift)) for k in range(npages + 1)))
            most = max(b - a for a, b in pairwise(index))
        if most > MAX_PAGE_ROWS:
            return None  # larger pages only hold more
        return shift, base, index
    return None


@dataclass
class UnwindStats:
    tables: int = 0  # tables in the pool now
    rows_used: int = 0
    rows_capacity: int = 0
    loaded: int = 0  # tables written into the pool (a table evicted and loaded again counts twice)
    evicted: int = 0
    reloaded: int = 0  # evicted tables loaded again because a walk stopped at them
    deferred: int = 0  # tables not loaded when first mapped (executed tables filled the pool): loaded on demand
    background: int = 0  # builds started in the background while their target ran on (not cached, at a stop)
    evicted_again: int = 0  # evictions of a table evicted before (churn: none in a steady job)
    build_s: float = 0.0  # time spent building or reading tables
    errors: dict[str, str] = field(default_factory=dict)  # file -> why it has no table


class UnwindTables:
    """Fills unwind_rows, unwind_rules and unwind_procs of a loaded sampler."""

    def __init__(self, obj: BpfObject, table_for: Callable[[str], UnwindTable] = load_or_build,
                 pool: bytearray | None = None, index_pool: bytearray | None = None,
                 cached_for: Callable[[str], UnwindTable | None] = load_cached) -> None:
        """`table_for`: a file's table, from the cache or built; `cached_for`: from the cache only (None if it is
        not there). `pool`, `index_pool`: the row pool's and page index's memory (tests); by default the
        unwind_rows and unwind_index maps, mmapped."""
        self._rows_map = obj.maps["unwind_rows"]
        self._rules_map = obj.maps["unwind_rules"]
        self._procs = obj.maps["unwind_procs"]
        self._table_for = table_for
        self._cached_for = cached_for
        self.defer_bytes = DEFER_BYTES
        # key -> its build, a mapping of it, the path the build reads (for its errors), when it was asked for
        self._building: dict[str, tuple[Future[UnwindTable], Mapping, str, float]] = {}
        self._builder: ThreadPoolExecutor | None = None
        self.capacity = self._rows_map.max_entries
        self._pool: mmap.mmap | bytearray = pool if pool is not None else mmap.mmap(
            self._rows_map.fd, self.capacity * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # unwind_index: u64 values holding two u32 entries each (bpf/walk.h), a plain u32 array here
        self._index: mmap.mmap | bytearray = index_pool if index_pool is not None else mmap.mmap(
            obj.maps["unwind_index"].fd, obj.maps["unwind_index"].max_entries * 8, mmap.MAP_SHARED,
            mmap.PROT_READ | mmap.PROT_WRITE)
        self._last_id = 0  # table ids given so far
        self._index_capacity = len(self._index) // 4
        self._index_free = _FreeList(self._index_capacity)
        self._rules: dict[Rule, int] = {NOT_COVERED: 0}
        self._rules_map.update(_U32.pack(0), RULE.pack(*NOT_COVERED))
        self._files: dict[str, _Loaded] = {}
        self._free = _FreeList(self.capacity)
        self._proc_keys: dict[int, list[tuple[Mapping, str]]] = {}  # pid -> its mappings and their file keys
        self._bias: dict[tuple[int, int], int] = {}  # (pid, mapping start) -> runtime minus ELF address
        self._evicted: set[str] = set()
        self._evicted_ever: set[str] = set()
        # (dev, inode, size, mtime) of a file -> its table key and the ELF address of each file offset mapped
        self._seen: dict[tuple[int, int, int, int], tuple[str, dict[int, int]]] = {}
        self._failed: set[str] = set()  # keys of files whose table could not be built or stored: not tried again
        self._starts: dict[int, list[int]] = {}  # pid -> its mappings' starts, as _proc_keys orders them
        self._wanted: dict[str, tuple[int, Mapping]] = {}  # evicted tables a walk stopped at -> a mapping of them
        self._first_stops: dict[str, int] = {}  # evicted tables -> when a walk first stopped at them (clock ns)
        self._evicted_size: dict[str, tuple[int, int]] = {}  # evicted or deferred tables -> (rows, index entries)
        self._wanted_if_fits: set[str] = set()  # of _wanted, those that come back only if they still fit
        self.rewant_ns = REWANT_NS  # tests set 0: the first stop at an evicted table brings it back
        self.clock = time.monotonic_ns
        self._vdso_file: tuple[str, int] | None = None
        self._vdso_looked = False
        self.stats = UnwindStats(rows_capacity=self.capacity)

    @property
    def building(self) -> bool:
        """Whether tables are being built in the background (catch_up stores them)."""
        return bool(self._building)

    def close(self) -> None:
        if self._builder is not None:  # builds queued go on (each closes its file): their tables fill the cache
            self._builder.shutdown(wait=False)
        for pool in (self._pool, self._index):
            if isinstance(pool, mmap.mmap):
                pool.close()

    # --- processes ----------------------------------------------------------------------------------------

    def add_process(self, pid: int, mappings: Iterable[Mapping], stopped: bool = False) -> None:
        """(Re)describe `pid`'s executable mappings to BPF, loading the tables of files seen first; with
        `stopped` (the target waits for this), large tables not in the cache are built in the background."""
        entries: list[tuple[Mapping, str]] = []
        jit: list[tuple[Mapping, str]] = []
        for m in sorted(mappings, key=lambda m: m.start):
            if "x" not in m.perms or len(entries) >= MAX_MAPS:
                continue
            if m.path.startswith("/"):
                entries.append((m, self._load(pid, m, stopped=stopped)))
            elif m.path == VDSO and (key := self._load(pid, m)):
                entries.append((m, key))
            elif _is_jit(m.path):
                jit.append((m, JIT))
        # JIT regions as room allows after the files (a JIT-heavy process has many); the list is sorted by start
        entries = sorted(entries + jit[:MAX_MAPS - len(entries)], key=lambda e: e[0].start)
        old = self._proc_keys.get(pid, [])
        for _, key in old:
            if key in self._files:
                self._files[key].users.discard(pid)
        for _, key in entries:
            if key in self._files:
                self._files[key].users.add(pid)
        self._proc_keys[pid] = entries
        self._starts[pid] = [m.start for m, _ in entries]
        self._write_proc(pid)

    def remove_process(self, pid: int) -> None:
        self._starts.pop(pid, None)
        for m, key in self._proc_keys.pop(pid, []):
            self._bias.pop((pid, m.start), None)
            if key in self._files:
                self._files[key].users.discard(pid)
        self._procs.delete(_U32.pack(pid))

    def _write_proc(self, pid: int) -> None:
        entries = self._proc_keys.get(pid, [])
        proc = bytearray(ctypes.sizeof(UnwindProc))
        _PROC_HEAD.pack_into(proc, 0, len(entries), 0)
        for i, (m, key) in enumerate(entries):
            bias, loaded = self._bias.get((pid, m.start), 0), self._files.get(key)
            if loaded:
                first, nrows = loaded.first, loaded.nrows
                index = (loaded.index_first, loaded.page_base, loaded.npages, loaded.page_shift, loaded.table_id, 0)
            else:
                # an evicted table: the mapping walks with frame pointers meanwhile; one being built: as code
                # without CFI, frame pointers else a scan (a library's constructors run while it builds)
                first = ROWS_JIT if key == JIT else ROWS_PENDING if key in self._building else \
                    ROWS_EVICTED if key in self._evicted else 0
                nrows, index = 0, (0, 0, 0, 0, 0, 0)
            _MAP.pack_into(proc, _PROC_HEAD.size + i * _MAP.size, m.start, m.end, bias & (1 << 64) - 1, first, nrows,
                           *index)
        self._procs.update(_U32.pack(pid), bytes(proc))

    # --- tables -------------------------------------------------------------------------------------------

    def _load(self, pid: int, m: Mapping, reload: bool = False, stopped: bool = False) -> str:
        """The key of `m`'s file table, loading it into the pool if needed ("" for a file without one). The file
        is the one mapped (map_files); a file seen before (same device, inode, size and mtime) with its table
        still loaded, or evicted (`reload`: load it again), costs one stat, not an ELF open (a torch process
        maps ~100 of them, re-read at each snapshot)."""
        path = self._file_of(pid, m)
        if not path:
            return ""
        try:
            st = os.stat(path)
        except OSError as e:
            self.stats.errors.setdefault(m.path, str(e).replace(path, m.path))
            return ""
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        seen = self._seen.get(ident)
        if seen is not None and m.file_offset in seen[1] and (seen[0] in self._files or seen[0] in self._building
                                                              or (seen[0] in self._evicted and not reload)):
            key, vaddrs = seen  # loaded, being built, or evicted and left so until a walk wants it: no ELF open
            self._bias[(pid, m.start)] = m.start - vaddrs[m.file_offset]
            if key in self._files:
                self._files[key].used_ns = time.monotonic_ns()
            return key
        try:
            elf = ElfFile.open(path)
        except (AiflameError, OSError) as e:
            self.stats.errors.setdefault(m.path, str(e).replace(path, m.path))
            return ""
        with elf:
            key = self._load_open(pid, m, elf, path, reload, stopped)
        if key:  # _load_open has set the bias
            self._seen.setdefault(ident, (key, {}))[1][m.file_offset] = m.start - self._bias[(pid, m.start)]
        return key

    def _load_open(self, pid: int, m: Mapping, elf: ElfFile, path: str, reload: bool = False,
                   stopped: bool = False) -> str:
        try:
            vaddr = elf.file_offset_to_vaddr(m.file_offset)
            st = os.stat(elf.fd_path)
        except (AiflameError, OSError) as e:
            self.stats.errors.setdefault(m.path, str(e).replace(path, m.path))
            return ""
        if vaddr is None:
            self.stats.errors.setdefault(m.path, f"{m.path}: mapping offset {m.file_offset:#x} outside its segments")
            return ""
        self._bias[(pid, m.start)] = m.start - vaddr
        key = m.build_id or f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        loaded = self._files.get(key)
        if loaded is not None:
            loaded.used_ns = time.monotonic_ns()
            return key
        if key in self._failed:
            return ""
        if key in self._evicted and not reload:
            return key  # back when a walk stops at it (note_walk)
        if key in self._building:
            return key  # stored by catch_up once built
        t0 = time.perf_counter()
        try:
            table = self._table_now(key, elf, m, stopped)
        except (AiflameError, OSError) as e:
            self.stats.errors[m.path] = _named(str(e), elf.fd_path, m.path).replace(path, m.path)
            self._failed.add(key)
            return ""
        finally:
            self.stats.build_s += time.perf_counter() - t0
        return key if table is None else self._place(key, table, m, reload)

    def _table_now(self, key: str, elf: ElfFile, m: Mapping, stopped: bool) -> UnwindTable | None:
        """`elf`'s table; None when it is built in the background instead: a target is held stopped for this
        (`stopped`) and the table is large and not in the cache."""
        eh = elf.section(".eh_frame") if stopped and len(self._building) < MAX_BACKGROUND else None
        if eh is None or eh.size < self.defer_bytes:
            return self._table_for(elf.fd_path)
        table = self._cached_for(elf.fd_path)
        if table is not None:
            return table
        if self._builder is None:
            self._builder = ThreadPoolExecutor(1, thread_name_prefix="aiflame-cfi")
        fd = os.open(elf.fd_path, os.O_RDONLY | os.O_CLOEXEC)  # the file itself, whatever its path becomes
        try:
            self._building[key] = (self._builder.submit(self._build_fd, fd), m, f"/proc/self/fd/{fd}",
                                   time.monotonic())
        except BaseException:
            os.close(fd)
            raise
        self.stats.background += 1
        return None

    def _build_fd(self, fd: int) -> UnwindTable:
        """A background build (the table pools are the main thread's alone)."""
        try:
            return self._table_for(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)

    def _place(self, key: str, table: UnwindTable, m: Mapping, reload: bool) -> str:
        """Store `key`'s `table`; its key, or "" when it can never be stored."""
        if not self._store(key, table, evict_executed=reload):
            if 0 < len(table) <= self.capacity and not self._over_limits(table):
                # executed tables fill the pool: this one waits, as if evicted, for a walk to stop at it
                self._evicted.add(key)  # _store noted its size
                self.stats.deferred += 1
                return key
            why = "no CFI rows" if not len(table) else f"its {len(table)} CFI rows do not fit the table pool"
            self.stats.errors.setdefault(m.path, f"{m.path}: {why}")
            self._failed.add(key)
            return ""
        return key

    # --- what is executed ---------------------------------------------------------------------------------

    def note_walk(self, pid: int, user: tuple[int, ...], stop: int) -> None:
        """A walk of `pid` went through `user` (leaf first) and ended with UW_STOP_* `stop`: its tables are
        executed now; one it stopped at because it was evicted is wanted back (catch_up loads it) at once if it
        fits the pools' free space, else once walks have stopped at it for `rewant_ns` (within
        REWANT_WINDOW_NS): code run once, as a library's constructors at an import, evicts nothing to come back
        (one such sample in libtriton's 2.4 M rows evicted 13 executed tables)."""
        starts, entries = self._starts.get(pid), self._proc_keys.get(pid)
        if not starts or not entries or not user:
            return
        now = self.clock()
        lo = hi = 0
        i = -1
        for pc in user:
            if not lo <= pc < hi:  # consecutive frames are mostly in one file: one search per file change
                i = bisect.bisect_right(starts, pc) - 1
                if i < 0 or pc >= entries[i][0].end:
                    lo = hi = 0
                    i = -1
                    continue
                lo, hi = entries[i][0].start, entries[i][0].end
                loaded = self._files.get(entries[i][1])
                if loaded is not None:
                    loaded.ran_ns = now
        if stop == STOP_EVICTED and i >= 0:
            m, key = entries[i]
            if key in self._evicted and key not in self._files:
                first = self._first_stops.get(key)
                if first is None or now - first > REWANT_WINDOW_NS:
                    first = self._first_stops[key] = now
                if now - first >= self.rewant_ns:
                    self._wanted.setdefault(key, (pid, m))
                    self._wanted_if_fits.discard(key)
                elif key not in self._wanted and self._fits(key):
                    self._wanted[key] = (pid, m)
                    self._wanted_if_fits.add(key)  # catch_up looks again: others may have taken the room since

    def _fits(self, key: str) -> bool:
        """Whether evicted table `key` would come back without evicting another."""
        size = self._evicted_size.get(key)
        return size is not None and any(n >= size[0] for _, n in self._free.free) and \
            any(n >= size[1] for _, n in self._index_free.free)

    def catch_up(self) -> int:
        """Store the tables built in the background since the last call, and load the evicted tables walks
        stopped at (evicting what ran least recently); returns how many were loaded."""
        n = self._built()
        wanted, self._wanted = self._wanted, {}
        if_fits, self._wanted_if_fits = self._wanted_if_fits, set()
        for key, (pid, m) in wanted.items():
            if pid not in self._proc_keys or key in self._files or (key in if_fits and not self._fits(key)):
                continue
            if self._load(pid, m, reload=True) == key and key in self._files:
                n += 1
                self.stats.reloaded += 1
                users = self._users_of(key)
                self._files[key].users = users
                for user in sorted(users):
                    self._write_proc(user)
        return n

    def _users_of(self, key: str) -> set[int]:
        """The processes that map table `key`'s file."""
        return {p for p, ents in self._proc_keys.items() if any(k == key for _, k in ents)}

    def _built(self) -> int:
        """Store the background builds that are done; how many were stored."""
        n = 0
        for key, (build, m, read, asked) in list(self._building.items()):
            if not build.done():
                continue
            del self._building[key]
            users = self._users_of(key)
            try:
                table = build.result()
                if self._place(key, table, m, False) == key and key in self._files:
                    self._files[key].users = users
                    n += 1
                    log.info("unwind table of %s built in the background: %d rows, stored %.2f s after it was "
                             "asked for", m.path, len(table), time.monotonic() - asked)
            except (AiflameError, OSError) as e:
                self.stats.errors[m.path] = _named(str(e), read, m.path)
                self._failed.add(key)
            finally:  # stored, deferred or failed: no longer walked as being built
                for user in sorted(users):
                    self._write_proc(user)
        return n

    def _file_of(self, pid: int, m: Mapping) -> str:
        """Where `m`'s file is read: through the process, so it is the file mapped even if replaced on disk. The
        vDSO from our own copy ("" when we have none, or the target's differs in size: a 32-bit process)."""
        if m.path == VDSO:
            vdso = self._vdso()
            return vdso[0] if vdso is not None and vdso[1] == m.end - m.start else ""
        return f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"

    def _vdso(self) -> tuple[str, int] | None:
        """This kernel's vDSO as a file and its size (agent/kernel/vdso.py), looked for once."""
        if not self._vdso_looked:
            self._vdso_looked, self._vdso_file = True, vdso_file()
        return self._vdso_file

    def _over_limits(self, table: UnwindTable) -> bool:
        """Whether `table` could never be stored, however empty the pools (its page index or its rules)."""
        paged = page_index(table.rows)
        return paged is None or len(paged[2]) > self._index_capacity or \
            len(self._rules) + len(set(table.rules) - self._rules.keys()) > MAX_RULES

    def _store(self, key: str, table: UnwindTable, evict_executed: bool = True) -> bool:
        """Write `table` into the pools, evicting others as needed (with not `evict_executed`, only tables no
        walk has gone through); False when it does not fit."""
        n = len(table)
        if n == 0 or n > self.capacity:
            return False
        paged = page_index(table.rows)
        if paged is None or len(paged[2]) > self._index_capacity:
            return False
        shift, base, index = paged
        self._evicted_size[key] = (n, len(index))  # while it is out of the pools: what it would take back
        index_at = self._alloc(self._index_free, len(index), evict_executed)
        if index_at is None:
            return False
        first = self._alloc(self._free, n, evict_executed)
        rules = self._global_rules(table.rules) if first is not None else None
        if first is None or rules is None:
            if first is not None:
                self._free.release(first, n)
            self._index_free.release(index_at, len(index))
            return False
        # rows are <IHH> (pc, local rule, 0); BPF wants u64 pc | global rule << 32, the same bytes with the
        # rule index renumbered
        out = bytearray(table.rows)
        done = renumber_rules(out, array("H", rules))
        if done is None:  # no C engine
            local = memoryview(table.rows).cast("H")
            view = memoryview(out).cast("H")
            view[2::4] = array("H", map(rules.__getitem__, local[2::4]))
        elif not done:  # a rule index past the table's rules: cannot be, the rows were checked
            self._free.release(first, n)
            self._index_free.release(index_at, len(index))
            return False
        self._pool[first * 8:(first + n) * 8] = out
        self._index[index_at * 4:(index_at + len(index)) * 4] = index.tobytes()
        self._last_id = self._last_id % 0xFFFFFFFF + 1
        self._files[key] = _Loaded(first, n, index_at, base, len(index) - 1, shift, self._last_id,
                                   used_ns=time.monotonic_ns())
        self._evicted.discard(key)
        self._first_stops.pop(key, None)
        self._evicted_size.pop(key, None)
        self.stats.loaded += 1
        self._update_stats()
        return True

    def _global_rules(self, rules: tuple[Rule, ...]) -> list[int] | None:
        out = []
        for r in rules:
            idx = self._rules.get(r)
            if idx is None:
                if len(self._rules) >= MAX_RULES:
                    return None
                idx = len(self._rules)
                self._rules[r] = idx
                self._rules_map.update(_U32.pack(idx), RULE.pack(*r))
            out.append(idx)
        return out

    def _alloc(self, pool: _FreeList, n: int, evict_executed: bool = True) -> int | None:
        """`n` slots of the row pool or the index pool, evicting tables until they fit (None: they never do)."""
        while True:
            start = pool.alloc(n)
            if start is not None:
                return start
            if not self._evict_one(evict_executed):
                return None

    def _evict_one(self, evict_executed: bool = True) -> bool:
        """Evict the table executed least recently (never, first), preferring those no live process maps."""
        if not self._files:
            return False
        # never executed first, then the least recently executed; among equals, those no process maps
        key = min(self._files, key=lambda k: (self._files[k].ran_ns, bool(self._files[k].users),
                                              self._files[k].used_ns))
        if self._files[key].ran_ns and not evict_executed:
            return False
        loaded = self._files.pop(key)
        self._free.release(loaded.first, loaded.nrows)
        self._index_free.release(loaded.index_first, loaded.npages + 1)
        if key in self._evicted_ever:
            self.stats.evicted_again += 1
        self._evicted.add(key)
        self._evicted_ever.add(key)
        self._evicted_size[key] = (loaded.nrows, loaded.npages + 1)
        self.stats.evicted += 1
        for pid in sorted(loaded.users):
            self._write_proc(pid)
        self._update_stats()
        log.info("unwind table evicted (%d rows, %d processes map it)", loaded.nrows, len(loaded.users))
        return True

    def _update_stats(self) -> None:
        self.stats.tables = len(self._files)
        self.stats.rows_used = sum(f.nrows for f in self._files.values())


@dataclass(frozen=True)
class Coverage:
    """How much of one mapped file the CFI unwinder can walk (`aiflame doctor --pid`)."""

    path: str
    text_bytes: int  # executable bytes mapped
    covered_bytes: int  # of the file's code, inside FDEs
    rows: int
    rules_followable: float  # share of the covered rows whose CFA rule BPF follows (not INVALID)
    error: str = ""


def _named(error: str, read: str, path: str) -> str:
    """`error` of a table read through `read` (/proc/self/fd/N: the file's parsers name it "N"), naming `path`."""
    base = os.path.basename(read)
    if error.startswith(base + ":"):
        error = path + error[len(base):]
    return error.replace(read, path)


def _is_jit(path: str) -> bool:
    """Anonymous executable memory (no path, or one named with prctl PR_SET_VMA_ANON_NAME), not the kernel's
    special pages: [uprobes] must stay unmapped to the walk, which recognizes the uretprobe trampoline so."""
    return path == "" or path.startswith("[anon:")


def coverage(pid: int) -> list[Coverage]:
    """Per executable file mapping of `pid`: CFI coverage, rows and what cannot be followed. Builds (or reads
    from the cache) each table, as the sampler would."""
    from aiflame.agent.procmaps import read_maps
    from aiflame.symbolize.objfmt import cfi

    maps = read_maps(pid)
    if maps is None:
        raise TargetGone(f"no process {pid}")
    out: list[Coverage] = []
    seen: set[str] = set()
    for lo, hi, perms, _off, _dev, inode, path in maps:
        if "x" not in perms or not path.startswith("/") or not inode or path in seen:
            continue
        seen.add(path)
        text = sum(h - lo_ for lo_, h, p, _o, _d, _i, q in maps if q == path and "x" in p)
        try:
            table = cfi.load_or_build(f"/proc/{pid}/map_files/{lo:x}-{hi:x}")
        except (AiflameError, OSError) as e:
            out.append(Coverage(path, text, 0, 0, 0.0, str(e).replace(f"/proc/{pid}/map_files/{lo:x}-{hi:x}", path)))
            continue
        st = table.stats
        covered_rows = max(st.rows - st.cfa_kinds[cfi.CFA_NONE], 1)  # gap markers end FDEs; they are not rules
        out.append(Coverage(path, text, st.covered_bytes, st.rows, 1.0 - st.cfa_kinds[cfi.CFA_INVALID] / covered_rows))
    return out
