"""Decompression and size bombs (issue #20): what a header declares is checked before anything is inflated, what
a stream really holds can never pass it, and each result is one buffer. Memory is measured with tracemalloc
(every bytes object the decompressors return is a tracked allocation)."""

from __future__ import annotations

import subprocess
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aiflame.core import limits
from aiflame.core.errors import Unreadable
from aiflame.core.limits import AGENT_LIMITS, Allowance, charged_to
from aiflame.symbolize.accel.fatbin import iter_entries, iter_file_entries
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.inflate import inflate_lz4, inflate_zlib, inflate_zstd
from tests.hostile import add_compressed_section, fatbin_zstd_cubin, zlib_zeros, zstd_zeros

MiB = 1 << 20


@pytest.fixture
def agent_limits() -> Iterator[None]:
    old = limits.use(AGENT_LIMITS)
    try:
        yield
    finally:
        limits.use(old)


def peak_mib(fn: Callable[[], object]) -> float:
    tracemalloc.start()
    try:
        try:
            fn()
        except Unreadable:
            pass
        return tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()


def test_zlib_round_trip_and_exact_size() -> None:
    data = bytes(range(256)) * 4096
    import zlib

    z = zlib.compress(data)
    assert inflate_zlib(z, len(data), 1 << 30, "s") == data
    with pytest.raises(Unreadable, match="header says"):
        inflate_zlib(z, len(data) - 1, 1 << 30, "s")
    with pytest.raises(Unreadable, match="header says"):
        inflate_zlib(z, len(data) + 1, 1 << 30, "s")
    with pytest.raises(Unreadable, match="corrupt"):
        inflate_zlib(b"not zlib at all", 10, 1 << 30, "s")


def test_a_declared_size_over_the_cap_inflates_nothing() -> None:
    z = zlib_zeros(512 * MiB)  # ~0.5 MB that a 4 GiB cap used to inflate whole
    assert peak_mib(lambda: inflate_zlib(z, 512 * MiB, 128 * MiB, "bomb")) < 2
    with pytest.raises(Unreadable, match="more than the 134217728"):
        inflate_zlib(z, 512 * MiB, 128 * MiB, "bomb")


def test_a_stream_larger_than_its_header_stops_at_the_header() -> None:
    z = zlib_zeros(256 * MiB)
    with pytest.raises(Unreadable, match="more than 16777217 bytes, header says 16777216"):
        inflate_zlib(z, 16 * MiB, 128 * MiB, "liar")
    assert peak_mib(lambda: inflate_zlib(z, 16 * MiB, 128 * MiB, "liar")) < 4  # measured in 1 MiB steps


def test_an_honest_result_is_one_buffer() -> None:
    z = zlib_zeros(64 * MiB)
    assert 63 < peak_mib(lambda: inflate_zlib(z, 64 * MiB, 128 * MiB, "ok")) < 66  # no joined chunks


def test_zstd_bombs() -> None:
    frame = zstd_zeros(1 << 30)  # a 1 GiB cubin
    with pytest.raises(Unreadable, match="more than the"):
        inflate_zstd(frame, 1 << 30, 96 * MiB, "cubin")
    # a container that under-declares: the frame's own content size rules, and is checked first
    with pytest.raises(Unreadable, match="frame says 1073741824 bytes, header says 1024"):
        inflate_zstd(frame, 1024, 96 * MiB, "cubin")
    assert peak_mib(lambda: inflate_zstd(frame, 1 << 30, 96 * MiB, "cubin")) < 2
    unsized = zstd_zeros(256 * MiB, content_size=False)
    with pytest.raises(Unreadable):
        inflate_zstd(unsized, 0, 16 * MiB, "cubin")
    assert peak_mib(lambda: inflate_zstd(unsized, 0, 16 * MiB, "cubin")) < 18
    small = zstd_zeros(MiB)
    assert inflate_zstd(small, MiB, 16 * MiB, "ok") == bytes(MiB)


def test_lz4_sizes() -> None:
    import lz4.block

    data = bytes(1000)
    block = lz4.block.compress(data, store_size=False)
    assert inflate_lz4(block, 1000, MiB, "ok") == data
    with pytest.raises(Unreadable, match="implausible"):
        inflate_lz4(block, 1 << 30, 1 << 31, "bomb")
    with pytest.raises(Unreadable, match="more than the"):
        inflate_lz4(block, 1000, 999, "capped")


def test_allowance_bounds_a_target_in_all() -> None:
    z = zlib_zeros(8 * MiB)
    a = Allowance("pid 42", 20 * MiB)
    with charged_to(a):
        inflate_zlib(z, 8 * MiB, 128 * MiB, "one")
        inflate_zlib(z, 8 * MiB, 128 * MiB, "two")
        with pytest.raises(Unreadable, match="what pid 42 may make us read"):
            inflate_zlib(z, 8 * MiB, 128 * MiB, "three")
    assert a.refused == 1 and a.left == 4 * MiB
    inflate_zlib(z, 8 * MiB, 128 * MiB, "nobody's")  # outside the block: charged to nobody


@pytest.fixture(scope="module")
def small_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bomblib")
    src = d / "x.c"
    src.write_text("int f(int x) { return x + 1; }\n")
    lib = d / "libx.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_elf_section_bomb_under_agent_limits(small_lib: Path, tmp_path: Path, agent_limits: None) -> None:
    bomb = add_compressed_section(small_lib, tmp_path / "libbomb.so", ".debug_frame", 512 * MiB, 512 * MiB)
    with ElfFile.open(bomb) as elf:
        sec = elf.section(".debug_frame")
        assert sec is not None and elf.is_compressed(sec)
        with pytest.raises(Unreadable, match="more than the 117440512"):
            elf.read_section(sec)
        bomb_sec = sec
        assert peak_mib(lambda: elf.read_section(bomb_sec)) < 2
        assert elf.function_addresses({"f"})  # the rest of the file reads as ever
    liar = add_compressed_section(small_lib, tmp_path / "libliar.so", ".debug_frame", 32 * MiB, 512 * MiB)
    with ElfFile.open(liar) as elf:
        sec = elf.section(".debug_frame")
        assert sec is not None
        with pytest.raises(Unreadable, match="header says"):
            elf.read_section(sec)
        liar_sec = sec
        assert peak_mib(lambda: elf.read_section(liar_sec)) < 8  # its compressed bytes and 1 MiB steps, not 32 MiB


def test_fatbin_with_a_1_gib_zstd_cubin(tmp_path: Path, agent_limits: None) -> None:
    blob = fatbin_zstd_cubin(1 << 30)
    (entry,) = list(iter_entries(blob, label="bomb"))
    assert entry.error is not None and "more than the" in entry.error and entry.data == b""
    assert peak_mib(lambda: list(iter_entries(blob, label="bomb"))) < 4
    path = tmp_path / "bomb.fatbin"
    path.write_bytes(blob)
    with open(path, "rb") as f:
        (entry,) = list(iter_file_entries(f.fileno(), 0, label="bomb"))
        assert entry.error is not None and "more than the" in entry.error
        with pytest.raises(Unreadable, match="runs past its file or registration"):
            list(iter_file_entries(f.fileno(), 0, label="bomb", limit=16))
