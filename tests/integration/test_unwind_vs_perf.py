"""The CFI unwinder against perf's DWARF unwinding of the same processes (tests/unwind_oracle.py): C programs
without frame pointers at -O1 and -O2, a pure-Python workload on every interpreter here, and the PyTorch
dispatcher loop. One aiflame capture runs every workload in turn under `perf record -p`, so both profilers
sample the same processes over the same time (the whole file takes 1-1.5 min on the 2-vCPU VM)."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from aiflame.core.errors import AiflameError
from aiflame.core.model import Frame, FrameKind
from aiflame.symbolize.objfmt.cfi import load_or_build
from tests.conftest import INTERPRETERS
from tests.integration.conftest import aiflame
from tests.unwind_oracle import (
    PY_WORK,
    TORCH_WORK,
    Workload,
    build_c_workload,
    cpp_under_python,
    reaches,
    run_oracle,
    share,
)

C_LEVELS = ("-O1", "-O2")
C_CPU_S = "2.5"  # ~1,250 samples each: the 70/30 split's binomial spread is ~1.5 points per profiler
PY_CPU_S = "1.6"  # per thread
# Start-up left out of the Python reach and in-place checks: a library mapped without a stop at its open (every
# process after the first that opens it in the session) is described to the unwinder only when the agent next
# re-reads the maps, up to agent.session.REMAP_MIN_S (0.5 s) plus a poll later; until then walks stop at it.
PY_SETTLE_S = 1.0
TORCH_CPU_S = "2"  # after `import torch` (~1.5 s of CPU itself)
# C functions whose inclusive share perf and aiflame must agree on: each construct of unwind_work.c
C_FUNCS = ("caller_a", "caller_b", "tail_entry", "tail_target", "with_alloca", "realigned_outer", "realigned_inner",
           "via_plt", "lib_spin", "lib_inner", "in_vdso", "on_prof", "in_handler")


def _py_id(python: str) -> str:
    return python.split("/")[-3] if "pyenv" in python else "debian"


def _cache_torch_tables() -> None:
    """libtorch's CFI tables into aiflame's cache before the capture. This file compares walks through libtorch
    with perf's; a host's first capture builds the large tables in the background, scanning past their code for
    the first half second (test_unwind_background.py), and on a fresh machine that would be this capture."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations, "torch is a test dependency"
    for lib in sorted(Path(next(iter(spec.submodule_search_locations)), "lib").glob("lib*.so*")):
        if lib.is_file():
            try:
                load_or_build(lib)
            except (AiflameError, OSError):
                pass  # no table: the capture says so, as it would have


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    _cache_torch_tables()
    tmp = tmp_path_factory.mktemp("unwind")
    work: list[tuple[str, Sequence[str | Path]]] = [
        (f"c{opt}", [build_c_workload(tmp / f"c{opt}", opt), C_CPU_S]) for opt in C_LEVELS
    ]
    work += [(f"py-{_py_id(p)}", [p, PY_WORK, PY_CPU_S]) for p in INTERPRETERS]
    work.append(("torch", [sys.executable, TORCH_WORK, TORCH_CPU_S]))
    return run_oracle(work, tmp / "out", aiflame)


def _reached_main(frames: Sequence[str]) -> bool:
    # a sample in the exit path (main has returned) still starts at _start
    return "main" in frames or reaches(frames, {"_start"})


def _split(stacks: list[list[str]]) -> float:
    """caller_a's share (%) of the samples in caller_a or caller_b: 70 by the program's construction."""
    a, b = share(stacks, lambda s: "caller_a" in s), share(stacks, lambda s: "caller_b" in s)
    return 100 * a / (a + b)


def _c_disagreement(w: Workload, opt: str) -> str | None:
    """Where aiflame's C stacks disagree with perf's of the same run (the 70/30 split, each construct's share)."""
    ours, theirs = w.ours.names(), [list(p.frames) for p in w.perf]
    print(f"{opt}: reach main aiflame {share(ours, _reached_main):.4f} perf {share(theirs, _reached_main):.4f}; "
          f"caller_a share aiflame {_split(ours):.1f}% perf {_split(theirs):.1f}%; samples {len(ours)} / {len(theirs)}")
    # Both measure the same 70/30 run: their difference spreads ~2 points (1 sigma) by sampling alone.
    if abs(_split(ours) - _split(theirs)) > 6:
        return f"caller_a share {_split(ours):.1f}% against perf's {_split(theirs):.1f}%"
    n1, n2 = len(ours), len(theirs)
    for fn in C_FUNCS:
        p1, p2 = (sum(1 for s in stacks if fn in s) / len(stacks) for stacks in (ours, theirs))
        # The two-proportion test's sigma, from the pooled share: perf's own share alone understated it whenever
        # perf's sample happened to run low (via_plt at 6.6 % against 3.6 %, 4 sigma taken as 3.0 points).
        pooled = (p1 * n1 + p2 * n2) / (n1 + n2)
        sigma = math.sqrt(max(pooled * (1 - pooled), 0.01) * (1 / n1 + 1 / n2))
        if abs(p1 - p2) > max(0.03, 4 * sigma):
            return f"{fn} in {p1:.3f} of samples against perf's {p2:.3f}"
    return None


@pytest.mark.parametrize("opt", C_LEVELS)
def test_c_without_frame_pointers_matches_perf(runs: dict[str, Workload], opt: str, tmp_path: Path) -> None:
    w = runs[f"c{opt}"]
    ours, theirs = w.ours.names(), [list(p.frames) for p in w.perf]
    assert len(ours) > 800 and len(theirs) > 800, (len(ours), len(theirs))
    reach = share(ours, _reached_main)
    assert reach >= 0.99, (reach, share(theirs, _reached_main), w.ours.counters)
    # Oracle: perf --call-graph dwarf on the same processes, and its verdict stands: no second run for aiflame.
    # The one exception is a perf run the program's own construction shows wrong (on a loaded host perf alone has
    # been seen at 74/26 of the 70/30 split while aiflame was on it): that run is no verdict, and both profilers
    # run again, for the verdict of the second perf run. aiflame off the 70/30 mix fails whatever perf says.
    assert abs(_split(ours) - 70) <= 5, f"aiflame's caller_a share {_split(ours):.1f}% against the program's 70%"
    why = _c_disagreement(w, opt)
    if why is not None and abs(_split(theirs) - 70) > 5:  # perf's run is off the program's mix: no verdict
        w = run_oracle([(f"c{opt}", [build_c_workload(tmp_path / "c", opt), C_CPU_S])], tmp_path / "out",
                       aiflame)[f"c{opt}"]
        ours, theirs = w.ours.names(), [list(p.frames) for p in w.perf]
        assert abs(_split(ours) - 70) <= 5, f"aiflame's caller_a share {_split(ours):.1f}% against 70%"
        assert abs(_split(theirs) - 70) <= 5, f"perf off the program's 70% twice: {_split(theirs):.1f}%"
        why = _c_disagreement(w, opt)
    assert why is None, why
    # The signal handler's samples go through __restore_rt back to the interrupted code and on to main
    # (at -O2 on_prof tail-calls in_handler and is in no stack).
    handler = [s for s in ours if "in_handler" in s]
    assert len(handler) >= 30, len(handler)
    through = [s for s in handler if "main" in s[:s.index("in_handler")]]
    assert len(through) >= 0.97 * len(handler), [s for s in handler if s not in through][:5]
    # The library called through the PLT (no frame pointers there either) unwinds back into the program, from the
    # start: the loader's stop (agent/runtimes/manager.py Loader) describes it before its first instruction runs.
    lib = [s for s in ours if "lib_inner" in s]
    assert len(lib) >= 20 and share(lib, lambda s: "via_plt" in s and "main" in s) >= 0.99


@pytest.mark.parametrize("python", INTERPRETERS, ids=_py_id)
def test_python_stacks_match_perf_with_frames_in_place(runs: dict[str, Workload], python: str) -> None:
    # Oracle: perf --call-graph dwarf on the same processes (outermost frames reached)
    w = runs[f"py-{_py_id(python)}"]
    assert len(w.ours.stacks) > 800 and len(w.perf) > 800, (len(w.ours.stacks), len(w.perf))
    settled = min(s.time_ns for s in w.ours.raw) + int(PY_SETTLE_S * 1e9)
    ours = [st for st, raw in zip(w.ours.stacks, w.ours.raw, strict=True) if raw.time_ns >= settled]
    tids = [raw.tid for raw in w.ours.raw if raw.time_ns >= settled]
    names = [[f.name for f in st] for st in ours]
    theirs = [list(p.frames) for p in w.perf if p.time_ns >= settled]
    # As many stacks reach the outermost frame (_start, or clone3 for the thread) as perf's: over the whole
    # run, and closely once the agent has described every library.
    whole, whole_perf = share(w.ours.names(), reaches), share([list(p.frames) for p in w.perf], reaches)
    ours_reach, perf_reach = share(names, reaches), share(theirs, reaches)
    with_py = [st for st in w.ours.stacks if any(f.kind == FrameKind.PYTHON for f in st)]
    print(f"{_py_id(python)}: reach outermost aiflame {whole:.4f} perf {whole_perf:.4f}, after "
          f"{PY_SETTLE_S} s {ours_reach:.4f} / {perf_reach:.4f}; {len(with_py)} with Python frames, "
          f"{w.ours.counters.get('python_spliced', 0)} spliced; samples {len(w.ours.stacks)} / {len(w.perf)}")
    assert whole >= whole_perf - 0.1, (whole, whole_perf, w.ours.counters)
    assert ours_reach >= perf_reach - 0.02, (ours_reach, perf_reach, w.ours.counters)
    # Python frames replace their evaluator frames in place: none glued at the root. (Samples before the agent
    # attached to the starting interpreter, up to ~0.3 s, have none.)
    assert len(with_py) >= 0.6 * len(w.ours.stacks), (len(with_py), len(w.ours.stacks))
    spliced = w.ours.counters.get("python_spliced", 0)
    assert spliced <= 0.01 * len(with_py), w.ours.counters
    main_tid = w.ours.raw[0].pid

    def in_place(i: int) -> bool:
        st = ours[i]
        first_py = next(j for j, f in enumerate(st) if f.kind == FrameKind.PYTHON)
        below = [f.name for f in st[:first_py]]
        if not reaches(below):
            return False
        # the main thread runs its script from PyEval_EvalCode; a thread from its C entry point
        return "PyEval_EvalCode" in below if tids[i] == main_tid else len(below) >= 2

    py_idx = [i for i, st in enumerate(ours) if any(f.kind == FrameKind.PYTHON for f in st)]
    placed = sum(1 for i in py_idx if in_place(i))
    assert placed >= 0.98 * len(py_idx), (placed, len(py_idx), [names[i] for i in py_idx if not in_place(i)][:3])
    # Python called back from C (map calling leaf) sits between the C frames that called it.
    both = [st for st in ours if {"through_map", "leaf"} <= {f.name for f in st if f.kind == FrameKind.PYTHON}]

    def native_between(st: tuple[Frame, ...]) -> bool:
        py = [f.name if f.kind == FrameKind.PYTHON else "" for f in st]
        lo, hi = py.index("through_map"), len(py) - 1 - py[::-1].index("leaf")
        return any(f.kind != FrameKind.PYTHON for f in st[lo + 1:hi])

    assert len(both) >= 20, len(both)
    assert share(both, native_between) >= 0.9, share(both, native_between)


def test_torch_dispatcher_cpp_frames_under_python(runs: dict[str, Workload]) -> None:
    # Oracle: perf --call-graph dwarf on the same process (share of at::/c10:: frames)
    w = runs["torch"]
    theirs = [list(p.frames) for p in w.perf]
    assert len(w.ours.stacks) > 800 and len(theirs) > 800, (len(w.ours.stacks), len(theirs))
    perf_cpp = share(theirs, lambda s: any(f.startswith(("at::", "c10::")) for f in s))
    ours_cpp = share(w.ours.stacks, cpp_under_python)
    print(f"libtorch C++ frames: perf {perf_cpp:.3f} of samples, aiflame under their Python caller {ours_cpp:.3f} "
          f"(ratio {ours_cpp / perf_cpp:.2f}; target 0.95)")
    assert perf_cpp > 0.3, perf_cpp
    assert ours_cpp >= 0.9 * perf_cpp, (ours_cpp, perf_cpp, w.ours.counters)
