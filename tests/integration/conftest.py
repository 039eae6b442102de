"""Integration tests load real BPF programs. They need root and a prepared host (`make setup`); they are never
skipped: without root they fail and say why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("BPF integration tests need root (run `sudo make test`)")


def aiflame(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, in a child process."""
    proc = subprocess.run([sys.executable, "-m", "aiflame", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"aiflame {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_folded(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        out[stack] = out.get(stack, 0) + int(count)
    return out


def share(folded: dict[str, int], frame: str) -> int:
    """Samples whose stack holds `frame`."""
    return sum(c for st, c in folded.items() if frame in st.split(";"))
