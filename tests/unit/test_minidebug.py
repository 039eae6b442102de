"""MiniDebugInfo (.gnu_debugdata): names of static functions in a stripped binary, and hostile section contents
(bad xz, truncated streams, nested files that are not ELF or are damaged, decompression bombs) that give one
Unreadable per file and never cost the binary's other names.

The MiniDebugInfo files are made the way Fedora's find-debuginfo makes them (the recipe in gdb's manual):
the functions .dynsym lacks, kept from an --only-keep-debug copy, xz-compressed into the stripped binary."""

from __future__ import annotations

import lzma
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.core.model import FrameKind
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.minidebug import SECTION, minidebug_functions
from tests.unit.elf_builders import Built, get_built, readelf_functions, run, vaddr_to_offset

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])
SLOT = 1 << 16  # room in the fuzz template's section for any payload


class Made:
    def __init__(self, base: Path, built: Built) -> None:
        self.base = base
        self.built = built
        dynamic = _nm(built.prog, "-D")
        funcs = {n for n, t in _nm_typed(built.prog) if t in "Tt"}
        self.kept = sorted(funcs - dynamic)
        debug = base / "prog.debug"
        run("objcopy", "--only-keep-debug", built.prog, debug)
        keep = base / "keep_symbols"
        keep.write_text("".join(n + "\n" for n in self.kept))
        mini = base / "mini"
        run("objcopy", "-S", "--remove-section", ".gdb_index", "--remove-section", ".comment",
            f"--keep-symbols={keep}", debug, mini)
        self.nested = mini.read_bytes()
        self.payload = lzma.compress(self.nested, format=lzma.FORMAT_XZ)
        self.stripped = base / "prog_stripped"
        run("strip", "--strip-all", "-R", ".comment", "-o", self.stripped, built.prog)
        self.prog = self.with_section(self.payload, "prog_mini")
        # A template with a roomy section whose bytes and size each fuzz example overwrites in place.
        self.template_path = self.with_section(bytes(SLOT), "prog_template")
        self.template = self.template_path.read_bytes()
        with ElfFile.open(self.template_path) as elf:
            sec = elf.section(SECTION)
            assert sec is not None
            self.slot_offset = sec.offset
            index = elf.sections.index(sec)
        shoff = struct.unpack_from("<Q", self.template, 0x28)[0]
        shentsize = struct.unpack_from("<H", self.template, 0x3A)[0]
        self.size_field = shoff + index * shentsize + 32  # Elf64_Shdr.sh_size

    def with_section(self, payload: bytes, name: str) -> Path:
        blob = self.base / f"{name}.xz"
        blob.write_bytes(payload)
        out = self.base / name
        run("objcopy", f"--add-section={SECTION}={blob}", self.stripped, out)
        return out

    def patched(self, payload: bytes, path: Path) -> Path:
        assert len(payload) <= SLOT
        data = bytearray(self.template)
        data[self.slot_offset : self.slot_offset + len(payload)] = payload
        struct.pack_into("<Q", data, self.size_field, len(payload))
        path.write_bytes(bytes(data))
        return path


def _nm(path: Path, *flags: str) -> set[str]:
    return {n for n, _t in _nm_typed(path, *flags)}


def _nm_typed(path: Path, *flags: str) -> list[tuple[str, str]]:
    out = []
    for line in run("nm", *flags, "--format=posix", "--defined-only", path).splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out.append((parts[0], parts[1]))
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    return Made(tmp_path_factory.mktemp("minidebug"), get_built(tmp_path_factory))


def _offsets(made: Made, funcs: list[str], delta: int = 2) -> dict[str, int]:
    syms = readelf_functions(made.built.prog)
    return {f: vaddr_to_offset(made.stripped, syms[f][0] + delta) for f in funcs}


def test_fixture_is_a_real_minidebuginfo(made: Made) -> None:
    # Oracle: nm -D (the static functions are not in .dynsym); the xz magic
    assert {"static_helper", "add_numbers", "loop_sum"} <= set(made.kept)
    assert not {"static_helper", "add_numbers"} & _nm(made.stripped, "-D")
    assert made.payload[:6] == b"\xfd7zXZ\x00"


def test_static_functions_named_from_minidebuginfo(made: Made, tmp_path: Path) -> None:
    # Oracle: readelf -s of the unstripped twin (each function's address)
    offs = _offsets(made, ["static_helper", "add_numbers", "loop_sum", "main"])
    sym = NativeSymbolizer(cache_dir=str(tmp_path / "c"), debug_dirs=())
    frames = sym.symbolize(str(made.prog), None, offs.values())
    assert {f: frames[o].name for f, o in offs.items()} == {f: f for f in offs}
    assert {frames[o].kind for o in offs.values()} == {FrameKind.NATIVE}
    # The same binary without the section: module+offset of each function's start.
    bare = NativeSymbolizer(cache_dir=str(tmp_path / "c2"), debug_dirs=()).symbolize(
        str(made.stripped), None, offs.values())
    assert all(bare[o].name.startswith("prog_stripped+0x") for o in offs.values())


def test_minidebug_functions_are_the_kept_symbols(made: Made) -> None:
    # Oracle: nm of the unstripped build, and the symbol list given to objcopy
    with ElfFile.open(made.prog) as elf:
        names = {s.name for s in minidebug_functions(elf)}
    funcs = {n for n, t in _nm_typed(made.built.prog) if t in "Tt"}
    assert names == set(made.kept) & funcs


def _error(path: Path, **caps: int) -> str:
    with ElfFile.open(path) as elf, pytest.raises(Unreadable) as err:
        minidebug_functions(elf, **caps)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and SECTION in msg
    return msg


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("garbage", "corrupt xz"),
        ("truncated", "truncated xz"),
        ("not_elf", "not an ELF"),
        ("other_machine", "another machine"),
    ],
)
def test_malformed_section_is_one_clear_error(made: Made, tmp_path: Path, case: str, expect: str) -> None:
    nested = bytearray(made.nested)
    payload = {
        "garbage": b"\xfd7zXZ\x00" + bytes(range(200)),
        "truncated": made.payload[: len(made.payload) // 2],
        "not_elf": lzma.compress(b"#!/bin/sh\n" * 50, format=lzma.FORMAT_XZ),
        "other_machine": lzma.compress(bytes(nested[:18]) + struct.pack("<H", 183) + bytes(nested[20:]),
                                       format=lzma.FORMAT_XZ),
    }[case]
    path = made.patched(payload, tmp_path / case)
    assert expect in _error(path)
    # The binary keeps its other names and gets module+offset for the rest.
    off = _offsets(made, ["static_helper"])["static_helper"]
    frame = NativeSymbolizer(cache_dir=str(tmp_path / "c"), debug_dirs=()).symbolize(str(path), None, [off])[off]
    assert frame.kind == FrameKind.UNKNOWN and frame.name.startswith(f"{case}+0x")


def test_decompression_bomb_is_capped(made: Made, tmp_path: Path) -> None:
    bomb = lzma.compress(bytes(8 << 20), format=lzma.FORMAT_XZ, preset=9)
    assert len(bomb) < SLOT
    path = made.patched(bomb, tmp_path / "bomb")
    assert "more than 1048576 bytes" in _error(path, max_decompressed=1 << 20)


def test_compressed_size_is_capped(made: Made) -> None:
    assert "more than the 100 read" in _error(made.prog, max_compressed=100)


def _payloads(made: Made) -> st.SearchStrategy[bytes]:
    def flip(data: bytes, edits: list[tuple[int, int]]) -> bytes:
        out = bytearray(data)
        for pos, value in edits:
            out[pos % len(out)] = value
        return bytes(out)

    edits = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8)
    return st.one_of(
        st.binary(max_size=2048),
        st.binary(max_size=2048).map(lambda b: lzma.compress(b, format=lzma.FORMAT_XZ)),
        st.integers(0, len(made.payload)).map(lambda n: made.payload[:n]),
        edits.map(lambda e: flip(made.payload, e)),
        # A valid stream around a damaged nested ELF file: its parser sees the damage.
        edits.map(lambda e: lzma.compress(flip(made.nested, e), format=lzma.FORMAT_XZ)),
    )


@FUZZ
@given(data=st.data())
def test_hostile_sections_never_crash(made: Made, tmp_path: Path, data: st.DataObject) -> None:
    payload = data.draw(_payloads(made))
    path = made.patched(payload, tmp_path / "fuzz")
    try:
        with ElfFile.open(path) as elf:
            syms = minidebug_functions(elf, max_decompressed=4 << 20)
        assert [s.addr for s in syms] == sorted({s.addr for s in syms})
    except Unreadable as e:
        assert str(e) and "\n" not in str(e)
    offs = list(_offsets(made, ["static_helper", "main"]).values())
    frames = NativeSymbolizer(cache_dir=str(tmp_path / "cache"), debug_dirs=()).symbolize(str(path), None, offs)
    assert set(frames) == set(offs) and all(f.name and f.name != "[unknown]" for f in frames.values())
