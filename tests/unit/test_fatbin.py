"""Fatbin containers of real nvcc builds, checked against `cuobjdump` (the oracle), plus hostile inputs."""

from __future__ import annotations

import hashlib
import struct
import subprocess
from collections import Counter
from pathlib import Path

import lz4.block
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.symbolize.accel.fatbin import (
    FATBIN_MAGIC,
    FatbinEntry,
    decompress_payload,
    fatbin_size,
    find_fatbins,
    iter_entries,
    read_fatbin_file,
)
from tests.cuda_build import KernelPrograms, kernel_programs, nvidia_bin

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VARIANTS = ["plain", "compressed", "static", "shared_lib", "debug"]


@pytest.fixture(scope="module")
def progs(tmp_path_factory: pytest.TempPathFactory) -> KernelPrograms:
    return kernel_programs(tmp_path_factory)


@pytest.fixture(scope="module")
def sections(progs: KernelPrograms) -> dict[str, bytes]:
    out = {}
    for name in VARIANTS:
        kind, data = read_fatbin_file(getattr(progs, name))
        assert kind == "elf" and data
        out[name] = data
    return out


def cuobjdump() -> Path:
    tool = nvidia_bin("cuobjdump")
    if tool is None:
        pytest.fail("cuobjdump not found: install the accel-test extra (`make setup`)")
    return tool


def cuobjdump_digests(container: bytes, work: Path) -> Counter[tuple[str, str]]:
    """(kind, sha256) of every file `cuobjdump -xelf all -xptx all` extracts from one fatbin container.

    One container per call: cuobjdump names files after the source file and architecture, so same-named
    entries of different containers in one binary would overwrite each other."""
    work.mkdir(parents=True)
    (work / "in.fatbin").write_bytes(container)
    out = work / "x"
    out.mkdir()
    subprocess.run([str(cuobjdump()), "-xelf", "all", "-xptx", "all", "../in.fatbin"], cwd=out, check=True,
                   capture_output=True)  # fmt: skip
    return Counter(
        ("ptx" if p.suffix == ".ptx" else "elf", hashlib.sha256(p.read_bytes()).hexdigest()) for p in out.iterdir()
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_entries_byte_identical_to_cuobjdump(
    variant: str, progs: KernelPrograms, sections: dict[str, bytes], tmp_path: Path
) -> None:
    # Oracle: cuobjdump -xelf/-xptx (the sha256 of every file it extracts) and -lelf/-lptx
    data = sections[variant]
    spans = find_fatbins(data)
    assert len(spans) >= 2  # one kernel-less container per translation unit, one with the kernels
    total = Counter[tuple[str, str]]()
    for i, (start, size) in enumerate(spans):
        ours = Counter((e.kind, e.digest) for e in iter_entries(data[start : start + size]))
        theirs = cuobjdump_digests(data[start : start + size], tmp_path / str(i))
        assert ours == theirs, f"container {i} at {start:#x}"
        total += ours
    entries = list(iter_entries(data))
    assert Counter((e.kind, e.digest) for e in entries) == total
    for e in entries:
        assert e.error is None and e.digest == hashlib.sha256(e.data).hexdigest()
    # Entry counts of the whole binary, listed by cuobjdump without our container split.
    listing = subprocess.run([str(cuobjdump()), "-lelf", "-lptx", str(getattr(progs, variant))], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
    assert sum(e.kind == "elf" for e in entries) == listing.count("ELF file")
    assert sum(e.kind == "ptx" for e in entries) == listing.count("PTX file")


def test_architectures_and_kinds(sections: dict[str, bytes]) -> None:
    # Oracle: by construction — nvcc -gencode for sm_80 and sm_90 with PTX for compute_90; the ELF header's e_machine
    plain = list(iter_entries(sections["plain"]))
    assert sorted({e.arch for e in plain if e.kind == "elf"}) == [80, 90]
    assert [e.arch for e in plain if e.kind == "ptx"] == [90]
    for e in plain:
        if e.kind == "elf":
            assert e.data[:4] == b"\x7fELF" and struct.unpack_from("<H", e.data, 18)[0] == 190
            assert e.flags & 0x1 and e.flags & 0x10  # 64-bit, Linux
        else:
            assert b".version" in e.data and not e.data.endswith(b"\0")


def test_compressed_build_decodes_to_the_same_entries(sections: dict[str, bytes]) -> None:
    # Oracle: cuobjdump, by way of test_entries_byte_identical_to_cuobjdump on both builds
    plain = list(iter_entries(sections["plain"]))
    packed = list(iter_entries(sections["compressed"]))
    assert [(e.kind, e.arch, e.digest) for e in packed] == [(e.kind, e.arch, e.digest) for e in plain]
    assert all(e.flags & 0x8000 for e in packed)  # zstd, cubins included
    assert not any(e.flags & 0x8000 for e in plain if e.kind == "elf")  # default: PTX only
    assert len(sections["compressed"]) < len(sections["plain"])


def test_static_and_shared_builds_carry_the_same_kernels(sections: dict[str, bytes]) -> None:
    # Oracle: cuobjdump, by way of test_entries_byte_identical_to_cuobjdump on every build
    def code_digests(name: str) -> set[str]:
        return {e.digest for e in iter_entries(sections[name]) if e.kind == "elf" and len(e.data) > 4096}

    assert code_digests("plain") == code_digests("static") == code_digests("shared_lib")
    assert code_digests("debug").isdisjoint(code_digests("plain"))


def test_fatbin_read_from_memory(sections: dict[str, bytes]) -> None:
    """What a capture reads from /proc/PID/mem: 16 header bytes to learn the size, then the container."""
    # Oracle: by construction — the container's bytes followed by 100 bytes of 0xff
    data = sections["compressed"]
    start, size = find_fatbins(data)[-1]
    assert fatbin_size(data[start : start + 16]) == size
    memory = data[start : start + size] + b"\xff" * 100  # whatever follows in memory
    got = list(iter_entries(memory[: fatbin_size(memory[:16])]))
    assert [e.digest for e in got] == [e.digest for e in iter_entries(data[start : start + size])]
    assert all(e.offset < size for e in got)


def test_only_selects_entries_by_offset(sections: dict[str, bytes]) -> None:
    entries = list(iter_entries(sections["plain"]))
    want = {entries[-1].offset, entries[0].offset}
    assert [e.offset for e in iter_entries(sections["plain"], only=want)] == sorted(want)


def test_file_kinds(progs: KernelPrograms, sections: dict[str, bytes], tmp_path: Path) -> None:
    fb = tmp_path / "k.fatbin"
    fb.write_bytes(sections["plain"])
    assert read_fatbin_file(fb) == ("fatbin", sections["plain"])
    cubin = next(e for e in iter_entries(sections["plain"]) if e.kind == "elf")
    cb = tmp_path / "k.cubin"
    cb.write_bytes(cubin.data)
    assert read_fatbin_file(cb) == ("cubin", cubin.data)
    assert read_fatbin_file("/bin/true") == ("elf", b"")
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(Unreadable, match="not an ELF"):
        read_fatbin_file(text)
    with pytest.raises(Unreadable, match="No such file"):
        read_fatbin_file(tmp_path / "missing")


# --- synthetic containers: compression methods the nvcc defaults don't produce -----------------------------


def entry_bytes(kind: int, arch: int, payload: bytes, *, flags: int = 0x11, csize: int = 0, usize: int = 0,
                header: int = 64) -> bytes:  # fmt: skip
    padded = payload + b"\0" * (-len(payload) % 8)
    head = struct.pack("<HHIQIIHHIIIQ", kind, 0x0101, header, len(padded), csize, 0, 8, 1, arch, 0, 0, flags)
    head += b"\0" * 8 + struct.pack("<Q", usize)
    return head + b"\0" * (header - len(head)) + padded


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


@pytest.fixture(scope="module")
def a_cubin(sections: dict[str, bytes]) -> FatbinEntry:
    return max((e for e in iter_entries(sections["plain"]) if e.kind == "elf"), key=lambda e: len(e.data))


def test_lz4_zstd_and_unknown_compression(a_cubin: FatbinEntry) -> None:
    # Oracle: lz4 and zstandard's own compressors (payloads packed here), against the cubin itself
    data = a_cubin.data
    lz = lz4.block.compress(data, store_size=False)
    zs = zstandard.ZstdCompressor().compress(data)
    blob = container(
        entry_bytes(2, 90, lz, flags=0x2011, csize=len(lz), usize=len(data)),
        entry_bytes(2, 90, zs, flags=0x8011, csize=len(zs), usize=len(data), header=112),
        entry_bytes(2, 75, lz, flags=0x1011, csize=len(lz), usize=len(data)),  # the older NVIDIA LZ
        entry_bytes(1, 90, b"//ptx\n.version 9.0\n\0\0\0", header=96),
        entry_bytes(4, 90, b"LTO IR, skipped"),
    )
    got = list(iter_entries(blob))
    assert [(e.kind, e.arch) for e in got] == [("elf", 90), ("elf", 90), ("elf", 75), ("ptx", 90)]
    assert got[0].digest == got[1].digest == a_cubin.digest and got[0].error is None
    assert got[2].error is not None and "older NVIDIA LZ" in got[2].error and "\n" not in got[2].error
    assert got[2].data == b"" and got[2].digest == ""
    assert got[3].data == b"//ptx\n.version 9.0\n"


def test_decompress_payload_errors(a_cubin: FatbinEntry) -> None:
    zs = zstandard.ZstdCompressor().compress(a_cubin.data)
    with pytest.raises(Unreadable, match="header says"):
        decompress_payload(zs, 0x8000, len(zs), len(a_cubin.data) - 1)
    with pytest.raises(Unreadable, match="exceeds the payload"):
        decompress_payload(zs, 0x8000, len(zs) + 1, len(a_cubin.data))
    with pytest.raises(Unreadable, match="unknown method"):
        decompress_payload(zs, 0x4000, len(zs), len(a_cubin.data))
    with pytest.raises(Unreadable, match="implausible"):
        decompress_payload(b"\x10abc", 0x2000, 4, 1 << 40)


def test_container_errors_are_one_line() -> None:
    good = container(entry_bytes(1, 90, b"ptx text"))
    cases = [
        good[:-8],  # payload cut
        good[:40],  # entry header cut
        good[:12],  # container header cut: no container found at all
        container(entry_bytes(1, 90, b"ptx", header=32)),  # header size below the minimum
    ]
    results: list[list[FatbinEntry] | None] = []
    for blob in cases:
        try:
            results.append(list(iter_entries(blob, label="mem")))
        except Unreadable as e:
            assert str(e).startswith("mem: ") and "\n" not in str(e)
            results.append(None)
    assert results == [None, None, [], None]
    with pytest.raises(Unreadable, match="not a fatbin"):
        fatbin_size(b"\0" * 16)


# --- hostile bytes: only Unreadable may escape -------------------------------------------------------------


def exercise(blob: bytes) -> None:
    try:
        for e in iter_entries(blob, label="fuzz"):
            assert e.kind in ("ptx", "elf")
            if e.error is None:
                assert e.digest == hashlib.sha256(e.data).hexdigest()
            else:
                assert e.error and "\n" not in e.error and not e.data
    except Unreadable as err:
        assert str(err) and "\n" not in str(err)


@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    exercise(data)


@FUZZ
@given(size=st.integers(0, 1 << 20), rest=st.binary(max_size=1024))
def test_random_bytes_behind_a_fatbin_header(size: int, rest: bytes) -> None:
    exercise(struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, size) + rest)


@FUZZ
@given(data=st.data())
def test_truncated_real_fatbins(sections: dict[str, bytes], data: st.DataObject) -> None:
    blob = sections[data.draw(st.sampled_from(["plain", "compressed"]))]
    exercise(blob[: data.draw(st.integers(0, len(blob)))])


@FUZZ
@given(data=st.data())
def test_bit_flips_in_headers(sections: dict[str, bytes], data: st.DataObject) -> None:
    blob = bytearray(sections[data.draw(st.sampled_from(["plain", "compressed"]))])
    heads = [s for s, _ in find_fatbins(bytes(blob))] + [e.offset for e in iter_entries(bytes(blob))]
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.sampled_from(heads)) + data.draw(st.integers(0, 111))
        if at < len(blob):
            blob[at] ^= 1 << data.draw(st.integers(0, 7))
    exercise(bytes(blob))


@FUZZ
@given(data=st.data())
def test_corrupt_compressed_payloads(sections: dict[str, bytes], data: st.DataObject) -> None:
    """Damage inside zstd payloads: the entry reports an error (or, rarely, still decodes); nothing raises."""
    blob = bytearray(sections["compressed"])
    entries = list(iter_entries(bytes(blob)))
    e = data.draw(st.sampled_from(entries))
    hsize = struct.unpack_from("<I", blob, e.offset + 4)[0]
    csize = struct.unpack_from("<I", blob, e.offset + 0x10)[0]
    for _ in range(data.draw(st.integers(1, 10))):
        at = e.offset + hsize + data.draw(st.integers(0, csize - 1))
        blob[at] = data.draw(st.integers(0, 255))
    got = list(iter_entries(bytes(blob)))
    assert len(got) == len(entries)
    hit = next(g for g in got if g.offset == e.offset)
    assert hit.error is None or "\n" not in hit.error
    assert all(g.digest == o.digest for g, o in zip(got, entries, strict=True) if g.offset != e.offset)


@FUZZ
@given(payload=st.binary(max_size=512), flags=st.sampled_from([0x2000, 0x8000, 0x1000, 0x0]),
       usize=st.integers(0, 1 << 16))  # fmt: skip
def test_random_compressed_payloads(payload: bytes, flags: int, usize: int) -> None:
    for data in (payload, b"\x28\xb5\x2f\xfd" + payload):
        try:
            out = decompress_payload(data, flags, len(data), usize)
        except Unreadable as e:
            assert "\n" not in str(e)
        else:
            assert isinstance(out, bytes)
