"""`aiflame annotate` on hand-built captures over real binaries: counting leaf samples per instruction, ranking and
sorting, stripped code, name matching and its errors, GPU kernels with stall reasons, and the command's text.

Past 400 lines by one `Oracle:` line per truth check (issue #30), kept in one file with its fixtures."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from aiflame.cli.main import main
from aiflame.core.capture import write_capture
from aiflame.core.errors import BadInput, NothingToShow
from aiflame.core.raw import Capture, CaptureFooter, CaptureHeader, GpuCode, Mapping, ProcessSnapshot, RawSample
from aiflame.core.raw import RawStallSample as Stall
from aiflame.symbolize import stalls
from aiflame.symbolize.accel.cubin import parse_cubin
from aiflame.symbolize.accel.fatbin import iter_entries, read_fatbin_file
from aiflame.symbolize.annotate import (
    Annotation,
    BinaryNotFound,
    annotate,
)
from aiflame.symbolize.annotate import gpu as annotate_gpu
from aiflame.symbolize.objfmt.elf import read_build_id
from tests.annotate_build import HotLoop, addr2line, build_hot_loop, objdump_instructions
from tests.cuda_build import KernelPrograms, kernel_programs
from tests.nvdisasm_read import nvdisasm_lines, nvdisasm_sass, squeeze
from tests.unit.elf_builders import cxxfilt, readelf_functions, vaddr_to_offset

KERNEL_PC = 0xFFFFFFFF81000000
SCALE = "_Z5scalePffi"
LONG_SB = "smsp__pcsamp_warps_issue_stalled_long_scoreboard"
WAIT = "smsp__pcsamp_warps_issue_stalled_wait"

CPP_SOURCE = r"""
namespace demo {
struct Engine {
    __attribute__((noinline)) int run(int n) const;
};
int Engine::run(int n) const {
    int s = 0;
    for (int i = 0; i < n; i++) s += i * 3;
    return s;
}
}  // namespace demo
int main(int argc, char **) { return demo::Engine().run(argc) & 1; }
"""


@pytest.fixture(scope="module")
def hot(tmp_path_factory: pytest.TempPathFactory) -> HotLoop:
    return build_hot_loop(tmp_path_factory.mktemp("annotate"))


@pytest.fixture(scope="module")
def cpp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("annotate-cpp")
    (d / "engine.cpp").write_text(CPP_SOURCE)
    out = d / "engine"
    subprocess.run(["g++", "-O2", "-g", "-o", str(out), str(d / "engine.cpp")], check=True)
    return out


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIFLAME_CACHE", str(tmp_path_factory.getbasetemp() / "annotate-cache"))


class Cap:
    """A capture built by hand: binaries mapped whole (file offset 0) at their own base in pid 1."""

    def __init__(self) -> None:
        self.bases: dict[Path, int] = {}
        self.mappings: list[Mapping] = []
        self.samples: list[RawSample] = []
        self.stalls: list[Stall] = []
        self.gpu_code: list[GpuCode] = []

    def map(self, binary: Path, build_id: str | None = None) -> int:
        if binary not in self.bases:
            base = 0x5500_0000_0000 + len(self.bases) * 0x1000_0000
            size = (binary.stat().st_size + 0xFFF) & ~0xFFF
            bid = read_build_id(binary) if build_id is None else build_id
            self.mappings.append(Mapping(base, base + size, 0, str(binary), bid or ""))
            self.bases[binary] = base
        return self.bases[binary]

    def pc(self, binary: Path, vaddr: int) -> int:
        return self.map(binary) + vaddr_to_offset(binary, vaddr)

    def sample(self, binary: Path, vaddr: int, n: int = 1, *, kernel: bool = False, callers: tuple[int, ...] = (),
               split: bool = False) -> None:
        """`n` samples with their leaf at `vaddr` (one of weight n, or n of weight 1 when `split`)."""
        pc = self.pc(binary, vaddr)
        kern = (KERNEL_PC,) if kernel else ()
        for w in [1] * n if split else [n]:
            self.samples.append(RawSample(len(self.samples), 1, 1, 0, "prog", (pc, *callers), kern, weight=w))

    def capture(self) -> Capture:
        return Capture(CaptureHeader(1), samples=self.samples, processes=[ProcessSnapshot(1, 0, self.mappings)],
                       stalls=self.stalls, gpu_code=self.gpu_code, footer=CaptureFooter(samples=len(self.samples)))


def _hot_loop(binary: Path) -> tuple[int, int]:
    addr, size = readelf_functions(binary)["hot_loop"]
    return addr, addr + size


def test_leaf_samples_counted_per_instruction(hot: HotLoop) -> None:
    # Oracle: objdump (instructions), readelf (symbols), addr2line (lines); counts placed by construction
    start, end = _hot_loop(hot.prog)
    insns = objdump_instructions(hot.prog, start, end)
    main_addr = readelf_functions(hot.prog)["main"][0]
    c = Cap()
    want = {insns[3]: 5, insns[10]: 40, insns[11]: 12}
    for addr, n in want.items():
        c.sample(hot.prog, addr, n, split=n == 5, callers=(c.pc(hot.prog, main_addr + 8),))
    c.sample(hot.prog, main_addr, 30, callers=(c.pc(hot.prog, insns[5]),))  # hot_loop only as a caller
    c.sample(hot.prog, insns[10], 7, kernel=True)  # taken in the kernel: noted, not counted
    ann = annotate(c.capture(), "hot_loop")
    assert (ann.kind, ann.name, ann.display, ann.arch, ann.unit) == ("native", "hot_loop", "hot_loop", "x86-64",
                                                                    "samples")
    assert (ann.start, ann.size, ann.binary) == (start, end - start, str(hot.prog))
    assert ann.build_id == read_build_id(hot.prog)
    assert [i.address for i in ann.instructions] == insns  # capstone decodes what objdump decodes
    assert {i.address: i.samples for i in ann.instructions if i.samples} == want
    assert ann.samples == 57 and ann.total == 5 + 40 + 12 + 30 + 7
    assert sum(i.percent for i in ann.instructions) == pytest.approx(100.0)
    assert [i.address for i in ann.hottest()] == [insns[10], insns[11], insns[3]]
    assert [i.hot for i in ann.hottest()] == [1, 2, 3]
    assert any("7 more samples were taken in the kernel" in n for n in ann.notes)
    # Lines as addr2line has them; the loop's instructions in the loop's lines.
    assert [(Path(i.file).name, i.line) for i in ann.instructions] == [
        (Path(f).name, ln) for f, ln in addr2line(hot.prog, insns)]
    assert ann.lines()[0][1] in hot.loop_lines
    assert ann.source[(ann.instructions[10].file, ann.instructions[10].line)]


def test_sorting_ties_and_hot_marks(hot: HotLoop) -> None:
    # Oracle: by construction — counts placed by hand on objdump's instructions
    start, end = _hot_loop(hot.prog)
    insns = objdump_instructions(hot.prog, start, end)
    c = Cap()
    for k, addr in enumerate(insns[:6]):
        c.sample(hot.prog, addr, 10 if k in (1, 4) else k + 1)
    ann = annotate(c.capture(), "hot_loop", hot=2)
    assert [i.address for i in ann.hottest()] == [insns[1], insns[4], insns[5], insns[3], insns[2], insns[0]]
    assert [i.hot for i in ann.hottest()] == [1, 2, 0, 0, 0, 0] and ann.hot_count() == 2
    assert sum(i.percent for i in ann.instructions) == pytest.approx(100.0)
    none = annotate(c.capture(), "hot_loop", hot=0)
    assert none.hot_count() == 0


def test_function_without_samples_by_exact_name(hot: HotLoop) -> None:
    # Oracle: by construction — every sample placed outside main (readelf's address)
    start, _end = _hot_loop(hot.prog)
    c = Cap()
    c.sample(hot.prog, start, 3)
    ann = annotate(c.capture(), "main")
    assert ann.samples == 0 and ann.total == 3 and not ann.hottest()
    assert all(i.percent == 0 for i in ann.instructions)


def test_stripped_binary_names_from_dynsym(hot: HotLoop) -> None:
    # Oracle: readelf --dyn-syms (the name) and objdump (instructions) of the stripped file
    start, end = _hot_loop(hot.stripped)
    assert readelf_functions(hot.stripped, dynamic=True)["hot_loop"][0] == start
    insns = objdump_instructions(hot.stripped, start, end)
    c = Cap()
    c.sample(hot.stripped, insns[7], 9)
    ann = annotate(c.capture(), "hot_loop")
    assert ann.name == "hot_loop" and [i.address for i in ann.instructions] == insns
    assert all(not i.file and not i.line for i in ann.instructions) and not ann.source
    assert any(n.startswith("no source lines: prog.stripped") for n in ann.notes)
    # The same function by file offset: named from .dynsym all the same.
    off = vaddr_to_offset(hot.stripped, insns[7])
    by_addr = annotate(c.capture(), f"prog.stripped+{off:#x}")
    assert by_addr.name == "hot_loop" and by_addr.samples == 9
    assert f"prog.stripped+{off:#x} is hot_loop+{insns[7] - start:#x}" in by_addr.notes


def test_no_symbol_at_all_by_address_and_range(hot: HotLoop) -> None:
    # Oracle: objdump of the bare file and of its unstripped twin; counts placed by construction
    assert "hot_loop" not in readelf_functions(hot.bare, dynamic=True)
    start, end = _hot_loop(hot.nodyn)  # where the build it was stripped from has the function
    bare_insns = objdump_instructions(hot.bare, start, end)
    assert bare_insns == objdump_instructions(hot.nodyn, start, end)
    c = Cap()
    c.sample(hot.bare, bare_insns[9], 6)
    c.sample(hot.bare, bare_insns[2], 2)
    off = vaddr_to_offset(hot.bare, bare_insns[9])
    ann = annotate(c.capture(), f"prog.bare+{off:#x}")
    shown = [i.address for i in ann.instructions]
    assert set(bare_insns) <= set(shown)  # the window holds the whole loop, decoded in step with objdump
    assert {i.address: i.samples for i in ann.instructions if i.samples} == {bare_insns[9]: 6, bare_insns[2]: 2}
    assert any(n.startswith(f"no symbol covers prog.bare+{off:#x}") for n in ann.notes)
    lo, hi = vaddr_to_offset(hot.bare, start), vaddr_to_offset(hot.bare, end)
    rng = annotate(c.capture(), f"prog.bare+{lo:#x}-{hi:#x}")
    assert [i.address for i in rng.instructions] == bare_insns and rng.samples == 8
    assert rng.name == f"prog.bare+{lo:#x}-{hi:#x}"
    with pytest.raises(NothingToShow, match="outside the loaded segments"):
        annotate(c.capture(), "prog.bare+0x7fffffff")


def test_ambiguous_names_list_candidates_and_dso_chooses(hot: HotLoop) -> None:
    c = Cap()
    c.sample(hot.prog, _hot_loop(hot.prog)[0], 4)
    c.sample(hot.stripped, _hot_loop(hot.stripped)[0], 2)
    with pytest.raises(BadInput) as e:
        annotate(c.capture(), "hot_loop")
    msg = str(e.value)
    assert "'hot_loop' matches 2 functions" in msg and "\n" not in msg
    assert "hot_loop in prog (4 samples)" in msg and "hot_loop in prog.stripped (2 samples)" in msg
    assert annotate(c.capture(), "hot_loop", dso="prog").binary == str(hot.prog)
    assert annotate(c.capture(), "hot_loop", dso=str(hot.stripped)).binary == str(hot.stripped)
    with pytest.raises(NothingToShow, match="the capture has no binary 'libnope'"):
        annotate(c.capture(), "hot_loop", dso="libnope")


def test_cpp_names_mangled_demangled_short_and_part(cpp: Path) -> None:
    # Oracle: readelf (the mangled symbol's address), c++filt (its demangled name)
    mangled = "_ZNK4demo6Engine3runEi"
    addr, _size = readelf_functions(cpp)[mangled]
    c = Cap()
    c.sample(cpp, addr, 3)
    for query in (mangled, "demo::Engine::run(int) const", "demo::Engine::run", "Engine::ru"):
        ann = annotate(c.capture(), query)
        assert (ann.name, ann.display, ann.samples) == (mangled, cxxfilt([mangled])[mangled], 3), query


def test_not_found_and_missing_binaries(hot: HotLoop, tmp_path: Path) -> None:
    c = Cap()
    c.sample(hot.prog, _hot_loop(hot.prog)[0], 4)
    with pytest.raises(NothingToShow, match=r"no function matching 'nothing_here' .*sampled functions: hot_loop"):
        annotate(c.capture(), "nothing_here")
    gone = tmp_path / "gone"
    shutil.copy(hot.prog, gone)
    g = Cap()
    g.sample(gone, _hot_loop(gone)[0], 4)
    cap = g.capture()
    gone.unlink()
    with pytest.raises(BinaryNotFound, match="not readable here: gone"):
        annotate(cap, "hot_loop")
    with pytest.raises(BinaryNotFound, match=f"{gone}: not readable on this host"):
        annotate(cap, "hot_loop", dso="gone")
    other = Cap()
    other.map(hot.prog, build_id="00" * 20)
    other.sample(hot.prog, _hot_loop(hot.prog)[0], 1)
    with pytest.raises(BinaryNotFound, match="not the build that ran"):
        annotate(other.capture(), "prog+0x1000")


# --- GPU kernels ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def progs(tmp_path_factory: pytest.TempPathFactory) -> KernelPrograms:
    return kernel_programs(tmp_path_factory)


def _cubins(progs: KernelPrograms) -> list[GpuCode]:
    _kind, data = read_fatbin_file(progs.plain)
    return [GpuCode(e.digest, "cubin", e.arch, str(progs.plain), e.data) for e in iter_entries(data)
            if e.kind == "elf" and b".text._Z5scale" in e.data]


def _gpu_cap(progs: KernelPrograms) -> tuple[Cap, GpuCode]:
    """Stall samples of `scale`: 55 at two sm_90 offsets, 3 on sm_80, and 5 without a code digest (both cubins
    define the kernel, so those cannot be placed)."""
    c = Cap()
    c.gpu_code = _cubins(progs)
    sm90 = next(g for g in c.gpu_code if g.arch == 90)
    offsets = sorted({r.start for r in parse_cubin(sm90.data).lines().table(SCALE)})
    c.stalls = [Stall("cupti", 7, 0, sm90.digest, SCALE, offsets[2], LONG_SB, 30),
                Stall("cupti", 7, 0, sm90.digest, SCALE, offsets[2], WAIT, 10),
                Stall("cupti", 7, 0, sm90.digest, SCALE, offsets[4], WAIT, 15),
                Stall("cupti", 7, 0, "", SCALE, offsets[4], WAIT, 5)]
    sm80 = next(g for g in c.gpu_code if g.arch == 80)
    c.stalls.append(Stall("cupti", 8, 1, sm80.digest, SCALE, 0x10, WAIT, 3))  # another architecture
    return c, sm90


def test_gpu_kernel_sass_lines_and_stall_reasons(progs: KernelPrograms) -> None:
    # Oracle: nvdisasm -g (lines, instruction count), cuobjdump -sass (text); counts by construction
    c, sm90 = _gpu_cap(progs)
    cubin = parse_cubin(sm90.data)
    size = cubin.kernels[SCALE].size
    ann = annotate(c.capture(), "scale")
    assert (ann.kind, ann.name, ann.display, ann.arch) == ("gpu", SCALE, "scale(float*, float, int)", "sm_90")
    assert ann.unit == "stall samples" and ann.size == size and ann.samples == 55 and ann.total == 63
    lines, sass = nvdisasm_lines(sm90.data)[SCALE], nvdisasm_sass(sm90.data)
    assert [i.address for i in ann.instructions] == sorted(lines) == list(range(0, size, 16))
    assert all(i.text and squeeze(i.text) == sass[(SCALE, i.address)] for i in ann.instructions)
    top = ann.hottest()
    assert [(i.samples, i.reasons) for i in top] == [(40, (("long_scoreboard", 30), ("wait", 10))),
                                                     (15, (("wait", 15),))]
    assert [round(i.percent, 2) for i in top] == [72.73, 27.27] and [i.hot for i in top] == [1, 2]
    assert ann.reasons == (("long_scoreboard", 30), ("wait", 25))
    for i in ann.instructions:
        assert (i.file, i.line) == (lines[i.address] or ("", 0))
    assert any(n.startswith("8 more stall samples of this kernel are in other code objects") for n in ann.notes)


def test_gpu_without_nvdisasm_and_without_code(progs: KernelPrograms, monkeypatch: pytest.MonkeyPatch) -> None:
    # Oracle: by construction — the stall counts and offsets of _gpu_cap, placed by hand
    monkeypatch.setattr(stalls, "find_nvdisasm", lambda: None)
    monkeypatch.setattr(annotate_gpu, "find_nvdisasm", lambda: None)
    c, _sm90 = _gpu_cap(progs)
    ann = annotate(c.capture(), SCALE, kind="gpu")
    assert all(i.text is None for i in ann.instructions) and all(i.file for i in ann.instructions if i.samples)
    assert any(n.startswith("no SASS text: nvdisasm not found") for n in ann.notes)
    c.gpu_code = []  # no cubin: every sample, of either architecture, at its offset alone
    bare = annotate(c.capture(), "scale")
    want: dict[int, int] = {0x10: 3}
    for s in c.stalls[:-1]:
        want[s.offset] = want.get(s.offset, 0) + s.count
    assert {i.address: i.samples for i in bare.instructions} == want and bare.samples == 63
    assert all(i.text is None and not i.file for i in bare.instructions)
    assert any("no code object" in n for n in bare.notes)
    with pytest.raises(NothingToShow, match="no GPU kernel matching 'nope'"):
        annotate(c.capture(), "nope", kind="gpu")


def test_kernel_and_host_stub_need_a_kind(progs: KernelPrograms) -> None:
    c, _sm90 = _gpu_cap(progs)
    stub, _size = readelf_functions(progs.plain)[SCALE]  # nvcc's host-side launch stub has the kernel's name
    c.sample(progs.plain, stub, 2)
    with pytest.raises(BadInput, match="names a GPU kernel .* add --kind gpu or --kind native"):
        annotate(c.capture(), SCALE)
    assert annotate(c.capture(), SCALE, kind="native").kind == "native"
    assert annotate(c.capture(), SCALE, kind="gpu").kind == "gpu"


# --- the command --------------------------------------------------------------------------------------------------


def _write(c: Cap, path: Path) -> Path:
    write_capture(path, c.capture())
    return path


def test_cli_address_order_and_hottest_first(hot: HotLoop, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Oracle: by construction — 30 and 10 samples on objdump's instructions of hot_loop
    start, end = _hot_loop(hot.prog)
    insns = objdump_instructions(hot.prog, start, end)
    c = Cap()
    c.sample(hot.prog, insns[10], 30)
    c.sample(hot.prog, insns[4], 10)
    path = _write(c, tmp_path / "c.aiflame")
    assert main(["annotate", str(path), "hot_loop"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no colour codes when stdout is not a terminal
    assert out.startswith(f"hot_loop  {hot.prog}") and "40 samples in this code as the leaf frame" in out
    rows = [ln for ln in out.splitlines() if re.match(r"^(>\d)?\s+[\d.]+\s+\d+\s+0x", ln)]
    assert [ln.split()[0] for ln in rows] == [">2", ">1"]  # address order
    assert re.search(rf"^>1\s+75\.00\s+30\s+{insns[10]:#x}\s+\S", out, re.M)
    assert re.search(r"^\s{33}hot_loop\.c:\d+\s+\S", out, re.M)  # source interleaved
    assert "hottest source lines: hot_loop.c:" in out
    assert main(["annotate", str(path), "hot_loop", "-s", "samples", "--no-source"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith(">")]
    assert [int(r.split()[3], 16) for r in rows] == [insns[10], insns[4]] and "hot_loop.c:" in rows[0]


def test_cli_gpu_rows_show_reasons(progs: KernelPrograms, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Oracle: by construction — the stall counts and reasons of _gpu_cap
    c, _sm90 = _gpu_cap(progs)
    path = _write(c, tmp_path / "g.aiflame")
    assert main(["annotate", str(path), "scale", "-s", "samples"]) == 0
    out = capsys.readouterr().out
    assert "55 stall samples on this kernel (87.3% of the capture's 63)" in out
    assert "stall reasons: long_scoreboard 55%, wait 45%" in out
    assert re.search(r"^>1\s+72\.73\s+40\s+\+0x\w{4}\s+.*kernels\.cu:\d+\s+long_scoreboard 75%, wait 25%$", out,
                     re.M)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nothing_here"], "aiflame: error: no function matching 'nothing_here'"),
        (["hot_loop", "--dso", "libnope"], "aiflame: error: the capture has no binary 'libnope'"),
        (["libnope+0x10"], "aiflame: error: the capture has no binary 'libnope'"),
    ],
)
def test_cli_errors_are_one_line(argv: list[str], message: str, hot: HotLoop, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    c = Cap()
    c.sample(hot.prog, _hot_loop(hot.prog)[0], 1)
    path = _write(c, tmp_path / "e.aiflame")
    assert main(["annotate", str(path), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_annotation_is_a_value() -> None:
    ann = Annotation("native", "f", "f", "/bin/x", "", "x86-64", 0, 0, "samples", 0, 0, ())
    assert ann.hottest() == [] and ann.lines() == [] and ann.hot_count() == 0
