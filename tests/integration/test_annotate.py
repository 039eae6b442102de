"""`aiflame annotate` on a real capture: a gcc -O2 hot loop, its stripped copy and a copy with no symbol for it,
profiled at 999 Hz in one run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.symbolize.annotate import annotate
from tests.annotate_build import HotLoop, build_hot_loop
from tests.integration.conftest import aiflame
from tests.unit.elf_builders import readelf_functions, vaddr_to_offset


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[HotLoop, Path]:
    hot = build_hot_loop(tmp_path_factory.mktemp("annotate"))
    out = tmp_path_factory.mktemp("annotate-out")
    script = f"{hot.prog} 1.5 && {hot.stripped} 1.5 && {hot.bare} 1"
    aiflame("profile", "-q", "-F", "999", "-o", str(out), "--formats", "folded", "--", "sh", "-c", script)
    return hot, out / "profile.aiflame"


def test_hottest_instruction_is_in_the_loop(run: tuple[HotLoop, Path]) -> None:
    """Oracles: the compiler's line table (the MARK lines of tests/programs/hot_loop.c) and readelf's symbols."""
    hot, path = run
    cap = read_capture(path)
    ann = annotate(cap, "hot_loop", dso="prog")
    assert ann.samples > 200, ann.samples  # 1.5 s of CPU time at 999 Hz: ~1500
    assert sum(i.percent for i in ann.instructions) == pytest.approx(100.0)
    top = ann.hottest()[0]
    assert top.hot == 1 and top.file.endswith("hot_loop.c") and top.line in hot.loop_lines, top
    loop_share = sum(i.samples for i in ann.instructions if i.line in hot.loop_lines) / ann.samples
    assert loop_share > 0.9, loop_share


def test_stripped_copies(run: tuple[HotLoop, Path]) -> None:
    # Oracle: readelf -s of the unstripped build (hot_loop's range); the same instructions as the full copy
    hot, path = run
    cap = read_capture(path)
    full = annotate(cap, "hot_loop", dso="prog")
    stripped = annotate(cap, "hot_loop", dso="prog.stripped")  # from .dynsym
    assert stripped.samples > 200 and not any(i.file for i in stripped.instructions)
    assert sum(i.percent for i in stripped.instructions) == pytest.approx(100.0)
    assert [i.address for i in stripped.instructions] == [i.address for i in full.instructions]
    # The bare copy names nothing: by file offset, its hottest instruction is where its unstripped build has the loop.
    start, size = readelf_functions(hot.nodyn)["hot_loop"]
    off = vaddr_to_offset(hot.bare, start + size // 2)
    bare = annotate(cap, f"prog.bare+{off:#x}")
    assert bare.samples > 100 and start <= bare.hottest()[0].address < start + size
    assert any(n.startswith("no symbol covers") for n in bare.notes)


def test_command_output(run: tuple[HotLoop, Path]) -> None:
    _hot, path = run
    ambiguous = aiflame("annotate", str(path), "hot_loop", check=False)
    assert ambiguous.returncode == 1 and ambiguous.stderr.count("\n") == 1
    assert "hot_loop in prog (" in ambiguous.stderr and "hot_loop in prog.stripped (" in ambiguous.stderr
    out = aiflame("annotate", str(path), "hot_loop", "--dso", "prog", "-s", "samples").stdout
    rows = [ln.split() for ln in out.splitlines() if re.match(r"^(>\d+)?\s+\d+\.\d\d\s+\d+\s+0x", ln)]
    counts = [int(r[2] if r[0].startswith(">") else r[1]) for r in rows]
    assert rows[0][0] == ">1" and counts == sorted(counts, reverse=True)
    assert re.search(r"hot_loop\.c:\d+", out) and "hottest source lines: hot_loop.c:" in out
