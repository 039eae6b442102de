"""CFI unwind tables: rows against readelf's interpretation, the C engine against the Python reference,
hostile sections, and the on-disk cache.

The oracle is binutils (`readelf --debug-dump=frames-interp`, `--debug-dump=frames` for expressions,
`objdump` for trampoline code), never our own parser.
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.symbolize import cfi
from aiflame.symbolize.cfi import (
    CFA_DEREF_RBP,
    CFA_END,
    CFA_INVALID,
    CFA_PLT,
    CFA_PLT10,
    CFA_RBP,
    CFA_RSP,
    CFA_SIGNAL,
    NOT_COVERED,
    RBP_INVALID,
    RBP_OFFSET,
    RBP_UNCHANGED,
    CfiError,
    Rule,
    UnwindTable,
)
from aiflame.symbolize.elf import ElfFile

PROGRAMS = Path(__file__).resolve().parent.parent / "programs"
LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
PYTHON = os.path.realpath("/usr/bin/python3.11")
VARIANTS = {
    "O1": ["-O1", "-fomit-frame-pointer"],
    "O2": ["-O2", "-fomit-frame-pointer"],
    "O2fp": ["-O2", "-fno-omit-frame-pointer"],
    "debug_frame": ["-O2", "-g", "-fno-asynchronous-unwind-tables"],  # our code's CFI in .debug_frame
    "nopie": ["-O2", "-no-pie", "-fomit-frame-pointer"],
    "ibt": ["-O2", "-fcf-protection=full", "-Wl,-z,ibtplt"],  # .plt.sec and the lit9 lazy-PLT expression
}
INVALID = Rule(CFA_INVALID, RBP_UNCHANGED, 0, 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The fixture program in every variant, plus a copy of O2 without a build id."""
    out = tmp_path_factory.mktemp("cfi")
    paths = {}
    for name, flags in VARIANTS.items():
        path = out / f"cfi_frames_{name}"
        subprocess.run(["gcc", *flags, "-o", str(path), str(PROGRAMS / "cfi_frames.c")], check=True)
        paths[name] = str(path)
    nobid = out / "cfi_frames_nobid"
    subprocess.run(["objcopy", "--remove-section", ".note.gnu.build-id", paths["O2"], str(nobid)], check=True)
    paths["nobid"] = str(nobid)
    return paths


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own cache directory (the compiled C engine included, once per process)."""
    monkeypatch.setenv("AIFLAME_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", autouse=True)
def engine_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Compile the C engine into a temporary cache for this module, whatever AIFLAME_CACHE says later."""
    d = str(tmp_path_factory.mktemp("engine"))
    s = cfi._fast_state
    with s.lock:
        s.lib, s.tried, s.error = cfi._load_fast(d), True, ""


# --- readelf as the oracle --------------------------------------------------------------------------------


@dataclass
class ReFde:
    cie: int
    start: int
    end: int
    rows: list[tuple[int, str, str, str]] = field(default_factory=list)  # loc, CFA, rbp, ra columns


@dataclass
class ReCie:
    aug: str
    row: tuple[str, str, str] | None = None
    exprs: set[str] = field(default_factory=set)


_HEAD = re.compile(r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ (?:CIE \"([^\"]*)\"|CIE$|FDE cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+))")
_TOKEN = re.compile(r"r\d+ \([^)]*\)|\S+")  # "r1 (rdx)": a register rule names the register with a space


def readelf(option: str, path: str) -> str:
    """readelf's output. Its exit status is not used: it is 1 for libc.so.6, whose debuglink it cannot follow."""
    text = subprocess.run(["readelf", option, path], capture_output=True, text=True).stdout
    assert "Contents of the .eh_frame section" in text, f"readelf {option} {path} printed no frames"
    return text


def readelf_interp(path: str) -> tuple[dict[tuple[str, int], ReFde], dict[tuple[str, int], ReCie]]:
    """FDEs and CIEs of `readelf --debug-dump=frames-interp`, by (section, offset)."""
    text = readelf("--debug-dump=frames-interp", path)
    fdes: dict[tuple[str, int], ReFde] = {}
    cies: dict[tuple[str, int], ReCie] = {}
    sec = ""
    cur: ReFde | ReCie | None = None
    cols: list[str] = []
    for line in text.splitlines():
        if line.startswith("Contents of the "):
            sec = line.split()[3]
            cur = None
            continue
        m = _HEAD.match(line)
        if m:
            key = (sec, int(m.group(1), 16))
            if m.group(3) is None:
                cur = cies[key] = ReCie(m.group(2) or "")
            else:
                cur = fdes[key] = ReFde(int(m.group(3), 16), int(m.group(4), 16), int(m.group(5), 16))
            continue
        if line.startswith("   LOC"):
            cols = line.split()[2:]
            continue
        if cur is None or not re.match(r"^[0-9a-f]{16} ", line):
            continue
        toks = _TOKEN.findall(line[17:])
        regs = dict(zip(cols, toks[1:], strict=True))
        cfa, rbp, ra = toks[0], regs.get("rbp", "u"), regs.get("ra", "u")
        if isinstance(cur, ReCie):
            cur.row = (cfa, rbp, ra)
        else:
            cur.rows.append((int(line[:16], 16), cfa, rbp, ra))
    return fdes, cies


def readelf_exprs(path: str) -> dict[tuple[str, int], set[str]]:
    """The DW_CFA_def_cfa_expression operands of each CIE and FDE (`readelf --debug-dump=frames`)."""
    text = readelf("--debug-dump=frames", path)
    out: dict[tuple[str, int], set[str]] = {}
    sec, key = "", None
    for line in text.splitlines():
        if line.startswith("Contents of the "):
            sec = line.split()[3]
            continue
        m = re.match(r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ (CIE|FDE)", line)
        if m:
            key = (sec, int(m.group(1), 16))
            continue
        m = re.match(r"^\s+DW_CFA_def_cfa_expression \((.*)\)$", line)
        if m and key is not None:
            out.setdefault(key, set()).add(m.group(1))
    return out


_PLT_TEXT = "DW_OP_breg7 (rsp): 8; DW_OP_breg16 (rip): 0; DW_OP_lit15; DW_OP_and; DW_OP_lit{}; DW_OP_ge; " \
            "DW_OP_lit3; DW_OP_shl; DW_OP_plus"


def expr_kinds(exprs: set[str]) -> set[tuple[int, int]]:
    """(cfa_type, cfa_off) each readelf expression text should map to."""
    out = set()
    for e in exprs:
        m = re.fullmatch(r"DW_OP_breg6 \(rbp\): (-?\d+); DW_OP_deref", e)
        if e == _PLT_TEXT.format(11):
            out.add((CFA_PLT, 8))
        elif e == _PLT_TEXT.format(10):
            out.add((CFA_PLT10, 8))
        elif m:
            out.add((CFA_DEREF_RBP, int(m.group(1))))
        else:
            out.add((CFA_INVALID, 0))
    return out


def expected_rules(cfa: str, rbp: str, ra: str, signal: bool, exprs: set[tuple[int, int]]) -> set[Rule]:
    """The rules one readelf row allows, by the mapping documented in cfi.py."""
    if signal:
        return {Rule(CFA_SIGNAL, RBP_UNCHANGED, 0, 0)}
    if ra == "u":
        return {Rule(CFA_END, RBP_UNCHANGED, 0, 0)}
    if ra != "c-8":
        return {INVALID}
    m = re.fullmatch(r"(\w+)([+-]\d+)", cfa)
    if cfa == "exp":
        cands = exprs or {(CFA_INVALID, 0)}
    elif m and m.group(1) in ("rsp", "rbp"):
        cands = {(CFA_RSP if m.group(1) == "rsp" else CFA_RBP, int(m.group(2)))}
    else:
        cands = {(CFA_INVALID, 0)}
    m = re.fullmatch(r"c([+-]\d+)", rbp)
    if rbp in ("u", "s"):
        rb = (RBP_UNCHANGED, 0)
    elif m:
        rb = (RBP_OFFSET, int(m.group(1)))
    else:
        rb = (RBP_INVALID, 0)
    return {INVALID if t == CFA_INVALID else Rule(t, rb[0], off, rb[1]) for t, off in cands}


def is_trampoline_code(path: str, start: int, end: int) -> bool:
    """objdump's view: the FDE holds `mov $0xf,%rax; syscall` (rt_sigreturn)."""
    text = subprocess.run(["objdump", "-d", f"--start-address={start:#x}", f"--stop-address={end:#x}", path],
                          capture_output=True, text=True, check=True).stdout
    return bool(re.search(r"mov\s+\$0xf,%rax\s*\n.*syscall", text))


@dataclass
class Agreement:
    fdes: int = 0
    rows: int = 0
    mismatches: list[str] = field(default_factory=list)


def compare_with_readelf(path: str) -> Agreement:
    """Every FDE and every row location of readelf and of cfi.fde_rows, compared as step functions."""
    re_fdes, re_cies = readelf_interp(path)
    exprs = readelf_exprs(path)
    ours = {(f.section, f.offset): f for f in cfi.fde_rows(path)}
    assert set(ours) == set(re_fdes), "different FDE sets"
    agree = Agreement()
    for key, rf in re_fdes.items():
        o = ours[key]
        assert (o.start, o.end) == (rf.start, rf.end), key
        agree.fdes += 1
        if rf.start == rf.end:
            assert o.rows == []
            continue
        cie = re_cies[(key[0], rf.cie)]
        rows = [r for r in rf.rows if r[0] < rf.end]
        if not rows:  # only nops: the CIE's initial row holds over the whole FDE
            assert cie.row is not None, key
            rows = [(rf.start, *cie.row)]
        kinds = expr_kinds(exprs.get(key, set()) | exprs.get((key[0], rf.cie), set()))
        signal = "S" in cie.aug
        if not signal and o.rows and o.rows[0][1].cfa_type == CFA_SIGNAL:
            signal = is_trampoline_code(path, o.start, o.end)
        re_locs = [r[0] for r in rows]
        our_locs = [loc for loc, _ in o.rows]
        for loc in sorted(set(re_locs) | set(our_locs)):
            r = rows[bisect.bisect_right(re_locs, loc) - 1]
            mine = o.rows[bisect.bisect_right(our_locs, loc) - 1][1]
            agree.rows += 1
            allowed = expected_rules(r[1], r[2], r[3], signal, kinds)
            if mine not in allowed:
                agree.mismatches.append(f"{key} @0x{loc:x}: readelf {r[1:]} allows {allowed}, we have {mine}")
    return agree


def fixture_paths(built: dict[str, str]) -> list[str]:
    return [built[v] for v in VARIANTS] + [LIBC, PYTHON]


@pytest.mark.parametrize("target", [*VARIANTS, "libc", "python3.11"])
def test_rows_match_readelf(built: dict[str, str], target: str) -> None:
    path = {"libc": LIBC, "python3.11": PYTHON}.get(target) or built[target]
    agree = compare_with_readelf(path)
    assert agree.fdes > 10 and agree.rows > agree.fdes
    assert not agree.mismatches, f"{len(agree.mismatches)} of {agree.rows} rows differ: {agree.mismatches[:5]}"


def test_c_engine_matches_python_on_every_fixture(built: dict[str, str]) -> None:
    for path in [*fixture_paths(built), built["nobid"]]:
        c, py = cfi.build_table(path, "c"), cfi.build_table(path, "python")
        assert c.rows == py.rows and c.rules == py.rules and c.stats == py.stats, path


def test_table_lookup_agrees_with_fde_rows(built: dict[str, str]) -> None:
    """Packing, gap markers and dedupe keep every FDE row: lookup(pc) is the FDE's rule inside it and
    NOT_COVERED past its end unless another FDE starts there."""
    for path in fixture_paths(built):
        table = cfi.build_table(path)
        fdes = sorted((f for f in cfi.fde_rows(path) if f.end > f.start), key=lambda f: (f.start, f.offset))
        starts = {f.start for f in fdes}
        for f in fdes:
            for i, (loc, rule) in enumerate(f.rows):
                nxt = f.rows[i + 1][0] if i + 1 < len(f.rows) else f.end
                assert table.lookup(loc) == rule and table.lookup(nxt - 1) == rule, (path, hex(loc))
            if f.end not in starts:
                assert table.lookup(f.end) == NOT_COVERED, (path, hex(f.end))
        assert table.lookup(fdes[0].start - 1) == NOT_COVERED
        pcs = [pc for pc, _ in table.iter_rows()]
        assert pcs == sorted(set(pcs))
        kinds = [r.cfa_type for _, r in table.iter_rows()]
        assert all(a != b or a != 0 for a, b in zip(kinds, kinds[1:], strict=False))


def test_layout_is_eight_byte_rows_into_twelve_byte_rules(built: dict[str, str]) -> None:
    table = cfi.build_table(built["O2"])
    assert cfi.ROW.size == 8 and cfi.RULE.size == 12
    assert len(table.rows) == 8 * table.stats.rows and len(table.rules_bytes()) == 12 * len(table.rules)
    assert table.rules[0] == NOT_COVERED
    for pc, idx, spare in struct.iter_unpack("<IHH", table.rows):
        assert spare == 0 and idx < len(table.rules)
    for r, raw in zip(table.rules, struct.iter_unpack("<BBxxii", table.rules_bytes()), strict=True):
        assert tuple(r) == raw


def _symbol(path: str, name: str) -> int:
    with ElfFile.open(path) as elf:
        return elf.function_addresses({name})[name]


def test_kinds_of_the_fixture(built: dict[str, str]) -> None:
    """The constructs of cfi_frames.c land on the intended kinds."""
    path = built["O2"]
    table = cfi.build_table(path)
    rules = [r for _, r in table.iter_rows()]
    weird = _symbol(path, "weird_cfi")
    at = [table.lookup(weird + i) for i in range(0x20)]
    assert at[0] == Rule(CFA_RSP, RBP_UNCHANGED, 8, 0)
    assert at[1] == Rule(CFA_RSP, RBP_OFFSET, 16, -16)  # push %rbp
    assert at[4] == Rule(CFA_RBP, RBP_OFFSET, 16, -16)  # after mov %rsp,%rbp
    assert at[5] == Rule(CFA_RSP, RBP_UNCHANGED, 8, 0)  # remember; def_cfa rsp+8; same_value rbp
    assert at[6] == Rule(CFA_RBP, RBP_OFFSET, 16, -16)  # restore_state
    assert at[7] == INVALID  # RA in a register
    assert at[9] == INVALID  # CFA in r10
    assert at[10] == Rule(CFA_PLT10, RBP_OFFSET, 8, -16)
    assert at[11] == Rule(CFA_DEREF_RBP, RBP_OFFSET, -8, -16)
    assert at[12] == Rule(CFA_DEREF_RBP, RBP_INVALID, -8, 0)  # rbp by expression
    assert table.lookup(_symbol(path, "my_restore_rt")).cfa_type == CFA_SIGNAL  # trampoline, no 'S'
    assert table.lookup(_symbol(path, "sigframe_fn")).cfa_type == CFA_SIGNAL  # .cfi_signal_frame
    assert table.lookup(_symbol(path, "_start")).cfa_type == CFA_END  # RA undefined
    with ElfFile.open(path) as elf:
        plt = elf.section(".plt")
        assert plt is not None
        assert table.lookup(plt.addr + 16).cfa_type == CFA_PLT
    assert any(r.cfa_type == CFA_DEREF_RBP and r.cfa_off == -8 for r in rules)  # force_align_arg_pointer
    s = table.stats
    assert s.fdes_used == s.fdes and s.source == "eh_frame_hdr"
    assert s.rows == len(table) and s.rules == len(table.rules) and sum(s.cfa_kinds) == s.rows


def test_debug_frame_fills_in(built: dict[str, str]) -> None:
    t = cfi.build_table(built["debug_frame"])
    assert t.stats.source == "eh_frame_hdr+debug_frame"
    assert t.lookup(_symbol(built["debug_frame"], "weird_cfi") + 4).cfa_type == CFA_RBP
    assert t.lookup(_symbol(built["debug_frame"], "sigframe_fn")).cfa_type == CFA_SIGNAL  # "S" without "z"
