"""Native symbolization: file offsets inside an ELF binary -> Frames (function, source file, line).

For each binary the symbolizer finds the best sources it can: the binary itself under `root` (used only if its
build id matches the one recorded at capture time), and its separate debug file (by build id or debuglink).
Function names come from all of their symbol tables (the debug file's, the binary's .symtab and .dynsym, and
its MiniDebugInfo when there is no debug file), source lines from whichever has DWARF. Results are kept in
memory and in an on-disk cache keyed by build id, so symbolizing the same binary again, even in a new process,
parses no ELF or DWARF at all.

Nothing is ever dropped, and every offset gets a name: what no symbol covers is `module+0xOFFSET`, of kind
UNKNOWN, where OFFSET is the file offset of the start of the function holding it as the binary's unwind table
(.eh_frame_hdr) lists it, or the offset itself when the binary has no such table or cannot be read. All
samples in one unnamed function so share one frame.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from aiflame.core.errors import Unreadable
from aiflame.core.model import Frame, FrameKind
from aiflame.symbolize.cache import CachedSymbols, Entry, SymbolCache
from aiflame.symbolize.objfmt.debugfiles import SYSTEM_DEBUG_DIRS, build_id_path, find_debug_file
from aiflame.symbolize.objfmt.demangle import demangle, is_mangled, short_name
from aiflame.symbolize.objfmt.dwarf_lines import LineTable
from aiflame.symbolize.objfmt.ehframe import FunctionStarts, function_starts
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.elf_symbols import function_symbols
from aiflame.symbolize.objfmt.minidebug import minidebug_functions
from aiflame.symbolize.symindex import SymbolIndex

__all__ = ["NativeSymbolizer", "offset_name"]

log = logging.getLogger(__name__)

_UNKNOWN_KIND = int(FrameKind.UNKNOWN)
_T = TypeVar("_T")
_DELETED = " (deleted)"
_MAX_OPEN_BINARIES = 32  # parsed binaries kept in memory (each holds a file descriptor and its tables)


def offset_name(module: str, off: int) -> str:
    """`libfoo.so+0x1a2b` (a negative offset reads `libfoo.so-0x1`)."""
    return f"{module}{off:+#x}"


def _unnamed(off: int) -> Entry:
    # Stored relative (`+0x1a2b`) so a cache entry does not depend on the name the binary was mapped under.
    return (f"{off:+#x}", _UNKNOWN_KIND, "", 0)


def _frame_name(entry: Entry, module: str) -> str:
    if entry[1] == _UNKNOWN_KIND and entry[0][:1] in ("+", "-"):
        return module + entry[0]
    return entry[0]


def _optional(what: str, path: str, read: Callable[[], _T], empty: _T) -> _T:
    """`read()`, or `empty` when it raises Unreadable: an optional source must not cost the binary's names."""
    try:
        return read()
    except Unreadable as e:
        log.debug("%s of %s unusable: %s", what, path, e)
        return empty


def _strip_version(name: str) -> str:
    """`memcpy@@GLIBC_2.14` -> `memcpy`; `puts@plt` stays (it names a different piece of code)."""
    if "@" not in name or name.endswith("@plt"):
        return name
    return name.split("@", 1)[0] or name


class _Binary:
    """The opened sources of one binary: the file itself and/or its debug file."""

    def __init__(self, main: ElfFile | None, debug: ElfFile | None, index: SymbolIndex | None = None) -> None:
        """`index`: the function symbols saved by an earlier run (from the same sources), else read here."""
        self.main = main
        self.debug = debug
        self.debug_path = debug.path if debug else None
        self.index_read = index is None
        if index is None:
            # Read uncached (not ElfFile.functions()): the index replaces the list, which must not stay alive.
            lists = [function_symbols(f) for f in (debug, main) if f is not None]
            if main is not None and debug is None:
                lists.append(_optional("MiniDebugInfo", main.path, lambda: minidebug_functions(main), []))
            index = SymbolIndex.merged(*lists, source=self.debug_path)
        self.index = index
        self._starts: FunctionStarts | None = None  # read at the first offset no symbol covers
        line_src = debug if debug is not None and debug.has_dwarf_lines else main
        self._lines = LineTable(line_src) if line_src is not None and line_src.has_dwarf_lines else None

    def close(self) -> None:
        for f in (self.main, self.debug):
            if f is not None:
                f.close()

    def _vaddr(self, off: int) -> int | None:
        if off < 0:
            return None
        if self.main is not None:
            return self.main.file_offset_to_vaddr(off)
        assert self.debug is not None
        return self.debug.debug_layout_vaddr(off)

    def _function_offset(self, vaddr: int | None, off: int) -> int:
        """The file offset of the function holding `off` as the unwind table gives it, else `off` itself."""
        main = self.main
        if main is None or vaddr is None:
            return off
        if self._starts is None:
            self._starts = _optional(".eh_frame_hdr", main.path, lambda: function_starts(main), FunctionStarts([], []))
        start = self._starts.find(vaddr)
        foff = main.vaddr_to_file_offset(start) if start is not None else None
        return off if foff is None else foff

    def resolve(self, offsets: Iterable[int]) -> dict[int, Entry]:
        hits: dict[int, tuple[str, int]] = {}
        out: dict[int, Entry] = {}
        for off in offsets:
            vaddr = self._vaddr(off)
            name = self.index.find(vaddr) if vaddr is not None else None
            if name is None or vaddr is None:
                out[off] = _unnamed(self._function_offset(vaddr, off))
            else:
                hits[off] = (_strip_version(name), vaddr)
        demangled = demangle({n for n, _v in hits.values() if is_mangled(n)})
        shown: dict[str, tuple[str, int]] = {}
        for name, _v in hits.values():
            if name not in shown:
                text = demangled.get(name, name)
                cpp = text != name
                fk = FrameKind.NATIVE_CPP if cpp else FrameKind.NATIVE
                shown[name] = (short_name(text) if cpp else name, int(fk))
        for off, (name, vaddr) in hits.items():
            loc = self._lines.lookup(vaddr) if self._lines is not None else None
            display, kind = shown[name]
            out[off] = (display, kind, loc[0], loc[1]) if loc else (display, kind, "", 0)
        return out


class NativeSymbolizer:
    """Turns (binary, build id, file offsets) into Frames. Not thread-safe; one per symbolizing thread.

    cache_dir: on-disk cache directory (None: $AIFLAME_CACHE or ~/.cache/aiflame/symbols).
    debug_dirs: roots of separate debug files (`.build-id/` trees and debuglink mirrors).
    root: where the profiled processes' filesystem is (e.g. /proc/PID/root for a container).
    """

    def __init__(
        self, cache_dir: str | None = None, debug_dirs: Sequence[str] = SYSTEM_DEBUG_DIRS, root: str = "/"
    ) -> None:
        self._cache = SymbolCache(cache_dir)
        self._root = root or "/"
        dirs = list(debug_dirs)
        if os.path.abspath(self._root) != "/":
            # The container's own debug files first; the host's are still verified by build id or CRC.
            dirs = [self._in_root(d) for d in dirs] + dirs
        self._debug_dirs = tuple(dirs)
        self._memo: dict[str, dict[int, Entry]] = {}
        self._disk_checked: set[str] = set()
        self._binaries: OrderedDict[str, _Binary] = OrderedDict()

    def symbolize(self, path: str, build_id: str | None, file_offsets: Iterable[int]) -> dict[int, Frame]:
        """A Frame for every offset in `file_offsets` (offset = address - mapping start + mapping offset).

        Return addresses are looked up as given (the caller subtracts 1). Offsets no symbol covers give
        `Frame("libfoo.so+0x1a2b", FrameKind.UNKNOWN, module="libfoo.so")` (see the module docstring); a missing
        or unreadable binary gives only those, each at its own offset.
        """
        offsets = set(file_offsets)
        clean = path.removesuffix(_DELETED)
        module = os.path.basename(clean)
        build_id = build_id.lower() if build_id else None
        key, persist = self._key(clean, build_id)
        memo = self._memo.setdefault(key, {})
        missing = [o for o in offsets if o not in memo]
        if missing and persist and key not in self._disk_checked:
            self._disk_checked.add(key)
            cached = self._cache.load(key)
            if cached is not None and not self._stale(cached, build_id):
                memo.update(cached.entries)
                missing = [o for o in offsets if o not in memo]
        # Unknowns from an unreadable binary are not remembered: it may be readable on the next call.
        failed: dict[int, Entry] = {}
        if missing:
            binary = self._binary(key, clean, build_id, persist)
            if binary is None:
                failed = {o: _unnamed(o) for o in missing}
            else:
                try:
                    memo.update(binary.resolve(missing))
                    if persist:
                        self._cache.store(key, CachedSymbols(memo, binary.debug_path))
                except Unreadable as e:
                    log.debug("symbolizing %s failed: %s", path, e)
                    failed = {o: _unnamed(o) for o in missing}
        frames: dict[Entry, Frame] = {}
        out: dict[int, Frame] = {}
        for off in offsets:
            entry = failed.get(off) or memo[off]
            frame = frames.get(entry)
            if frame is None:
                frame = frames[entry] = Frame(_frame_name(entry, module), FrameKind(entry[1]), module, entry[2],
                                              entry[3])
            out[off] = frame
        return out

    # --- helpers --------------------------------------------------------------------------------------------

    def _in_root(self, path: str) -> str:
        if os.path.abspath(self._root) == "/":
            return path
        return os.path.join(self._root, path.lstrip("/"))

    def _key(self, path: str, build_id: str | None) -> tuple[str, bool]:
        """(memo/cache key, whether it may be cached on disk)."""
        if build_id:
            return build_id, True
        host = self._in_root(path)
        try:
            st = os.stat(host)
        except OSError:
            return "missing:" + host, False
        ident = f"{os.path.realpath(host)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
        return "p-" + hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()[:40], True

    def _stale(self, cached: CachedSymbols, build_id: str | None) -> bool:
        """A cache written without a debug file is stale once a debug file for that build id appears."""
        if cached.debug_file is not None or not build_id:
            return False
        return any(os.path.exists(build_id_path(d, build_id)) for d in self._debug_dirs)

    def _binary(self, key: str, path: str, build_id: str | None, persist: bool) -> _Binary | None:
        if key in self._binaries:
            self._binaries.move_to_end(key)
            return self._binaries[key]
        binary = self._open(path, build_id, key if persist else None)
        if binary is not None:
            self._binaries[key] = binary
            while len(self._binaries) > _MAX_OPEN_BINARIES:
                self._binaries.popitem(last=False)[1].close()
        return binary

    def _open(self, path: str, build_id: str | None, key: str | None) -> _Binary | None:
        """The binary's sources; `key`: where its function symbols are saved on disk (None: not saved)."""
        host = self._in_root(path)
        main: ElfFile | None = None
        try:
            main = ElfFile.open(host)
        except Unreadable as e:
            log.debug("binary %s unavailable: %s", host, e)
        if main is not None and build_id and main.build_id != build_id:
            log.debug("%s has build id %s, wanted %s; using debug files only", host, main.build_id, build_id)
            main.close()
            main = None
        bid = build_id or (main.build_id if main else None)
        debug: ElfFile | None = None
        link = main.debuglink if main else None
        dbg_path = find_debug_file(host, bid, link, self._debug_dirs, root=self._root)
        if dbg_path is not None:
            try:
                debug = ElfFile.open(dbg_path)
            except Unreadable as e:
                log.debug("debug file %s unusable: %s", dbg_path, e)
        if main is None and debug is None:
            return None
        index = self._cache.load_index(key) if key is not None else None
        if index is not None and index.source != (debug.path if debug else None):
            index = None  # saved from other sources (a debug file appeared or moved)
        try:
            binary = _Binary(main, debug, index)
            if binary.index_read and key is not None:
                self._cache.store_index(key, binary.index)
            return binary
        except Unreadable as e:
            log.debug("binary %s unusable: %s", host, e)
            for f in (main, debug):
                if f is not None:
                    f.close()
            return None
