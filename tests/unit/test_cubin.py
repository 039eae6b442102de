"""Cubins of real nvcc builds: kernels checked against readelf, line tables against `nvdisasm -g` on every
instruction, plus hostile inputs."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.symbolize.accel.cubin import Cubin, cubin_arch, parse_cubin
from aiflame.symbolize.accel.fatbin import iter_entries, read_fatbin_file
from tests.cuda_build import KERNELS_CU, KernelPrograms, kernel_programs
from tests.nvdisasm_read import nvdisasm_lines

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KERNELS = {"_Z5scalePffi", "_Z3addPKfS0_Pfi", "_ZN4demo4fillIiEEvPT_S1_i"}


@pytest.fixture(scope="module")
def progs(tmp_path_factory: pytest.TempPathFactory) -> KernelPrograms:
    return kernel_programs(tmp_path_factory)


@pytest.fixture(scope="module")
def cubins(progs: KernelPrograms) -> dict[str, list[bytes]]:
    """Every distinct cubin (kernel-less ones included) of each build, in fatbin order."""
    out: dict[str, list[bytes]] = {}
    for p in progs.all():
        _kind, data = read_fatbin_file(p)
        out[p.name] = list(dict.fromkeys(e.data for e in iter_entries(data) if e.kind == "elf"))
    return out


@pytest.fixture(scope="module")
def code_cubins(cubins: dict[str, list[bytes]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The distinct cubins with kernels across all builds, written out for the NVIDIA tools; name -> path."""
    d = tmp_path_factory.mktemp("cubins")
    out: dict[str, Path] = {}
    for build, blobs in cubins.items():
        for blob in blobs:
            c = parse_cubin(blob)
            if c.has_code and c.digest not in {p.stem.rsplit(".", 1)[-1] for p in out.values()}:
                path = d / f"{build}.sm_{c.arch}.{c.digest}.cubin"
                path.write_bytes(blob)
                out[path.name] = path
    return out


def test_every_instruction_matches_nvdisasm(code_cubins: dict[str, Path]) -> None:
    # Oracle: nvdisasm -g (the line of every instruction), read by nvdisasm_lines (tests/cuda_build.py)
    archs_seen, relocs_seen, checked = set(), set(), 0
    for name, path in code_cubins.items():
        c = parse_cubin(path.read_bytes(), label=name)
        lines = c.lines()
        expected = nvdisasm_lines(path)
        assert set(expected) == set(c.kernels), name
        for kernel, offsets in expected.items():
            assert sorted(offsets) == list(range(0, c.kernels[kernel].size, 16)), (name, kernel)
            for off, want in offsets.items():
                assert lines.lookup(kernel, off) == want, (name, kernel, hex(off))
                checked += 1
        archs_seen.add(c.arch)
        relocs_seen |= {s.name for s in c.sections if s.name in (".rel.debug_line", ".rela.debug_line")}
    # Both relocation flavours (sm_80 .rel, sm_90 .rela) and -G's long tables were covered.
    assert archs_seen == {80, 90} and relocs_seen == {".rel.debug_line", ".rela.debug_line"}
    assert len(code_cubins) == 4 and checked > 1000


def test_line_tables_point_into_the_right_functions(code_cubins: dict[str, Path]) -> None:
    # Oracle: by construction — kernels.cu's source: each kernel's body and the inlined mix()
    src = KERNELS_CU.read_text().splitlines()

    def body(start: str) -> range:
        first = next(i for i, t in enumerate(src, 1) if t.startswith(start))
        last = next(i for i in range(first, len(src)) if src[i - 1].startswith("}"))
        return range(first, last + 1)

    mix = body("__device__ __forceinline__ float mix")
    own = {"_Z5scalePffi": body("__global__ void scale"), "_Z3addPKfS0_Pfi": body("__global__ void add")}
    for path in code_cubins.values():
        c = parse_cubin(path.read_bytes())
        for kernel, span in own.items():
            table = c.lines().table(kernel)
            assert table and table[0].start == 0 and table[-1].end == c.kernels[kernel].size
            assert all(r.file == str(KERNELS_CU) for r in table)
            got = {r.line for r in table}
            assert got <= set(span) | set(mix), kernel
            assert got & set(mix), f"{kernel}: the inlined mix() must show its own lines"
            assert all(a.end <= b.start for a, b in zip(table, table[1:], strict=False))


def test_kernels_match_readelf(code_cubins: dict[str, Path]) -> None:
    # Oracle: readelf -sW of each cubin (names, sizes, entry flag)
    for path in code_cubins.values():
        c = parse_cubin(path.read_bytes())
        assert set(c.kernels) == KERNELS
        out = subprocess.run(["readelf", "-sW", str(path)], check=True, capture_output=True, text=True).stdout
        for row in out.splitlines():
            f = row.split()
            if len(f) >= 8 and f[3] == "FUNC":
                k = c.kernels[f[-1]]
                assert k.size == int(f[2]) and k.entry == ("[<other>: 10]" in row)
                assert k.section == ".text." + k.name and c.sections[k.section_index].name == k.section
                assert len(c.code(k.name)) == k.size


def test_arch_and_kernel_less_cubins(cubins: dict[str, list[bytes]], progs: KernelPrograms) -> None:
    # Oracle: cuobjdump, by way of the fatbin entries test_fatbin checks byte for byte; nvcc's two kernel-less units
    _kind, data = read_fatbin_file(progs.plain)
    for e in iter_entries(data):
        if e.kind == "elf":
            c = parse_cubin(e.data, digest=e.digest)
            assert c.arch == e.arch and c.digest == e.digest
    kernel_less = [parse_cubin(b) for b in cubins[progs.plain.name] if not parse_cubin(b).has_code]
    assert len(kernel_less) == 2 and all(not c.kernels and not c.lines().kernels() for c in kernel_less)


DATA = Path(__file__).resolve().parent.parent / "data" / "cubin"


@pytest.mark.parametrize(("name", "abi", "e_flags"), [("abi7-sm_80.cubin", 7, 0x00500550),
                                                      ("abi8-sm_80.cubin", 8, 0x06005004)])
def test_arch_of_abi7_and_abi8_cubins(name: str, abi: int, e_flags: int) -> None:
    """Real cubins of both layouts (tests/data/cubin/README.md): ptxas 12.9 puts the SM in e_flags' low byte,
    13.5 in bits 8-15; the collector's cubin_arch and the parser read the same 80 from both."""
    # Oracle: the compilers' -arch sm_80 that built them (README there), which cuobjdump confirms (EF_CUDA_SM80)
    data = (DATA / name).read_bytes()
    assert (data[8], struct.unpack_from("<I", data, 0x30)[0]) == (abi, e_flags)
    c = parse_cubin(data)
    assert cubin_arch(data) == c.arch == 80 and list(c.kernels) == ["scale"]


@FUZZ
@given(sm=st.integers(0, 255), abi=st.integers(0, 255), other=st.integers(0, 0xFFFFFFFF))
def test_arch_by_abi_version(sm: int, abi: int, other: int) -> None:
    """Hand-built EM_CUDA headers: the SM in bits 0-7 up to ABI 7, bits 8-15 from ABI 8, whatever the other bits."""
    # Oracle: by construction, the layout of the two real cubins above
    e_flags = (other & ~0xFF) | sm if abi <= 7 else (other & ~0xFF00) | sm << 8
    ident = b"\x7fELF\x02\x01\x01\x41" + bytes([abi]) + bytes(7)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, 0, e_flags, 64, 0, 0, 64, 0, 0)
    assert cubin_arch(header) == sm
    assert cubin_arch(header[:63]) == 0 and cubin_arch(header[:4] + b"\x01" + header[5:]) == 0  # cut; 32-bit


def test_lookup_outside_and_unknown(code_cubins: dict[str, Path]) -> None:
    c = parse_cubin(next(iter(code_cubins.values())).read_bytes())
    size = c.kernels["_Z5scalePffi"].size
    assert c.lines().lookup("_Z5scalePffi", 0) is not None
    assert c.lines().lookup("_Z5scalePffi", size) is None
    assert c.lines().lookup("_Z5scalePffi", -16) is None
    assert c.lines().lookup("nope", 0) is None and c.lines().table("nope") == []
    assert "_Z5scalePffi" in c.lines() and "nope" not in c.lines()


def test_not_a_cubin() -> None:
    with open("/bin/true", "rb") as f:
        host = f.read()
    with pytest.raises(Unreadable, match="not a cubin"):
        parse_cubin(host, label="true")
    with pytest.raises(Unreadable, match="not an ELF"):
        parse_cubin(b"hello")


# --- hostile bytes: only Unreadable may escape ---------------------------------------------------------------


def exercise(blob: bytes) -> None:
    try:
        c = parse_cubin(blob, label="fuzz")
    except Unreadable as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(c, Cubin)
    for k in c.kernels:
        try:
            c.code(k)
        except Unreadable as e:
            assert "\n" not in str(e)
    try:
        lines = c.lines()
    except Unreadable as e:
        assert "\n" not in str(e)
        return
    for k in c.kernels:
        for r in lines.table(k):
            assert r.start < r.end and isinstance(r.file, str)
        lines.lookup(k, 0x40)


@pytest.fixture(scope="module")
def samples(code_cubins: dict[str, Path]) -> list[bytes]:
    return [p.read_bytes() for p in code_cubins.values()]


@FUZZ
@given(data=st.data())
def test_truncated_cubins(samples: list[bytes], data: st.DataObject) -> None:
    blob = data.draw(st.sampled_from(samples))
    exercise(blob[: data.draw(st.integers(0, len(blob)))])


@FUZZ
@given(data=st.data())
def test_bit_flips_in_headers_and_tables(samples: list[bytes], data: st.DataObject) -> None:
    blob = bytearray(data.draw(st.sampled_from(samples)))
    shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    region = data.draw(st.sampled_from([(0, 0x40), (shoff, len(blob)), (0, len(blob))]))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(region[0], region[1] - 1))
        blob[at] ^= 1 << data.draw(st.integers(0, 7))
    exercise(bytes(blob))


@FUZZ
@given(data=st.data())
def test_corrupt_line_programs(samples: list[bytes], data: st.DataObject) -> None:
    blob = bytearray(data.draw(st.sampled_from(samples)))
    c = parse_cubin(bytes(blob))
    spans = [(s.offset, s.offset + s.size) for s in c.sections if s.name.endswith("debug_line") and s.size]
    for _ in range(data.draw(st.integers(1, 12))):
        lo, hi = data.draw(st.sampled_from(spans))
        blob[data.draw(st.integers(lo, hi - 1))] = data.draw(st.integers(0, 255))
    exercise(bytes(blob))


@FUZZ
@given(rest=st.binary(max_size=2048), abi=st.integers(0, 255))
def test_random_bytes_behind_a_cuda_elf_header(rest: bytes, abi: int) -> None:
    ident = b"\x7fELF\x02\x01\x01\x41" + bytes([abi]) + b"\0" * 7
    exercise(ident + struct.pack("<HH", 2, 190) + rest)
