"""Launches past the record budget (issue #25: a training loop's 10k+ launches a second lost most of their
records): every launch is counted, per kernel, exactly; the records kept carry the launches BPF counted without
one; nothing is lost; the launch view and summary weigh records by the launches they stand for."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.core.model import EventKind
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.cuda_build import CUDA_DIR, build_cuda
from tests.integration.conftest import aiflame, read_folded


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cuda(CUDA_DIR / "launch_loop.cu", tmp_path_factory.mktemp("launch_loop") / "launch_loop",
                      gencodes=(90,))


def _run(loop: Path, out: Path, *opts: str, seconds: float = 3, rate: int = 20000,
         cpu: int = -1) -> tuple[dict[str, int], Path]:
    """The launch loop under `profile`; with `cpu`, pinned to that CPU (the record budget is per CPU)."""
    pin = ["taskset", "-c", str(cpu)] if cpu >= 0 else []
    proc = aiflame("profile", "-o", str(out), "--formats", "folded", *opts, "--", *pin, str(loop), str(seconds),
                   str(rate))
    made = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    return made, out / "profile.aiflame"


def test_launches_past_the_budget_are_counted_exactly_per_kernel(loop: Path, tmp_path: Path) -> None:
    # Oracle: the program's own count of the launches it made, per kernel; its call depth by construction
    made, path = _run(loop, tmp_path, "--launch-stacks", "300")
    cap = read_capture(path)
    assert cap.footer is not None
    c = cap.footer.counters
    assert c["call_lost"] == 0 and c["call_skipped"] > 0
    prof = symbolize_capture(cap, options=StackOptions(group="none"))
    launches = [e for e in prof.events if e.kind == EventKind.COMPUTE]
    counted: Counter[str] = Counter()
    for e in launches:
        counted[e.name] += e.calls
    assert counted == Counter(made), (counted, made)  # every launch, per kernel, exactly
    # Far fewer records than launches (300 a second per CPU at most, plus a burst of 64), yet all counted.
    assert len(launches) < 0.2 * sum(made.values())
    # The records kept have their whole stack; launches left at the end without one are few and marked.
    with_stack = [e for e in launches if not e.args.get("stackless")]
    assert all(e.stack[0].name == "[launch stack not sampled]" for e in launches if e.args.get("stackless"))
    assert sum(e.calls for e in with_stack) >= 0.98 * sum(made.values())
    for e in with_stack:
        names = [f.name for f in e.stack]
        helper = "launch_hot" if e.name == "hot" else "launch_cold"
        assert "main" in names and names.count("deep") == 9 and helper in names, names
    # The launch view weighs each record by the launches it stands for.
    folded = read_folded(tmp_path / "launches.folded")
    by_kernel: Counter[str] = Counter()
    for stack, n in folded.items():
        by_kernel[stack.rsplit(";", 1)[1].removesuffix("_[G]")] += n
    assert by_kernel == Counter(made)


def test_without_a_budget_every_launch_has_its_record(loop: Path, tmp_path: Path) -> None:
    # Oracle: the program's own count of the launches it made
    made, path = _run(loop, tmp_path, "--launch-stacks", "0", seconds=2, rate=2000)
    cap = read_capture(path)
    assert cap.footer is not None and not cap.footer.counters.get("call_skipped")
    launches = [e for e in cap.events if e.kind == "compute"]
    assert len(launches) == sum(made.values()) and all("calls" not in e.args for e in launches)


def test_a_low_budget_holds(loop: Path, tmp_path: Path) -> None:
    # Oracle: the budget's own arithmetic (a burst of 64 records, then --launch-stacks a second per CPU) against
    # the program's count of the launches it made. At under 30 a second the burst once overflowed an int and every
    # launch was recorded, with its stack walk.
    made, path = _run(loop, tmp_path, "--launch-stacks", "5", seconds=3, rate=5000, cpu=0)
    cap = read_capture(path)
    assert cap.footer is not None and cap.footer.counters["call_lost"] == 0
    launches = [e for e in cap.events if e.kind == "compute"]
    assert len(launches) <= 64 + 5 * 5, len(launches)  # one CPU: 3 s of launches, plus start and end
    assert sum(int(e.args.get("calls", 1)) for e in launches) == sum(made.values())
