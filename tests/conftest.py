"""Shared fixtures: paths to the repo, the example workloads and the test programs, the CUPTI wheel."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

from aiflame.agent.accel.cupti_build import CuptiInstall, find_cupti

# Property tests draw the same examples on every run (`make test`, CI): a run that fails fails again, and a pass
# does not hang on the luck of the draw. `HYPOTHESIS_PROFILE=explore make test` (or `make fuzz`) draws new ones
# and more of them, to look for bugs; what it finds becomes a fixed example or a fix.
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "bin"
PROGRAMS = REPO / "tests" / "programs"  # small C programs the tests build against real libraries
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


@pytest.fixture(scope="session")
def cupti() -> CuptiInstall:
    """NVIDIA's CUPTI from its wheel (the accel-test extra); its absence fails the test, it never skips."""
    found = find_cupti()
    if found is None:
        pytest.fail("nvidia-cuda-cupti is not installed: install the accel-test extra (`make setup`)")
    return found
