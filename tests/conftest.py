"""Shared fixtures: paths to the repo and the example workloads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "bin"
# The profiling targets of this machine kind: pyenv's (shared libpython, no frame pointers) and Debian's static 3.11.
INTERPRETERS = [
    "/root/.pyenv/versions/3.10.13/bin/python",
    "/root/.pyenv/versions/3.11.7/bin/python",
    "/root/.pyenv/versions/3.12.1/bin/python",
    "/root/.pyenv/versions/3.13.0/bin/python",
    "/usr/bin/python3",
]


@pytest.fixture(scope="session")
def examples() -> Path:
    """The example workloads, built with frame pointers (examples/Makefile)."""
    subprocess.run(["make", "-s", "-C", str(REPO / "examples")], check=True)
    return EXAMPLES
