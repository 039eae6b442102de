"""ELF parsing, DWARF lines, demangling and debug-file lookup, checked against binutils on real binaries.

Past 400 lines by one `Oracle:` line per truth check (issue #30), kept in one file with its fixtures."""

from __future__ import annotations

import glob
import os
import random
import shutil
import statistics
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.debugfiles import build_id_path, find_debug_file
from aiflame.symbolize.objfmt.demangle import demangle, is_mangled, short_name
from aiflame.symbolize.objfmt.dwarf_lines import LineTable
from aiflame.symbolize.objfmt.elf import ElfFile, read_build_id
from tests.unit.elf_builders import (
    Built,
    addr2line,
    cxxfilt,
    decoded_lines,
    get_built,
    load_segments,
    marker_line,
    plt_stubs,
    readelf_build_id,
    readelf_functions,
    run,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return get_built(tmp_path_factory)


# --- read_build_id ------------------------------------------------------------------------------------------


def test_read_build_id_matches_readelf_and_file(built: Built) -> None:
    # Oracle: readelf -n and file(1)
    for p in (
        built.prog,
        built.prog_nog,
        built.prog_nopie,
        built.prog_stripped,
        built.lib,
        built.cpp,
        built.prog_linked,
        built.lib_stripped,
    ):
        bid = read_build_id(p)
        assert bid == readelf_build_id(p), p
        assert bid is not None and bid == bid.lower() and len(bid) == 40
    if shutil.which("file"):
        assert f"BuildID[sha1]={read_build_id(built.prog)}" in run("file", built.prog)


def test_read_build_id_of_debug_file_and_system_binary(built: Built) -> None:
    # Oracle: readelf -n (this interpreter); objcopy --only-keep-debug keeps the build id
    debug = built.dir / "prog_linked.debug"
    assert read_build_id(debug) == read_build_id(built.prog)
    assert read_build_id(str(built.prog)) == read_build_id(Path(built.prog))  # str and PathLike
    python = os.path.realpath("/proc/self/exe")
    assert read_build_id(python) == readelf_build_id(Path(python))


def test_read_build_id_none_without_note(built: Built) -> None:
    # Oracle: by construction — built with --build-id=none
    assert read_build_id(built.prog_nobid) is None
    with ElfFile.open(built.prog_nobid) as elf:
        assert elf.build_id is None


@pytest.mark.parametrize(
    "content",
    [b"", b"hello world, not an elf\n", b"\x7fELF", b"\x7fELF\x02\x01\x01" + b"\0" * 9, b"\x7fELF\x07\x01"],
)
def test_read_build_id_rejects_non_elf(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "f"
    p.write_bytes(content)
    with pytest.raises(Unreadable) as ei:
        read_build_id(p)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(Unreadable):
        ElfFile.open(p)


def test_read_build_id_missing_directory_and_fifo(tmp_path: Path) -> None:
    with pytest.raises(Unreadable, match="No such file"):
        read_build_id(tmp_path / "missing")
    with pytest.raises(Unreadable, match="not a regular file"):
        read_build_id(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(Unreadable):  # must not block on open
        read_build_id(fifo)


def test_read_build_id_is_fast_on_a_large_binary(built: Built) -> None:
    candidates = glob.glob("/usr/lib/x86_64-linux-gnu/libLLVM*.so*") + [str(built.cpp)]
    path = max(candidates, key=lambda p: os.path.getsize(p))
    read_build_id(path)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        read_build_id(path)
        times.append(time.perf_counter() - t)
    assert statistics.median(times) < 1e-3, (path, statistics.median(times))


# --- ElfFile: layout and symbols ----------------------------------------------------------------------------


def test_elf_properties(built: Built) -> None:
    # Oracle: by construction (-pie/-no-pie, -g or not, strip, a debuglink); readelf -n; zlib's CRC of the debug file
    with ElfFile.open(built.prog) as e:
        assert e.is_pie_or_dso and e.has_dwarf_lines and e.debuglink is None
        assert e.build_id == readelf_build_id(built.prog)
    with ElfFile.open(built.prog_nopie) as e:
        assert not e.is_pie_or_dso and e.has_dwarf_lines
    with ElfFile.open(built.lib) as e:
        assert e.is_pie_or_dso
    with ElfFile.open(built.prog_nog) as e:
        assert not e.has_dwarf_lines
    with ElfFile.open(built.prog_stripped) as e:
        assert not e.has_dwarf_lines and e.build_id == readelf_build_id(built.prog)
    with ElfFile.open(built.prog_linked) as e:
        debug = built.dir / "prog_linked.debug"
        assert e.debuglink == ("prog_linked.debug", zlib.crc32(debug.read_bytes()))


def test_file_offset_to_vaddr_follows_load_segments(built: Built) -> None:
    # Oracle: readelf -l (LOAD segments)
    for path in (built.prog, built.prog_nopie, built.lib):
        with ElfFile.open(path) as e:
            segs = load_segments(path)
            for off, vaddr, filesz in segs:
                assert e.file_offset_to_vaddr(off) == vaddr
                assert e.file_offset_to_vaddr(off + filesz - 1) == vaddr + filesz - 1
            end = max(off + filesz for off, _v, filesz in segs)
            assert e.file_offset_to_vaddr(end + 0x100000) is None


def test_debug_layout_guess_matches_real_layout_for_text(built: Built) -> None:
    # Oracle: readelf -s and -l of the binary that objcopy --only-keep-debug split
    for binary in (built.prog, built.prog_nopie):
        debug = built.dir / f"{binary.name}.kept.debug"
        run("objcopy", "--only-keep-debug", binary, debug)
        funcs = readelf_functions(binary)
        with ElfFile.open(binary) as main, ElfFile.open(debug) as dbg:
            for name in ("add_numbers", "loop_sum", "main"):
                addr = funcs[name][0]
                off = next(o + addr - v for o, v, f in load_segments(binary) if v <= addr < v + f)
                assert dbg.file_offset_to_vaddr(off) is None  # the debug file holds no code bytes
                assert dbg.debug_layout_vaddr(off) == main.file_offset_to_vaddr(off) == addr


def _by_addr(path: Path) -> dict[int, str]:
    with ElfFile.open(path) as e:
        return {s.addr: s.name for s in e.functions()}


def test_functions_match_readelf(built: Built) -> None:
    # Oracle: readelf -s
    for path in (built.prog, built.prog_nopie, built.lib, built.cpp):
        with ElfFile.open(path) as e:
            funcs = e.functions()
        addrs = [s.addr for s in funcs]
        assert addrs == sorted(set(addrs)), "sorted and one symbol per address"
        ours = {s.addr: s for s in funcs}
        expected = readelf_functions(path)
        aliases: dict[int, set[str]] = {}
        for name, (addr, _size) in expected.items():
            aliases.setdefault(addr, set()).add(name)
        for name, (addr, size) in expected.items():
            assert addr in ours, (path, name)
            assert ours[addr].name in aliases[addr]
            if size:
                assert ours[addr].size == size, (path, name)
            else:
                assert ours[addr].size > 0, (path, name)


def _first_definitions(path: Path | str) -> dict[str, int]:
    """name -> address of its first defined function entry, .dynsym before .symtab, from readelf."""
    out: dict[str, int] = {}
    for dynamic in (True, False):
        for name, (addr, _size) in readelf_functions(Path(path), dynamic).items():
            out.setdefault(name, addr)
    return out


LARGE_ELFS = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/python3",
              "/root/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0"]


@pytest.mark.parametrize("which", ["lib", "cpp", *LARGE_ELFS])
def test_function_addresses_by_name_match_readelf(built: Built, which: str) -> None:
    # Oracle: readelf -s (the first definition of each name, .dynsym first)
    path = getattr(built, which) if which in ("lib", "cpp") else which
    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this machine")
    oracle = _first_definitions(path)
    every = sorted(oracle)
    rng = random.Random(7)
    # names that are the tail of a longer name share its string (linkers merge string tails)
    tails = [n[k:] for n in every for k in (1, 2) if len(n) > k + 2]
    for _ in range(6):
        names = set(rng.sample(every, min(40, len(every)))) | set(rng.sample(tails, min(20, len(tails))))
        names |= {"aiflame_no_such_function", ""}
        with ElfFile.open(path) as e:
            found = e.function_addresses(names)
        assert found == {n: oracle[n] for n in names if n in oracle}
    with ElfFile.open(path) as e:
        assert e.function_addresses(set(every)) == oracle


def test_zero_size_symbol_extends_to_next(built: Built) -> None:
    # Oracle: readelf -s (zero_size_fn has size 0)
    expected = readelf_functions(built.prog)
    assert expected["zero_size_fn"][1] == 0
    with ElfFile.open(built.prog) as e:
        funcs = e.functions()
    i = next(i for i, s in enumerate(funcs) if s.name == "zero_size_fn")
    assert funcs[i].size == funcs[i + 1].addr - funcs[i].addr > 0


def test_stripped_binary_keeps_dynsym_only(built: Built) -> None:
    # Oracle: by construction — strip leaves .dynsym: lib_exported exported, lib_private static
    lib = {n for n in _by_addr(built.lib_stripped).values()}
    assert "lib_exported" in lib and "lib_private" not in lib
    assert "lib_private" in set(_by_addr(built.lib).values())
    exe = set(_by_addr(built.prog_stripped).values())
    assert "add_numbers" not in exe and "puts@plt" in exe


def test_plt_stubs_match_objdump(built: Built) -> None:
    # Oracle: objdump -d (the name@plt stubs)
    for path in (built.prog, built.prog_nopie, built.cpp, built.prog_stripped):
        stubs = plt_stubs(path)
        assert stubs, path
        ours = _by_addr(path)
        for name, addr in stubs.items():
            assert ours.get(addr) == name, (path, name)


def test_plt_with_ibt_layout(tmp_path: Path, built: Built) -> None:
    # Oracle: objdump -d (the name@plt stubs of an IBT build)
    out = tmp_path / "ibt"
    try:
        run("gcc", "-O0", "-fcf-protection=full", "-Wl,-z,ibtplt", "-o", out, built.src)
    except subprocess.CalledProcessError:
        pytest.skip("toolchain without IBT PLT support")
    stubs = plt_stubs(out)
    ours = _by_addr(out)
    assert stubs and all(ours.get(a) == n for n, a in stubs.items())


# --- DWARF line tables --------------------------------------------------------------------------------------


def _function_addrs(path: Path, names: tuple[str, ...]) -> list[int]:
    funcs = readelf_functions(path)
    return [a for n in names for a in range(funcs[n][0], funcs[n][0] + funcs[n][1])]


@pytest.mark.parametrize("which", ["prog", "prog_nopie", "lib", "debugfile"])
def test_line_table_agrees_with_addr2line(built: Built, which: str) -> None:
    # Oracle: addr2line on every address of the functions (readelf's ranges)
    names: tuple[str, ...] = ("add_numbers", "loop_sum", "main", "static_helper")
    path = {
        "prog": built.prog,
        "prog_nopie": built.prog_nopie,
        "lib": built.lib,
        "debugfile": built.dir / "prog_linked.debug",
    }[which]
    if which == "lib":
        names = ("lib_exported", "lib_private")
    addrs = _function_addrs(path, names)
    expected = addr2line(path, addrs)
    with ElfFile.open(path) as e:
        table = LineTable(e)
        got = [table.lookup(a) for a in addrs]
    assert got == expected


def test_line_numbers_of_known_statements(built: Built) -> None:
    # Oracle: by construction — MARK comments in the fixture's source
    funcs = readelf_functions(built.prog)
    with ElfFile.open(built.prog) as e:
        table = LineTable(e)
        start = funcs["add_numbers"][0]
        body = {table.lookup(a) for a in range(start, start + funcs["add_numbers"][1])}
        assert (str(built.src), marker_line(built.src, "add_body")) in body
        # The first instructions (prologue) belong to the line with the function's opening brace.
        assert table.lookup(start + 1) == (str(built.src), marker_line(built.src, "add_body") - 1)
        loop = funcs["loop_sum"][0]
        lines = {table.lookup(a) for a in range(loop, loop + funcs["loop_sum"][1])}
        assert (str(built.src), marker_line(built.src, "loop_body")) in lines
        assert table.lookup(0) is None and table.lookup(0xFFFF_FFFF_FFFF) is None


def test_line_table_without_dwarf(built: Built) -> None:
    # Oracle: by construction — built without -g
    with ElfFile.open(built.prog_nog) as e:
        assert LineTable(e).lookup(readelf_functions(built.prog_nog)["main"][0]) is None


def test_line_table_without_aranges(tmp_path: Path, built: Built) -> None:
    """Clang-style output (no .debug_aranges) still resolves, through CU ranges."""
    # Oracle: addr2line on the same file
    stripped = tmp_path / "noaranges"
    run("objcopy", "--remove-section=.debug_aranges", built.cpp, stripped)
    names = ("main", "_ZNK4demo6Engine3runEi")
    addrs = _function_addrs(stripped, names)
    with ElfFile.open(stripped) as e:
        assert e.dwarf_section("aranges") is None
        table = LineTable(e)
        assert [table.lookup(a) for a in addrs] == addr2line(stripped, addrs)


@pytest.mark.parametrize(
    "flags",
    [("-O2", "-ffunction-sections"), ("-O2", "-gsplit-dwarf"), ("-O2", "-ffunction-sections", "-gdwarf-4")],
)
def test_line_table_from_cu_ranges(tmp_path: Path, built: Built, flags: tuple[str, ...]) -> None:
    """Without aranges, CUs are placed by DW_AT_ranges (v5 rnglists, v4 ranges; split-DWARF skeletons too)."""
    # Oracle: readelf --debug-dump=decodedline
    out = tmp_path / "ranges"
    run("gcc", "-g", *flags, "-o", out, built.src, cwd=tmp_path)
    run("objcopy", "--remove-section=.debug_aranges", out)
    rows = decoded_lines(out)  # addr2line cannot read split DWARF; readelf's decoded table can
    assert len(rows) > 20
    with ElfFile.open(out) as e:
        assert e.dwarf_section("aranges") is None
        assert e.dwarf_section("rnglists" if "-gdwarf-4" not in flags else "ranges") is not None
        table = LineTable(e)
        got = {a: table.lookup(a) for a in rows}
    assert {a: (g[1] if g else None) for a, g in got.items()} == rows
    files = {g[0] for g in got.values() if g}
    assert str(built.src) in files and all(os.path.isabs(f) for f in files)  # stdlib.h: inlined atol()


def test_line_table_with_compressed_sections(tmp_path: Path, built: Built) -> None:
    # Oracle: addr2line on the uncompressed original
    z = tmp_path / "zdebug"
    run("objcopy", "--compress-debug-sections=zlib", built.prog, z)
    addrs = _function_addrs(z, ("add_numbers", "main"))
    with ElfFile.open(z) as e:
        table = LineTable(e)
        assert [table.lookup(a) for a in addrs] == addr2line(built.prog, addrs)


def test_line_table_dwarf4(tmp_path: Path, built: Built) -> None:
    # Oracle: addr2line on the same file
    out = tmp_path / "dwarf4"
    run("gcc", "-gdwarf-4", "-O0", "-o", out, built.src)
    addrs = _function_addrs(out, ("add_numbers", "loop_sum"))
    with ElfFile.open(out) as e:
        table = LineTable(e)
        got = [table.lookup(a) for a in addrs]
    assert got == addr2line(out, addrs)
    assert all(g is not None and g[0] == str(built.src) for g in got)


# --- demangling ---------------------------------------------------------------------------------------------


def test_demangle_itanium_names() -> None:
    # Oracle: c++filt (binutils) on the same names
    names = [
        "_ZN4demo6detail10scaled_sumIiEET_RKSt6vectorIS2_SaIS2_EES2_",
        "main",
        "_Z",
        "i",
        "_ZNK4demo6Engine3runEi",
    ]
    d = demangle(names)
    assert d == cxxfilt(names)
    assert d["_ZNK4demo6Engine3runEi"] == "demo::Engine::run(int) const"
    tmpl = d["_ZN4demo6detail10scaled_sumIiEET_RKSt6vectorIS2_SaIS2_EES2_"]
    assert tmpl.startswith("int demo::detail::scaled_sum<int>(")
    assert d["main"] == "main" and d["_Z"] == "_Z" and d["i"] == "i"  # failures and plain names stay
    assert demangle(["_Znwm@plt"])["_Znwm@plt"] == cxxfilt(["_Znwm"])["_Znwm"] + "@plt"
    assert is_mangled("_ZN1a1bEv") and not is_mangled("printf")


@pytest.mark.parametrize(
    ("text", "short"),
    [
        ("void foo::bar<int>(int)", "foo::bar<int>"),
        ("foo() [clone .cold]", "foo [clone .cold]"),
        (
            "std::vector<int, std::allocator<int> >::size() const",
            "std::vector<int, std::allocator<int> >::size",
        ),
        ("main::{lambda(int)#1}::operator()(int) const", "main::{lambda(int)#1}::operator()"),
        ("foo(int)::{lambda()#1}::operator()() const", "foo::{lambda()#1}::operator()"),
        ("(anonymous namespace)::baz()", "(anonymous namespace)::baz"),
        ("operator new(unsigned long, std::nothrow_t const&)", "operator new"),
        ("Foo::operator int() const", "Foo::operator int"),
        ("Foo::operator<(Foo const&)", "Foo::operator<"),
        ("Foo::operator<<(int)", "Foo::operator<<"),
        ("Foo::operator->()", "Foo::operator->"),
        ("operator delete[](void*)", "operator delete[]"),
        ("std::function<void (int)>::operator()(int)", "std::function<void (int)>::operator()"),
        ("foo::bar[abi:cxx11]()", "foo::bar[abi:cxx11]"),
        ("Foo::get() &&", "Foo::get"),
        ("operatorish(int)", "operatorish"),
        ("plain", "plain"),
    ],
)
def test_short_name(text: str, short: str) -> None:
    assert short_name(text) == short


# --- debug files --------------------------------------------------------------------------------------------


def test_find_debug_file_by_build_id(built: Built) -> None:
    # Oracle: by construction — the debug file placed here under .build-id/xx/
    bid = read_build_id(built.prog_bid)
    assert bid is not None
    expected = build_id_path(str(built.bid_debug_dir), bid)
    assert find_debug_file(str(built.prog_bid), bid, None, [str(built.bid_debug_dir)]) == expected
    assert find_debug_file(str(built.prog_bid), "ab" * 20, None, [str(built.bid_debug_dir)]) is None


def test_find_debug_file_rejects_wrong_build_id_content(tmp_path: Path, built: Built) -> None:
    bid = "ab" * 20
    fake = Path(build_id_path(str(tmp_path), bid))
    fake.parent.mkdir(parents=True)
    shutil.copy(built.dir / "prog_linked.debug", fake)  # its real build id is prog's
    assert find_debug_file(str(built.prog), bid, None, [str(tmp_path)]) is None


def test_find_debug_file_by_debuglink(tmp_path: Path, built: Built) -> None:
    # Oracle: by construction — debug files placed here where GDB's rules look; zlib's CRC
    with ElfFile.open(built.prog_linked) as e:
        link = e.debuglink
    assert link is not None
    assert find_debug_file(str(built.prog_linked), None, link, []) == str(built.dir / "prog_linked.debug")
    with ElfFile.open(built.prog_linked_sub) as e:
        sub_link = e.debuglink
    found = find_debug_file(str(built.prog_linked_sub), None, sub_link, [])
    assert found == str(built.prog_linked_sub.parent / ".debug" / "prog_sub.debug")
    # <debug_dir>/<binary's directory>/<name>
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shutil.copy(built.prog_linked, bindir / "prog_linked")
    mirror = tmp_path / "dbg" / str(bindir).lstrip("/")
    mirror.mkdir(parents=True)
    shutil.copy(built.dir / "prog_linked.debug", mirror / "prog_linked.debug")
    got = find_debug_file(str(bindir / "prog_linked"), None, link, [str(tmp_path / "dbg")])
    assert got == str(mirror / "prog_linked.debug")
    # A wrong CRC (the file was rebuilt) is refused.
    assert find_debug_file(str(built.prog_linked), None, (link[0], link[1] ^ 1), []) is None
    # A debuglink is a plain name, never a path.
    assert find_debug_file(str(built.prog_linked), None, ("../prog_linked.debug", link[1]), []) is None


def test_names_a_library_imports_are_not_looked_for_in_its_symtab(tmp_path: Path) -> None:
    """With `together` (one library's API), a name .dynsym imports means the API is linked dynamically: a static
    function of the same family in .symtab is not taken for it."""
    # Oracle: readelf -s on the library built here (api_call imported, api_other a static function)
    (tmp_path / "api.c").write_text("void api_call(void) {}\nvoid api_other(void) {}\n")
    (tmp_path / "user.c").write_text(
        "void api_call(void);\n"
        "__attribute__((noinline)) static void api_other(void) { __asm__ volatile(\"\"); }\n"
        "void user(void) { api_call(); api_other(); }\n")
    run("gcc", "-shared", "-fPIC", "-o", tmp_path / "libapi.so", tmp_path / "api.c")
    run("gcc", "-shared", "-fPIC", "-O1", "-o", tmp_path / "libuser.so", tmp_path / "user.c", "-L", tmp_path, "-lapi")
    user = tmp_path / "libuser.so"
    assert "api_other" in readelf_functions(user) and "api_call" not in readelf_functions(user)
    assert "api_call" in run("readelf", "-W", "--dyn-syms", user)  # as UND
    with ElfFile.open(user) as e:
        assert e.function_addresses({"api_call", "api_other"}) == {"api_other": readelf_functions(user)["api_other"][0]}
        assert e.function_addresses({"api_call", "api_other"}, together=True) == {}
