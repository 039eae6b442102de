"""Shared fixtures: paths to the repo and the example workloads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "bin"


@pytest.fixture(scope="session")
def examples() -> Path:
    """The example workloads, built with frame pointers (examples/Makefile)."""
    subprocess.run(["make", "-s", "-C", str(REPO / "examples")], check=True)
    return EXAMPLES
