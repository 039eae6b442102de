"""tests/programs/hot_loop.c built the ways the annotate tests need, and binutils oracles for its code.

Oracles are objdump (instruction boundaries) and addr2line (lines), never our own disassembler or DWARF reader.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import PROGRAMS

__all__ = ["HOT_LOOP_C", "HotLoop", "addr2line", "build_hot_loop", "objdump_instructions"]

HOT_LOOP_C = PROGRAMS / "hot_loop.c"


@dataclass(frozen=True)
class HotLoop:
    """`prog`: -O2 -g -rdynamic; `stripped`: strip --strip-all of it (hot_loop and main still in .dynsym);
    `nodyn`: built without -rdynamic; `bare`: nodyn stripped (no name for hot_loop at all)."""

    dir: Path
    prog: Path
    stripped: Path
    nodyn: Path
    bare: Path
    loop_lines: range  # the source lines from MARK:loop_start to MARK:loop_end


def _run(*cmd: str | Path) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout


def build_hot_loop(d: Path) -> HotLoop:
    d.mkdir(parents=True, exist_ok=True)
    flags = ("-O2", "-g", "-fno-omit-frame-pointer")
    prog, stripped, nodyn, bare = d / "prog", d / "prog.stripped", d / "prog.nodyn", d / "prog.bare"
    _run("gcc", *flags, "-rdynamic", "-o", prog, HOT_LOOP_C)
    _run("strip", "--strip-all", "-o", stripped, prog)
    _run("gcc", *flags, "-o", nodyn, HOT_LOOP_C)
    _run("strip", "--strip-all", "-o", bare, nodyn)
    lines = HOT_LOOP_C.read_text().splitlines()
    start = next(n for n, text in enumerate(lines, 1) if "MARK:loop_start" in text)
    end = next(n for n, text in enumerate(lines, 1) if "MARK:loop_end" in text)
    return HotLoop(d, prog, stripped, nodyn, bare, range(start, end + 1))


def objdump_instructions(path: Path, start: int, end: int) -> list[int]:
    """Addresses of the instructions objdump decodes in [start, end)."""
    out = _run("objdump", "-dw", f"--start-address={start:#x}", f"--stop-address={end:#x}", path)
    return [int(m.group(1), 16) for m in re.finditer(r"^\s+([0-9a-f]+):\t", out, re.M)]


def addr2line(path: Path, vaddrs: list[int]) -> list[tuple[str, int]]:
    """(file, line) of each address, ("", 0) where addr2line knows none."""
    out = _run("addr2line", "-e", path, *[hex(a) for a in vaddrs]).splitlines()
    res = []
    for line in out:
        file, _, num = line.partition(":")
        num = num.split()[0] if num.split() else ""
        res.append((file, int(num)) if file != "??" and num.isdigit() and int(num) else ("", 0))
    return res
