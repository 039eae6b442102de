"""`aiflame gpu-symbols` on real nvcc builds: kernel lists, instruction lookups, SASS text, user errors."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from aiflame.cli.main import main
from aiflame.core.errors import BadInput, Unreadable
from aiflame.symbolize.accel import gpu_symbols as gs
from aiflame.symbolize.accel import sass as sass_mod
from aiflame.symbolize.accel.cubin import parse_cubin
from aiflame.symbolize.accel.fatbin import iter_entries, read_fatbin_file
from aiflame.symbolize.accel.gpu_symbols import (
    inventory,
    lookup_instruction,
    parse_arch,
    resolve_kernel,
)
from aiflame.symbolize.accel.sass import disassemble, find_nvdisasm
from aiflame.symbolize.objfmt.demangle import short_name
from tests.cuda_build import KERNELS_CU, KernelPrograms, kernel_programs, nvidia_bin
from tests.nvdisasm_read import nvdisasm_lines, nvdisasm_sass, squeeze

SHORT = {"scale", "add", "demo::fill<int>"}


@pytest.fixture(scope="module")
def progs(tmp_path_factory: pytest.TempPathFactory) -> KernelPrograms:
    return kernel_programs(tmp_path_factory)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep SASS caches out of the home directory (one directory per module, so lookups can hit it)."""
    monkeypatch.setenv("AIFLAME_CACHE", str(tmp_path_factory.getbasetemp() / "gpu-symbols-cache"))


@pytest.mark.parametrize("variant", ["plain", "compressed", "static", "shared_lib", "debug"])
def test_inventory(variant: str, progs: KernelPrograms) -> None:
    # Oracle: readelf -sW of every cubin (kernel names, sizes); nvcc's -gencode flags by construction
    inv = inventory(getattr(progs, variant))
    assert inv.container == "elf" and inv.archs == [80, 90] and inv.skipped == 2 and not inv.notes
    assert inv.ptx_archs == ((90,) if variant in ("plain", "compressed") else ())
    for c in inv.cubins:
        assert {short_name(k.demangled) for k in c.kernels} == SHORT
        assert c.has_lines and all(k.has_lines and k.entry and k.size % 128 == 0 for k in c.kernels)
        assert [k.demangled for k in c.kernels] == sorted(k.demangled for k in c.kernels)


def test_inventory_of_raw_fatbin_and_cubin(progs: KernelPrograms, tmp_path: Path) -> None:
    # Oracle: cuobjdump, by way of the fatbin entries test_fatbin checks byte for byte
    _kind, data = read_fatbin_file(progs.compressed)
    (tmp_path / "k.fatbin").write_bytes(data)
    inv = inventory(tmp_path / "k.fatbin")
    assert inv.container == "fatbin" and inv.archs == [80, 90]
    cubin = next(e for e in iter_entries(data) if e.kind == "elf" and e.arch == 90 and len(e.data) > 4096)
    (tmp_path / "k.cubin").write_bytes(cubin.data)
    inv = inventory(tmp_path / "k.cubin")
    assert inv.container == "cubin" and inv.archs == [90] and inv.cubins[0].digest == cubin.digest


def test_lookup_every_instruction_of_scale(progs: KernelPrograms) -> None:
    # Oracle: nvdisasm -g (line of every instruction) and cuobjdump -sass (the instruction count)
    _kind, data = read_fatbin_file(progs.plain)
    for e in iter_entries(data):
        c = parse_cubin(e.data) if e.kind == "elf" else None
        if c is None or "_Z5scalePffi" not in c.kernels:
            continue
        k = c.kernels["_Z5scalePffi"]
        lines, sass = nvdisasm_lines(e.data)["_Z5scalePffi"], nvdisasm_sass(e.data)
        assert sorted(lines) == list(range(0, k.size, 16))  # nvdisasm's instructions fill the kernel
        for off in range(0, k.size, 16):
            (got,) = lookup_instruction(progs.plain, "_Z5scalePffi", off, arch=c.arch)
            want = lines[off]
            assert (got.file, got.line) == (want if want else (None, None))
            assert got.sass and squeeze(got.sass) == sass[("_Z5scalePffi", off)]
            assert got.kernel_size == k.size and got.cubin_digest == c.digest


def test_lookup_both_archs_and_line(progs: KernelPrograms) -> None:
    # Oracle: by construction — kernels.cu's `void scale(` line; the MOV/LDC every kernel opens with
    found = lookup_instruction(progs.compressed, "scale", 0)
    assert [i.arch for i in found] == [80, 90]
    line = next(i for i, t in enumerate(KERNELS_CU.read_text().splitlines(), 1) if "void scale(" in t)
    assert all(i.file == str(KERNELS_CU) and i.line == line for i in found)
    assert all(re.match(r"(MOV|LDC) R1, c\[0x0\]\[0x28\]", i.sass or "") for i in found)


@pytest.mark.parametrize("query", ["_Z5scalePffi", "scale(float*, float, int)", "scale", "scal", "Pffi"])
def test_kernel_name_forms(query: str, progs: KernelPrograms) -> None:
    (hit,) = lookup_instruction(progs.plain, query, 0x10, arch=90, sass=False)
    assert hit.kernel == "_Z5scalePffi" and hit.sass is None and hit.sass_note is None


def test_resolve_kernel_rules() -> None:
    names = {"_Z1fv": "f()", "_Z1fi": "f(int)", "_Z5fancyv": "fancy()", "_Z3fooIiEvv": "void foo<int>()"}
    assert resolve_kernel("f()", names) == "_Z1fv"
    assert resolve_kernel("foo<int>", names) == "_Z3fooIiEvv"
    assert resolve_kernel("fancy", names) == "_Z5fancyv"
    with pytest.raises(BadInput, match=r"'f' is ambiguous: f\(\), f\(int\)"):
        resolve_kernel("f", names)
    with pytest.raises(BadInput, match="close: fancy"):
        resolve_kernel("fnacy", names)


@pytest.mark.parametrize(
    ("kernel", "offset", "arch", "message"),
    [
        ("sclae", 0, None, r"unknown kernel 'sclae'; close: scale"),
        ("zzzz", 0, None, r"unknown kernel 'zzzz'; known: add, demo::fill<int>, scale"),
        ("a", 0, None, r"ambiguous: add\(.*\), scale\("),
        ("scale", 0x44, None, r"offset 0x44 is not a multiple of 16"),
        ("scale", 0x4000, None, r"offset 0x4000 is outside scale \(0x300 bytes on sm_80, 0x380 bytes on sm_90\)"),
        ("scale", 0x300, None, None),  # inside on sm_90 only
        ("scale", 0x300, 80, r"outside scale \(0x300 bytes on sm_80\)"),
        ("scale", 0, 75, r"scale has no code for sm_75; present: sm_80, sm_90"),
    ],
)
def test_lookup_errors(kernel: str, offset: int, arch: int | None, message: str | None, progs: KernelPrograms) -> None:
    if message is None:
        assert [i.arch for i in lookup_instruction(progs.plain, kernel, offset, arch=arch, sass=False)] == [90]
        return
    with pytest.raises(BadInput, match=message) as info:
        lookup_instruction(progs.plain, kernel, offset, arch=arch, sass=False)
    assert "\n" not in str(info.value)


def test_parse_arch() -> None:
    assert [parse_arch(t) for t in ("sm_90", "90", "compute_80", "sm_90a", "SM_100", "sm120")] == [90, 90, 80, 90,
                                                                                                   100, 120]
    with pytest.raises(BadInput, match="bad architecture"):
        parse_arch("hopper")


def test_no_device_code() -> None:
    with pytest.raises(BadInput, match="no CUDA device code"):
        inventory("/bin/true")


# --- SASS ---------------------------------------------------------------------------------------------------


def test_sass_matches_nvdisasm_and_is_cached(progs: KernelPrograms, tmp_path: Path) -> None:
    # Oracle: nvdisasm -json, read by tests/nvdisasm_read.py (never aiflame's parse_nvdisasm of its text)
    assert find_nvdisasm() is not None  # the wheel next to this interpreter, or PATH
    _kind, data = read_fatbin_file(progs.plain)
    e = next(e for e in iter_entries(data) if e.kind == "elf" and len(e.data) > 4096)
    want = disassemble(e.data, e.digest, cache_dir=str(tmp_path / "cache"))
    assert want is not None and set(want) == {"_Z5scalePffi", "_Z3addPKfS0_Pfi", "_ZN4demo4fillIiEEvPT_S1_i"}
    sass = nvdisasm_sass(e.data)
    assert {(fn, off): squeeze(text) for fn, rows in want.items() for off, text in rows.items()} == sass
    assert all(text and not text.endswith(";") for rows in want.values() for text in rows.values())
    assert any(text.startswith("@P0 ") for rows in want.values() for text in rows.values())
    # A second call is served from the cache: the tool named here does not exist.
    again = disassemble(e.data, e.digest, cache_dir=str(tmp_path / "cache"), nvdisasm=tmp_path / "missing")
    assert again == want
    assert list((tmp_path / "cache").glob("*/*.json.gz"))
    # One function only (what gpu-symbols does for huge cubins).
    c = parse_cubin(e.data)
    one = disassemble(e.data, e.digest, cache_dir=str(tmp_path / "cache"),
                      function_index=c.kernels["_Z3addPKfS0_Pfi"].symbol_index)  # fmt: skip
    assert one == {"_Z3addPKfS0_Pfi": want["_Z3addPKfS0_Pfi"]}


_CUOBJDUMP_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
_CUOBJDUMP_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]{16} \*/\s*$")


def _cuobjdump_sass(cubin: Path) -> dict[str, dict[int, str]]:
    """function -> offset -> instruction, spaces removed, as `cuobjdump -sass` prints them: a second NVIDIA tool
    read by a parser written for this test (never aiflame's parse_nvdisasm)."""
    tool = nvidia_bin("cuobjdump")
    assert tool is not None, "cuobjdump ships in the same wheel as nvcc (make setup)"
    out = subprocess.run([str(tool), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    sass: dict[str, dict[int, str]] = {}
    rows: dict[int, str] | None = None
    for line in out.splitlines():
        if m := _CUOBJDUMP_FUNCTION.match(line):
            rows = sass.setdefault(m.group(1), {})
        elif (m := _CUOBJDUMP_INSTR.match(line)) and rows is not None:
            rows[int(m.group(1), 16)] = "".join(m.group(2).split())
    return sass


def test_sass_matches_cuobjdump(progs: KernelPrograms, tmp_path: Path) -> None:
    """Every instruction of every kernel as cuobjdump prints it. cuobjdump writes branch targets as addresses
    where nvdisasm (which aiflame runs) writes labels: there the opcode and the target's offset must agree."""
    # Oracle: cuobjdump -sass, read by _cuobjdump_sass (written for this test), never parse_nvdisasm
    _kind, data = read_fatbin_file(progs.plain)
    e = next(e for e in iter_entries(data) if e.kind == "elf" and len(e.data) > 4096)
    (tmp_path / "c.cubin").write_bytes(e.data)
    want = _cuobjdump_sass(tmp_path / "c.cubin")
    got = disassemble(e.data, e.digest, use_cache=False)
    assert got is not None and set(got) == set(want) == {"_Z5scalePffi", "_Z3addPKfS0_Pfi",
                                                          "_ZN4demo4fillIiEEvPT_S1_i"}
    labelled = 0
    for fn, rows in want.items():
        ours = {off: "".join(text.split()).rstrip(";") for off, text in got[fn].items()}
        assert set(ours) == set(rows), fn  # the same offsets, none missing, none extra
        for off, text in rows.items():
            if ".L_x_" in ours[off]:  # a label: cuobjdump's address operand instead
                labelled += 1
                assert re.sub(r"\.L_x_\d+", "", ours[off]) == re.sub(r"0x[0-9a-f]+$", "", text), (fn, off)
            else:
                assert ours[off] == text, (fn, off, ours[off], text)
    assert labelled < sum(len(r) for r in want.values()) // 4  # most lines compared whole


def test_sass_cache_ignores_garbage(progs: KernelPrograms, tmp_path: Path) -> None:
    _kind, data = read_fatbin_file(progs.plain)
    e = next(e for e in iter_entries(data) if e.kind == "elf" and len(e.data) > 4096)
    path = Path(sass_mod._Cache(str(tmp_path)).path_for(e.digest))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not gzip")
    assert disassemble(e.data, e.digest, cache_dir=str(tmp_path))  # rebuilt and rewritten
    assert disassemble(e.data, e.digest, cache_dir=str(tmp_path), nvdisasm=tmp_path / "missing")


def test_without_nvdisasm(progs: KernelPrograms, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sass_mod, "find_nvdisasm", lambda: None)
    monkeypatch.setattr(gs, "find_nvdisasm", lambda: None)
    _kind, data = read_fatbin_file(progs.plain)
    e = next(e for e in iter_entries(data) if e.kind == "elf" and len(e.data) > 4096)
    assert disassemble(e.data, e.digest, use_cache=False) is None
    (hit, _) = lookup_instruction(progs.plain, "add", 0x20)
    assert hit.sass is None and hit.sass_note and "nvdisasm not found" in hit.sass_note and hit.line


def test_nvdisasm_failure_is_a_note(progs: KernelPrograms, tmp_path: Path) -> None:
    with pytest.raises(Unreadable, match="nvdisasm failed"):
        disassemble(b"\x7fELF garbage", "0" * 64, use_cache=False, nvdisasm=nvidia_bin("nvdisasm"))


# --- the command --------------------------------------------------------------------------------------------


def cli(*argv: str) -> int:
    return main(["gpu-symbols", *argv])


def test_cli_list(progs: KernelPrograms, capsys: pytest.CaptureFixture[str]) -> None:
    # Oracle: readelf -sW (0x380 bytes of scale on sm_90); nvcc's build flags by construction
    assert cli(str(progs.plain)) == 0
    out = capsys.readouterr().out
    assert "2 cubin(s) with code; PTX for compute_90; 2 without kernels skipped" in out
    assert re.search(r"sm_80 .* 3 functions  with line info", out) and "sm_90" in out
    assert re.search(r"0x380  yes    kernel  scale\(float\*, float, int\)", out)
    assert cli(str(progs.plain), "--arch", "sm_90") == 0
    assert "sm_80" not in capsys.readouterr().out.split("\n", 1)[1]


def test_cli_lookup(progs: KernelPrograms, capsys: pytest.CaptureFixture[str]) -> None:
    # Oracle: readelf -sW (fill's 0x180 bytes on sm_90); kernels.cu as the source
    assert cli(str(progs.static), "--kernel", "fill", "--offset", "0x10", "--arch", "90") == 0
    out = capsys.readouterr().out
    assert "sm_90  void demo::fill<int>(int*, int, int) +0x10  (kernel size 0x180)" in out
    assert f"source  {KERNELS_CU}:" in out and re.search(r"sass    \S", out)


@pytest.mark.parametrize(
    ("argv", "rc", "message"),
    [
        (["--kernel", "nope", "--offset", "0"], 1, "aiflame: error: unknown kernel 'nope'"),
        (["--kernel", "scale", "--offset", "0x8"], 1, "aiflame: error: offset 0x8 is not a multiple of 16"),
        (["--kernel", "scale"], 2, "--kernel and --offset go together"),
        (["--arch", "sm_75"], 1, "no code for sm_75; present: sm_80, sm_90"),
    ],
)
def test_cli_errors(
    argv: list[str], rc: int, message: str, progs: KernelPrograms, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(str(progs.plain), *argv) == rc
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("x", "--offset", "zz") == 2
    assert "not an offset" in capsys.readouterr().err
    assert cli("x", "--arch", "hopper") == 2
    assert "bad architecture" in capsys.readouterr().err
