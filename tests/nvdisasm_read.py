"""nvdisasm as the oracle of cubin lines and SASS text, read by parsers written for the tests (never aiflame's
`parse_nvdisasm` or its line-table reader): `nvdisasm -g` for the source line of every instruction, `nvdisasm -json`
for its text. nvdisasm ships in the accel-test extra (`make setup`): a missing one fails, it never skips."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.cuda_build import nvidia_bin

__all__ = ["nvdisasm_lines", "nvdisasm_sass", "squeeze"]


def _tool() -> Path:
    tool = nvidia_bin("nvdisasm")
    if tool is None:
        pytest.fail("nvdisasm not found: install the accel-test extra (`make setup`)")
    return tool


def _run(cubin: Path | bytes, *options: str) -> str:
    """nvdisasm's output for a cubin file, or for cubin bytes (written to a temporary file for it)."""
    if isinstance(cubin, Path):
        return subprocess.run([str(_tool()), *options, str(cubin)], check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_tool()), *options, f.name], check=True, capture_output=True, text=True).stdout


def nvdisasm_lines(cubin: Path | bytes) -> dict[str, dict[int, tuple[str, int] | None]]:
    """Per kernel and instruction offset, the source line `nvdisasm -g` shows.

    nvdisasm prints `//## File "...", line N` only when the line changes, and keeps that state from one
    function to the next: an instruction's line is the last annotation printed before it, anywhere above."""
    text = _run(cubin, "-c", "-g")
    out: dict[str, dict[int, tuple[str, int] | None]] = {}
    kernel: dict[int, tuple[str, int] | None] | None = None
    current: tuple[str, int] | None = None
    for line in text.splitlines():
        if m := re.match(r"\s*\.section\s+\.text\.([^,\s]+)", line):
            kernel = out.setdefault(m.group(1), {})
        elif m := re.match(r'\s*//## File "(.*)", line (\d+)', line):
            current = (m.group(1), int(m.group(2)))
        elif (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)) and kernel is not None:
            kernel[int(m.group(1), 16)] = current
    return out


def squeeze(text: str) -> str:
    """Instruction text without spaces or the closing `;`, the form the two readings are compared in."""
    return "".join(text.split()).rstrip(";")


def nvdisasm_sass(cubin: Path | bytes) -> dict[tuple[str, int], str]:
    """(function, offset) -> the instruction as `nvdisasm -json` gives it (predicate, opcode, operands), squeezed."""
    out = _run(cubin, "-json")
    lines: dict[tuple[str, int], str] = {}
    for fn in json.loads(out)[1]:
        for i, ins in enumerate(fn["sass-instructions"]):
            text = ins.get("predicate", "") + ins["opcode"] + ins.get("operands", "")
            lines[(fn["function-name"], i * 16)] = squeeze(text)
    return lines
