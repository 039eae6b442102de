"""Function starts from .eh_frame_hdr, checked against nm on binaries built for the test and on this machine's
Python; damaged tables give Unreadable or no starts, never a wrong crash."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.ehframe import function_starts
from aiflame.symbolize.objfmt.elf import ElfFile
from tests.unit.elf_builders import Built, get_built, readelf_functions, section_offset

DEBIAN_PYTHON = "/usr/bin/python3.11"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return get_built(tmp_path_factory)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("prog", {"main", "add_numbers", "loop_sum", "static_helper"}),
        ("prog_stripped", {"main", "add_numbers", "loop_sum", "static_helper"}),
        ("lib_stripped", {"lib_exported", "lib_private"}),
        ("cpp", {"main", "_ZNK4demo6Engine3runEi"}),
    ],
)
def test_every_compiled_function_starts_where_nm_says(built: Built, name: str, expected: set[str]) -> None:
    # Oracle: readelf -s (function symbols of the file or of its unstripped twin)
    path: Path = getattr(built, name)
    twin = {"prog_stripped": built.prog, "lib_stripped": built.lib}.get(name, path)
    funcs = {n: a for n, (a, size) in readelf_functions(twin).items() if size}
    with ElfFile.open(path) as elf:
        starts = function_starts(elf)
    found = set()
    for fn, addr in funcs.items():
        if starts.find(addr) is None:
            continue  # code without CFI (crt stubs, hand-written assembly)
        assert starts.find(addr) == addr, fn
        assert starts.find(addr + 1) == addr, fn
        found.add(fn)
    assert expected <= found


def test_addresses_outside_code_have_no_function(built: Built) -> None:
    # Oracle: by construction — .rodata, address 0 and 2**60 hold no code
    with ElfFile.open(built.prog) as elf:
        starts = function_starts(elf)
        rodata = elf.section(".rodata")
        assert rodata is not None
        assert starts.find(rodata.addr) is None
        assert starts.find(0) is None and starts.find(1 << 60) is None


@pytest.mark.skipif(not os.path.exists(DEBIAN_PYTHON), reason="Debian's python3.11 is not installed")
def test_static_functions_of_a_stripped_interpreter() -> None:
    # Oracle: readelf --dyn-syms (PyObject_GC_Del's address in Debian's python3.11)
    dyn = readelf_functions(Path(DEBIAN_PYTHON), dynamic=True)
    with ElfFile.open(DEBIAN_PYTHON) as elf:
        assert elf.section(".symtab") is None
        starts = function_starts(elf)
    assert len(starts) > 5000
    addr = dyn["PyObject_GC_Del"][0]
    assert starts.find(addr) == addr and starts.find(addr + 7) == addr


def _patched(built: Built, tmp_path: Path, at: int, data: bytes) -> Path:
    blob = bytearray(built.prog.read_bytes())
    hdr = section_offset(built.prog, ".eh_frame_hdr")
    blob[hdr + at : hdr + at + len(data)] = data
    out = tmp_path / "patched"
    out.write_bytes(bytes(blob))
    return out


def test_unknown_table_encoding_gives_no_starts(built: Built, tmp_path: Path) -> None:
    with ElfFile.open(_patched(built, tmp_path, 3, b"\x1b")) as elf:  # pcrel table entries: not read
        assert len(function_starts(elf)) == 0


@pytest.mark.parametrize("count", [1 << 20, (1 << 31) - 1])
def test_entry_count_beyond_the_section_is_an_error(built: Built, tmp_path: Path, count: int) -> None:
    with ElfFile.open(_patched(built, tmp_path, 8, struct.pack("<I", count))) as elf:
        with pytest.raises(Unreadable, match="does not fit"):
            function_starts(elf)
