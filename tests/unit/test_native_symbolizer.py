"""NativeSymbolizer end to end on real binaries: names, lines, debug files, unknowns and the disk cache."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aiflame.core.errors import Unreadable
from aiflame.core.model import Frame, FrameKind
from aiflame.symbolize import cache as cache_mod
from aiflame.symbolize import native as native_mod
from aiflame.symbolize.cache import SymbolCache
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.objfmt.elf import ElfFile
from tests.unit.elf_builders import (
    Built,
    addr2line,
    get_built,
    line_of,
    marker_line,
    plt_stubs,
    readelf_functions,
    section_offset,
    vaddr_to_offset,
)

NATIVE, CPP, UNKNOWN = FrameKind.NATIVE, FrameKind.NATIVE_CPP, FrameKind.UNKNOWN


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return get_built(tmp_path_factory)


@pytest.fixture
def sym(tmp_path: Path) -> NativeSymbolizer:
    return NativeSymbolizer(cache_dir=str(tmp_path / "cache"), debug_dirs=())


def offset_of(layout: Path, func: str, delta: int = 0, symbols_from: Path | None = None) -> int:
    """File offset of `func`+delta: address from `symbols_from` (an unstripped twin), layout of `layout`."""
    addr = readelf_functions(symbols_from or layout)[func][0] + delta
    return vaddr_to_offset(layout, addr)


def one(s: NativeSymbolizer, path: Path, off: int, build_id: str | None = None) -> Frame:
    return s.symbolize(str(path), build_id, [off])[off]


def test_pie_with_debug_info(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s (names) and addr2line (file and line) at every offset
    body = marker_line(built.src, "add_body")
    offs = {f: offset_of(built.prog, f, 4) for f in ("add_numbers", "loop_sum", "main", "static_helper")}
    frames = sym.symbolize(str(built.prog), built.build_ids["prog"], offs.values())
    assert set(frames) == set(offs.values())
    funcs = readelf_functions(built.prog)
    want = dict(zip(offs, addr2line(built.prog, [funcs[func][0] + 4 for func in offs]), strict=True))
    for func, off in offs.items():
        f = frames[off]
        assert (f.name, f.kind, f.module, f.file) == (func, NATIVE, "prog", str(built.src))
        assert (f.file, f.line) == want[func]
    assert frames[offs["add_numbers"]].line == body - 1  # prologue: the line of the opening brace
    # An address on the marked statement itself.
    start = readelf_functions(built.prog)["add_numbers"]
    lines = {one(sym, built.prog, vaddr_to_offset(built.prog, a)).line for a in range(start[0], sum(start))}
    assert body in lines


def test_without_debug_info_names_only(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s (loop_sum's address); built without -g
    f = one(sym, built.prog_nog, offset_of(built.prog_nog, "loop_sum", 8))
    assert f == Frame("loop_sum", NATIVE, "prog_nog", "", 0)


def test_non_pie(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s and addr2line
    off = offset_of(built.prog_nopie, "loop_sum", 10)
    f = one(sym, built.prog_nopie, off, built.build_ids["prog_nopie"])
    addr = readelf_functions(built.prog_nopie)["loop_sum"][0] + 10
    assert (f.name, f.file) == ("loop_sum", str(built.src))
    assert (f.file, f.line) == addr2line(built.prog_nopie, [addr])[0]


def test_zero_size_symbol(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s (zero_size_fn's address)
    assert one(sym, built.prog, offset_of(built.prog, "zero_size_fn", 3)).name == "zero_size_fn"


def test_plt_stub(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: objdump -d (puts@plt)
    addr = plt_stubs(built.prog)["puts@plt"]
    assert one(sym, built.prog, vaddr_to_offset(built.prog, addr + 4)).name == "puts@plt"


def test_shared_library(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s of the library
    off = offset_of(built.lib, "lib_exported", 5)
    f = one(sym, built.lib, off, built.build_ids["libdemo.so"])
    assert (f.name, f.module, f.file) == ("lib_exported", "libdemo.so", str(built.lib_src))
    priv = one(sym, built.lib, offset_of(built.lib, "lib_private", 2))
    assert priv.name == "lib_private"


def test_stripped_library_exports_only(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s of the unstripped twin; strip keeps .dynsym only
    off = offset_of(built.lib_stripped, "lib_exported", 5, symbols_from=built.lib)
    assert one(sym, built.lib_stripped, off) == Frame("lib_exported", NATIVE, "libdemo_stripped.so")
    # static: not in .dynsym. Named by its module and where its function starts (from the unwind table), so
    # every address inside it gives the same frame.
    start = offset_of(built.lib_stripped, "lib_private", 0, symbols_from=built.lib)
    for delta in (0, 2, 5):
        priv = one(
            sym, built.lib_stripped, offset_of(built.lib_stripped, "lib_private", delta, symbols_from=built.lib)
        )
        assert priv == Frame(f"libdemo_stripped.so+{start:#x}", UNKNOWN, "libdemo_stripped.so")


def test_stripped_executable_without_debug_file(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s of the unstripped twin; strip removes add_numbers
    off = offset_of(built.prog_stripped, "add_numbers", 4, symbols_from=built.prog)
    f = one(sym, built.prog_stripped, off, built.build_ids["prog"])
    start = offset_of(built.prog_stripped, "add_numbers", 0, symbols_from=built.prog)
    assert f == Frame(f"prog_stripped+{start:#x}", UNKNOWN, "prog_stripped")


@pytest.mark.parametrize("binary", ["prog_linked", "prog_linked_sub"])
def test_debuglink_debug_file(built: Built, sym: NativeSymbolizer, binary: str) -> None:
    # Oracle: readelf -s of the unstripped twin; MARK comments in the source (line)
    path: Path = getattr(built, binary)
    off = offset_of(path, "add_numbers", 4, symbols_from=built.prog)
    f = one(sym, path, off, built.build_ids["prog"])
    assert (f.name, f.file, f.line) == ("add_numbers", str(built.src), marker_line(built.src, "add_body") - 1)
    assert f.module == path.name


def test_build_id_debug_dir(built: Built, tmp_path: Path) -> None:
    # Oracle: readelf -s of the unstripped twin; the debug file placed here by build id
    s = NativeSymbolizer(cache_dir=str(tmp_path), debug_dirs=[str(built.bid_debug_dir)])
    off = offset_of(built.prog_bid, "loop_sum", 9, symbols_from=built.prog)
    f = one(s, built.prog_bid, off, built.build_ids["prog"])
    assert (f.name, f.file, f.module) == ("loop_sum", str(built.src), "prog_bid") and f.line > 0
    # Same, with the build id left for the symbolizer to read from the binary.
    f2 = one(
        NativeSymbolizer(cache_dir=str(tmp_path / "2"), debug_dirs=[str(built.bid_debug_dir)]),
        built.prog_bid,
        off,
    )
    assert f2 == f


def test_debug_file_alone_when_binary_is_gone(built: Built, tmp_path: Path) -> None:
    # Oracle: readelf -s; the debug file placed here by build id
    s = NativeSymbolizer(cache_dir=str(tmp_path), debug_dirs=[str(built.bid_debug_dir)])
    off = offset_of(built.prog, "add_numbers", 4)
    f = one(s, tmp_path / "deleted" / "prog", off, built.build_ids["prog"])
    assert (f.name, f.file, f.module) == ("add_numbers", str(built.src), "prog")


def test_build_id_mismatch_ignores_the_file(built: Built, sym: NativeSymbolizer) -> None:
    off = offset_of(built.prog, "add_numbers", 4)
    # No file to read the unwind table from: the offset itself.
    assert one(sym, built.prog, off, "00" * 20) == Frame(f"prog+{off:#x}", UNKNOWN, "prog")


def test_cpp_names_are_demangled_and_short(built: Built, sym: NativeSymbolizer) -> None:
    # Oracle: readelf -s (mangled names and ranges); c++filt (demangled names)
    funcs = readelf_functions(built.cpp)
    run_off = offset_of(built.cpp, "_ZNK4demo6Engine3runEi", 4)
    tmpl = "_ZN4demo6detail10scaled_sumIiEET_RKSt6vectorIS2_SaIS2_EES2_"
    start, size = funcs[tmpl]
    tmpl_offs = [vaddr_to_offset(built.cpp, a) for a in range(start, start + size)]
    frames = sym.symbolize(str(built.cpp), None, [run_off, *tmpl_offs])
    assert frames[run_off].name == "demo::Engine::run" and frames[run_off].kind == CPP
    assert {frames[o].name for o in tmpl_offs} == {"demo::detail::scaled_sum<int>"}
    assert {frames[o].kind for o in tmpl_offs} == {CPP}
    assert (str(built.cpp_src), marker_line(built.cpp_src, "cpp_body")) in {
        (frames[o].file, frames[o].line) for o in tmpl_offs
    }
    main_off = offset_of(built.cpp, "main", 4)
    main_line = line_of(built.cpp_src, "int main()")
    assert one(sym, built.cpp, main_off) == Frame("main", NATIVE, "cppdemo", str(built.cpp_src), main_line)


def test_unknown_offsets_keep_their_module(built: Built, sym: NativeSymbolizer) -> None:
    offs = [10**9, section_offset(built.prog, ".rodata"), -5, 0]
    frames = sym.symbolize(str(built.prog), None, offs)
    assert set(frames) == set(offs)
    # Outside every function: named by the offset itself.
    assert frames == {o: Frame(native_mod.offset_name("prog", o), UNKNOWN, "prog") for o in offs}
    assert frames[-5].name == "prog-0x5" and frames[0].name == "prog+0x0"


@pytest.mark.parametrize("kind", ["missing", "directory", "text", "empty"])
def test_unreadable_binary_gives_unknowns(tmp_path: Path, sym: NativeSymbolizer, kind: str) -> None:
    path = tmp_path / "libgone.so"
    if kind == "directory":
        path.mkdir()
    elif kind == "text":
        path.write_text("#!/bin/sh\necho hi\n")
    elif kind == "empty":
        path.write_bytes(b"")
    frames = sym.symbolize(str(path), "ab" * 20 if kind == "missing" else None, [1, 2, 0x1000])
    assert frames == {o: Frame(f"libgone.so+{o:#x}", UNKNOWN, "libgone.so") for o in (1, 2, 0x1000)}


def test_binary_that_appears_later_is_symbolized(built: Built, tmp_path: Path, sym: NativeSymbolizer) -> None:
    path = tmp_path / "late" / "prog"
    off = offset_of(built.prog, "main", 4)
    bid = built.build_ids["prog"]
    assert one(sym, path, off, bid).kind == UNKNOWN
    path.parent.mkdir()
    shutil.copy(built.prog, path)
    assert one(sym, path, off, bid).name == "main"  # the earlier failure was not remembered


def test_deleted_suffix_and_root(built: Built, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "opt" / "app").mkdir(parents=True)
    shutil.copy(built.prog, root / "opt" / "app" / "prog")
    s = NativeSymbolizer(cache_dir=str(tmp_path / "c"), debug_dirs=(), root=str(root))
    off = offset_of(built.prog, "main", 4)
    f = one(s, Path("/opt/app/prog (deleted)"), off, built.build_ids["prog"])
    assert (f.name, f.module) == ("main", "prog")


# --- memo and disk cache ------------------------------------------------------------------------------------


def _forbid_elf(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(cls: type[ElfFile], path: object) -> ElfFile:
        raise AssertionError(f"ElfFile.open({path}) called although everything is cached")

    monkeypatch.setattr(ElfFile, "open", classmethod(boom))


def test_disk_cache_serves_a_fresh_symbolizer(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = str(tmp_path / "cache")
    start, size = readelf_functions(built.cpp)["_ZNK4demo6Engine3runEi"]
    offs = [vaddr_to_offset(built.cpp, a) for a in range(start, start + size, 3)] + [10**9]
    first = NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(
        str(built.cpp), built.build_ids["cppdemo"], offs
    )
    _forbid_elf(monkeypatch)
    second = NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(
        str(built.cpp), built.build_ids["cppdemo"], offs
    )
    assert second == first
    assert first[offs[0]].kind == CPP and first[10**9].kind == UNKNOWN


def test_disk_cache_in_a_new_process(built: Built, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    offs = [offset_of(built.prog, "loop_sum", 4), offset_of(built.prog, "main", 9)]
    bid = built.build_ids["prog"]
    first = NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, offs)
    code = (
        "import sys, json\n"
        "from aiflame.symbolize.objfmt.elf import ElfFile\n"
        "def boom(*a): raise SystemExit('ElfFile.open called')\n"
        "ElfFile.open = classmethod(boom)\n"
        "from aiflame.symbolize.native import NativeSymbolizer\n"
        f"s = NativeSymbolizer(cache_dir={cache!r}, debug_dirs=())\n"
        f"r = s.symbolize({str(built.prog)!r}, {bid!r}, {offs!r})\n"
        "print(json.dumps({str(k): [f.name, int(f.kind), f.module, f.file, f.line] for k, f in r.items()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    got = {int(k): Frame(v[0], FrameKind(v[1]), v[2], v[3], v[4]) for k, v in json.loads(out).items()}
    assert got == first


def test_memo_avoids_reparsing(built: Built, sym: NativeSymbolizer, monkeypatch: pytest.MonkeyPatch) -> None:
    offs = [offset_of(built.prog, "main", 4)]
    first = sym.symbolize(str(built.prog), None, offs)
    _forbid_elf(monkeypatch)
    assert sym.symbolize(str(built.prog), None, offs) == first


def test_disk_cache_merges_new_offsets(built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = str(tmp_path / "cache")
    a, b = offset_of(built.prog, "main", 4), offset_of(built.prog, "loop_sum", 4)
    bid = built.build_ids["prog"]
    NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, [a])
    both = NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, [a, b])
    _forbid_elf(monkeypatch)
    assert NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, [a, b]) == both


def test_new_offsets_later_read_the_saved_function_symbols(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offsets never resolved before need the binary again, but not its symbol tables: those were saved as a
    SymbolIndex at the first read (libtorch_cpu: 2.7 s of every capture's post-processing)."""
    cache = str(tmp_path / "cache")
    a, b = offset_of(built.prog, "main", 4), offset_of(built.prog, "loop_sum", 4)
    bid = built.build_ids["prog"]
    NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, [a])
    assert os.path.exists(SymbolCache(cache).path_for(bid, ".sym"))

    def no_tables(elf: ElfFile) -> list[object]:
        raise AssertionError("symbol tables read again")

    monkeypatch.setattr(native_mod, "function_symbols", no_tables)
    got = NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, [a, b])
    assert (got[a].name, got[b].name) == ("main", "loop_sum")


def test_a_saved_index_from_other_sources_is_read_again(built: Built, tmp_path: Path) -> None:
    """An index saved without a debug file is not used once one is found (its names may be fewer)."""
    cache = str(tmp_path / "cache")
    bid = built.build_ids["prog"]
    off = offset_of(built.prog, "main", 4)
    NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, [off])
    saved = SymbolCache(cache).load_index(bid)
    assert saved is not None and saved.source is None and saved.find(readelf_functions(built.prog)["main"][0])
    Path(SymbolCache(cache).path_for(bid, ".sym")).write_bytes(b"AIFLSYM1 and then garbage")
    again = NativeSymbolizer(cache_dir=cache, debug_dirs=()).symbolize(str(built.prog), bid, [off + 1])
    assert again[off + 1].name == "main"
    assert SymbolCache(cache).load_index(bid) is not None  # rewritten whole


def test_corrupt_cache_is_ignored_and_rewritten(built: Built, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    bid = built.build_ids["prog"]
    off = offset_of(built.prog, "add_numbers", 4)
    expected = NativeSymbolizer(cache_dir=str(cache), debug_dirs=()).symbolize(str(built.prog), bid, [off])
    file = Path(SymbolCache(str(cache)).path_for(bid))
    for garbage in (
        b"not gzip",
        gzip.compress(b"{not json"),
        gzip.compress(b'{"format": "aiflame-symbols"}'),
        gzip.compress(
            json.dumps(
                {
                    "format": "aiflame-symbols",
                    "version": cache_mod.VERSION,
                    "key": bid,
                    "names": [],
                    "files": [],
                    "entries": [[off, 5, 2, 0, 1]],
                }
            ).encode()
        ),
    ):
        file.write_bytes(garbage)
        got = NativeSymbolizer(cache_dir=str(cache), debug_dirs=()).symbolize(str(built.prog), bid, [off])
        assert got == expected
        loaded = SymbolCache(str(cache)).load(bid)
        assert loaded is not None and off in loaded.entries  # rewritten in the current format


def test_unwritable_cache_dir_is_harmless(built: Built, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = NativeSymbolizer(cache_dir=str(blocker / "sub"), debug_dirs=())
    off = offset_of(built.prog, "main", 4)
    assert one(s, built.prog, off).name == "main"


def test_cache_written_before_debug_file_appeared_is_stale(built: Built, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    off = offset_of(built.prog_bid, "loop_sum", 4, symbols_from=built.prog)
    bid = built.build_ids["prog"]
    before = one(
        NativeSymbolizer(cache_dir=cache, debug_dirs=[str(tmp_path / "empty")]), built.prog_bid, off, bid
    )
    assert before.name != "loop_sum"
    after = one(
        NativeSymbolizer(cache_dir=cache, debug_dirs=[str(built.bid_debug_dir)]), built.prog_bid, off, bid
    )
    assert after.name == "loop_sum" and after.line > 0


def test_cache_dir_from_environment(built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIFLAME_CACHE", str(tmp_path / "envcache"))
    bid = built.build_ids["prog"]
    NativeSymbolizer(debug_dirs=()).symbolize(str(built.prog), bid, [offset_of(built.prog, "main", 4)])
    assert os.path.exists(SymbolCache(str(tmp_path / "envcache")).path_for(bid))


def test_parse_errors_give_unknowns(
    built: Built, sym: NativeSymbolizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: object, offsets: object) -> dict[int, tuple[str, int, str, int]]:
        raise Unreadable("prog: broken")

    monkeypatch.setattr(native_mod._Binary, "resolve", broken)
    assert one(sym, built.prog, 0x1000) == Frame("prog+0x1000", UNKNOWN, "prog")
