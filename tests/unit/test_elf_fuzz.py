"""Property tests: hostile bytes fed to the ELF and DWARF readers raise only Unreadable, if anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.core.model import Frame
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.objfmt.dwarf_lines import LineTable
from aiflame.symbolize.objfmt.ehframe import function_starts
from aiflame.symbolize.objfmt.elf import ElfFile, read_build_id
from tests.unit.elf_builders import Built, get_built

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return get_built(tmp_path_factory)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def samples(built: Built) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in (built.prog, built.lib, built.cpp, built.prog_nopie, built.dir / "prog_linked.debug")
    }


def exercise(path: Path) -> None:
    """Every reader on `path`: each either succeeds or raises Unreadable."""
    try:
        bid = read_build_id(path)
        assert bid is None or (isinstance(bid, str) and bid == bid.lower())
    except Unreadable as e:
        assert str(e) and "\n" not in str(e)
    try:
        with ElfFile.open(path) as elf:
            funcs = elf.functions()
            assert [s.addr for s in funcs] == sorted({s.addr for s in funcs})
            for off in (0, 0x40, 0x1000, 0x1130, 1 << 40):
                elf.file_offset_to_vaddr(off)
                elf.debug_layout_vaddr(off)
            table = LineTable(elf)  # never raises: bad DWARF switches line info off
            for s in funcs[:20]:
                table.lookup(s.addr)
            starts = function_starts(elf)
            for s in funcs[:20]:
                starts.find(s.addr)
    except Unreadable as e:
        assert str(e) and "\n" not in str(e)


def write(work: Path, data: bytes) -> Path:
    path = work / "sample.elf"
    path.write_bytes(data)
    return path


@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes(work: Path, data: bytes) -> None:
    exercise(write(work, data))


@FUZZ
@given(cls=st.sampled_from([1, 2]), order=st.sampled_from([1, 2]), rest=st.binary(min_size=0, max_size=2048))
def test_random_bytes_behind_an_elf_ident(work: Path, cls: int, order: int, rest: bytes) -> None:
    exercise(write(work, b"\x7fELF" + bytes([cls, order, 1]) + rest))


@FUZZ
@given(data=st.data())
def test_truncated_real_elf(work: Path, samples: dict[str, bytes], data: st.DataObject) -> None:
    blob = samples[data.draw(st.sampled_from(sorted(samples)))]
    cut = data.draw(st.integers(0, len(blob)))
    exercise(write(work, blob[:cut]))


@FUZZ
@given(data=st.data())
def test_bit_flipped_headers(work: Path, samples: dict[str, bytes], data: st.DataObject) -> None:
    blob = bytearray(samples[data.draw(st.sampled_from(sorted(samples)))])
    shoff = int.from_bytes(blob[0x28:0x30], "little")
    # The ELF header, program headers and notes, or the section header table at the end.
    region = data.draw(st.sampled_from([(0, min(len(blob), 0x400)), (shoff, len(blob))]))
    flips = data.draw(
        st.lists(
            st.tuples(st.integers(*region).filter(lambda i: i < len(blob)), st.integers(0, 7)),
            min_size=1,
            max_size=6,
        )
    )
    for pos, bit in flips:
        blob[pos] ^= 1 << bit
    exercise(write(work, bytes(blob)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupt_anywhere_never_breaks_the_symbolizer(
    work: Path, samples: dict[str, bytes], data: st.DataObject
) -> None:
    """Damage anywhere (symbol tables, DWARF, strings): symbolize() still answers every offset."""
    blob = bytearray(samples[data.draw(st.sampled_from(["prog", "libdemo.so", "cppdemo"]))])
    for _ in range(data.draw(st.integers(1, 40))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    path = write(work, bytes(blob))
    offsets = data.draw(st.lists(st.integers(0, 0x4000), min_size=1, max_size=30))
    s = NativeSymbolizer(cache_dir=str(work / "cache"), debug_dirs=())
    out = s.symbolize(str(path), None, offsets)
    assert set(out) == set(offsets) and all(isinstance(f, Frame) for f in out.values())
    assert all(f.name and f.name != "[unknown]" for f in out.values())


@pytest.fixture(scope="module")
def debug_regions(built: Built) -> dict[str, list[tuple[int, int]]]:
    """File ranges of the .debug_* sections of each sample, to aim corruption at the DWARF reader."""
    out = {}
    for p in (built.prog, built.lib, built.cpp):
        with ElfFile.open(p) as elf:
            out[p.name] = [
                (s.offset, s.offset + s.size) for s in elf.sections if s.name.startswith(".debug_")
            ]
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupt_dwarf_turns_lines_off_quietly(
    work: Path,
    samples: dict[str, bytes],
    debug_regions: dict[str, list[tuple[int, int]]],
    data: st.DataObject,
) -> None:
    name = data.draw(st.sampled_from(sorted(debug_regions)))
    blob = bytearray(samples[name])
    for _ in range(data.draw(st.integers(1, 20))):
        lo, hi = data.draw(st.sampled_from(debug_regions[name]))
        blob[data.draw(st.integers(lo, hi - 1))] = data.draw(st.integers(0, 255))
    with ElfFile.open(write(work, bytes(blob))) as elf:
        table = LineTable(elf)
        for s in elf.functions():
            hit = table.lookup(s.addr + 1)
            assert hit is None or (isinstance(hit[0], str) and isinstance(hit[1], int))


def test_no_descriptor_leaks(work: Path, samples: dict[str, bytes]) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for name, blob in samples.items():
        for cut in (0, 10, 64, 100, len(blob) // 2, len(blob)):
            exercise(write(work, blob[:cut]))
        del name
    assert len(os.listdir("/proc/self/fd")) <= before
