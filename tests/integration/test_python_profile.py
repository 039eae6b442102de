"""Python frames on every interpreter on this machine: proportions, complete stacks, hot lines, truncation."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from aiflame.core.capture import read_capture
from aiflame.core.model import FrameKind
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.conftest import INTERPRETERS, REPO
from tests.integration.conftest import HANG_S, aiflame, process_cpu_s

SCRIPT = REPO / "examples" / "py_split.py"
HOT_LINE = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "HOT LINE" in line)
THREAD_ROOTS = {"<module>", "Thread._bootstrap", "_bootstrap"}


def _attach_capture(python: str, out: Path, seconds: float = 6.0, hz: int = 999) -> Path:
    target = subprocess.Popen([python, str(SCRIPT), str(seconds + 30)], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        aiflame("profile", "-q", "-p", str(target.pid), "-d", str(seconds), "-F", str(hz), "-o", str(out))
    finally:
        target.kill()
        target.wait()
    return out / "profile.aiflame"


def _share_tolerance(share: float, n: int) -> float:
    """Points a measured share may stray from `share` over `n` samples: 4, or 5 standard errors where the samples
    are few. ~3,000 samples per thread on an idle host (0.9 points of spread, so 4 points is ~4.5 sigma); on a
    loaded one the threads get less CPU time and fewer samples (1,333: 1.2 points), and the random order of the
    calls adds its own spread, so the bound follows the count measured."""
    return max(4.0, 5 * 100 * math.sqrt(share / 100 * (1 - share / 100) / n))


@pytest.mark.parametrize("python", INTERPRETERS, ids=lambda p: p.split("/")[-3] if "pyenv" in p else "debian")
def test_python_split_stacks_and_lines(python: str, tmp_path: Path) -> None:
    # Oracle: the workload's construction (60:40 and 75:25 splits, the HOT LINE marker)
    cap = read_capture(_attach_capture(python, tmp_path))
    assert cap.py_runtimes, "CPython was not detected"
    prof = symbolize_capture(cap, options=StackOptions(group="none", python="python"))
    assert prof.samples
    complete = 0
    split: dict[str, Counter[str]] = {"main": Counter(), "worker": Counter()}
    lines: Counter[int] = Counter()
    for s in prof.samples:
        names = [f.name for f in s.stack if f.kind == FrameKind.PYTHON]
        if names and names[0] in THREAD_ROOTS:
            complete += 1
        for thread, pair in (("main", ("work_60", "work_40")), ("worker", ("task_75", "task_25"))):
            for fn in pair:
                if fn in names:
                    split[thread][fn] += 1
                    # Known depth: the split function sits right above spin, 3 below main's root.
                    if thread == "main":
                        assert names[:4] == ["<module>", "main", "level", fn], names
        leaf = s.stack[-1] if s.stack else None
        if leaf is not None and leaf.name == "spin":
            lines[leaf.line] += 1
    assert complete >= 0.99 * len(prof.samples), (complete, len(prof.samples))
    for (a, b), share in (((split["main"]["work_60"], split["main"]["work_40"]), 60),
                          ((split["worker"]["task_75"], split["worker"]["task_25"]), 75)):
        assert a + b > 300 and abs(100 * a / (a + b) - share) <= _share_tolerance(share, a + b), (a, b)
    # The line of the current instruction, not the function's first line: the loop body dominates.
    assert lines.most_common(1)[0][0] in (HOT_LINE, HOT_LINE - 1), lines


def test_merged_view_keeps_native_leaf_and_marks_kinds(tmp_path: Path) -> None:
    # Oracle: the workload's HOT LINE marker; the test's clock (the agent's attach time)
    cap = read_capture(_attach_capture(INTERPRETERS[2], tmp_path, seconds=2, hz=499))
    prof = symbolize_capture(cap, options=StackOptions(group="none", python="merged"))
    kinds = Counter(f.kind for s in prof.samples for f in s.stack)
    assert kinds[FrameKind.PYTHON] > 0 and kinds[FrameKind.NATIVE] > 0
    assert prof.counters.get("python_samples", 0) >= 0.95 * len(prof.samples)
    # Samples without Python frames are only those taken before the agent attached to the interpreter.
    t0 = min(s.time_ns for s in cap.samples)
    late = [s for s in cap.samples if not s.py_flags and s.time_ns - t0 > 150_000_000]
    assert not late, [(s.tid, (s.time_ns - t0) / 1e6) for s in late[:5]]
    folded = (tmp_path / "profile.folded").read_text()
    assert "py::spin (" in folded and f"py_split.py:{HOT_LINE})" in folded


def test_deep_recursion_is_truncated_visibly(tmp_path: Path) -> None:
    # Oracle: by construction — 300 nested calls, deeper than the walker's frame limit
    script = tmp_path / "deep.py"
    script.write_text(
        "import sys\nsys.setrecursionlimit(5000)\n"
        "def down(n):\n    if n == 0:\n        print('ready', flush=True)\n        while True:\n            pass\n"
        "    return down(n - 1)\n"
        "down(300)\n"
    )
    target = subprocess.Popen([INTERPRETERS[2], str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        aiflame("profile", "-q", "-p", str(target.pid), "-d", "1.5", "-F", "199", "-o", str(tmp_path / "o"))
    finally:
        target.kill()
        target.wait()
    cap = read_capture(tmp_path / "o" / "profile.aiflame")
    assert cap.footer is not None and cap.footer.counters["py_truncated"] > 0
    folded = (tmp_path / "o" / "profile.folded").read_text()
    assert "[truncated python stack]" in folded


def test_command_mode_follows_python_children(tmp_path: Path) -> None:
    # Oracle: by construction — the parent and one spawned child both run child_spin
    script = tmp_path / "mp.py"
    script.write_text(
        "import multiprocessing as mp, time\n"
        "def child_spin():\n    end = time.thread_time() + 1.5\n    while time.thread_time() < end:\n        pass\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('spawn').Process(target=child_spin)\n    p.start()\n    child_spin()\n    p.join()\n"
    )
    aiflame("profile", "-q", "-F", "199", "-o", str(tmp_path / "o"), "--", INTERPRETERS[2], str(script))
    cap = read_capture(tmp_path / "o" / "profile.aiflame")
    prof = symbolize_capture(cap, options=StackOptions(group="none", python="python"))
    pids = {s.pid for s in prof.samples if any(f.name == "child_spin" for f in s.stack)}
    assert len(pids) == 2, pids


def test_thread_churn_and_exit_mid_capture(tmp_path: Path) -> None:
    # Oracle: by construction — the target starts threads running short() until it exits
    script = tmp_path / "churn.py"
    stop = tmp_path / "stop"
    # The target churns threads until told to stop, once it has run 2 s on a CPU after the capture file appeared:
    # its exit falls in the capture however long the agent takes to attach, and however little CPU the host
    # leaves it (a fixed 10 s life did not, at load 12; nor would a fixed 4 s of churn).
    script.write_text(
        "import os, sys, threading\n"
        "def short():\n    s = 0\n    for i in range(20000):\n        s += i\n"
        "print('ready', flush=True)\n"
        "while not os.path.exists(sys.argv[1]):\n"
        "    ts = [threading.Thread(target=short) for _ in range(4)]\n"
        "    [t.start() for t in ts]\n    [t.join() for t in ts]\n"
    )
    out = tmp_path / "o"

    def stop_when_capturing() -> None:
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and not any(out.glob("profile.aiflame*")):
            time.sleep(0.05)
        ran = process_cpu_s(target.pid)
        while time.monotonic() < deadline and process_cpu_s(target.pid) - ran < 2.0:
            time.sleep(0.05)
        stop.touch()

    target = subprocess.Popen([INTERPRETERS[3], str(script), str(stop)], stdout=subprocess.PIPE, text=True)
    stopper = threading.Thread(target=stop_when_capturing, daemon=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        stopper.start()
        # -d is longer than the target lives: the capture must end at its exit with everything kept.
        aiflame("profile", "-q", "-p", str(target.pid), "-d", "60", "-F", "499", "-o", str(out))
    finally:
        stop.touch()
        target.kill()
        target.wait()
    cap = read_capture(tmp_path / "o" / "profile.aiflame")
    assert cap.footer is not None and cap.footer.stop_reason == "target exited"
    prof = symbolize_capture(cap, options=StackOptions(group="none", python="python"))
    tids = {s.tid for s in prof.samples if any(f.name == "short" for f in s.stack)}
    assert len(tids) > 20, len(tids)  # many short-lived threads, each found by the walker
    assert sum(1 for s in prof.samples if s.stack) >= 0.95 * len(prof.samples)


def test_unverified_version_warns_once_and_stays_native(tmp_path: Path) -> None:
    old = "/root/.pyenv/versions/3.9.18/bin/python"  # no verified layout: stands in for 3.14 / free-threaded
    if not Path(old).exists():
        pytest.fail(f"{old} is part of this machine kind's image")
    script = tmp_path / "busy.py"
    script.write_text("import time\nend = time.process_time() + 5\nwhile time.process_time() < end:\n"
                      "    sum(range(10000))\n")
    proc = aiflame("profile", "-F", "99", "-o", str(tmp_path / "o"), "--", old, str(script))
    warnings = [ln for ln in proc.stderr.splitlines() if "no verified struct layout" in ln]
    assert len(warnings) == 1, proc.stderr
    cap = read_capture(tmp_path / "o" / "profile.aiflame")
    assert not cap.py_runtimes and not any(s.py for s in cap.samples)
    assert "py::" not in (tmp_path / "o" / "profile.folded").read_text()
    prof = symbolize_capture(cap, options=StackOptions(group="none"))
    modules = {f.module for s in prof.samples for f in s.stack}
    assert "libpython3.9.so.1.0" in modules, modules  # its native frames still flow


def test_interpreter_embedded_in_a_c_program(tmp_path: Path) -> None:
    # Oracle: by construction — the C program's main calls PyRun_SimpleString, which runs hot()
    prefix = "/root/.pyenv/versions/3.12.1"
    src = tmp_path / "embed.c"
    src.write_text(
        "#include <Python.h>\nint main(void) {\n    Py_Initialize();\n"
        '    PyRun_SimpleString("import time\\ndef hot():\\n    s = 0\\n"\n'
        '                       "    for i in range(100000):\\n        s += i\\n"\n'
        '                       "end = time.process_time() + 3\\nwhile time.process_time() < end:\\n"\n'
        '                       "    hot()\\n");\n'
        "    Py_Finalize();\n    return 0;\n}\n"
    )
    cfg = f"{prefix}/bin/python3.12-config"
    flags = subprocess.run([cfg, "--cflags", "--embed"], capture_output=True, text=True, check=True).stdout.split()
    libs = subprocess.run([cfg, "--ldflags", "--embed"], capture_output=True, text=True, check=True).stdout.split()
    exe = tmp_path / "embed"
    subprocess.run(["gcc", "-o", str(exe), str(src), *flags, *libs, f"-Wl,-rpath,{prefix}/lib"], check=True)
    aiflame("profile", "-q", "-F", "199", "-o", str(tmp_path / "o"), "--", str(exe))
    folded = (tmp_path / "o" / "profile.folded").read_text()
    # The C program's own main stays above the Python frames, with the native path it took into Python.
    assert ";main;PyRun_SimpleStringFlags;" in folded and ";PyEval_EvalCode;py::<module> (<string>:" in folded, \
        folded[:2000]
    assert ";py::hot (<string>:" in folded, folded[:2000]


WORKERS = """\
import multiprocessing as mp, sys, time

def spin(seconds):  # seconds of CPU time: a fixed amount of work, however busy the host
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass

def spin_fork(seconds):
    spin(seconds)

def spin_spawn(seconds):
    spin(seconds)

def spin_forkserver(seconds):
    spin(seconds)

if __name__ == "__main__":
    workers = [mp.get_context(m).Process(target=f, args=(2.0,))
               for m, f in (("fork", spin_fork), ("spawn", spin_spawn), ("forkserver", spin_forkserver))]
    for w in workers:
        w.start()
    spin(2.0)
    for w in workers:
        w.join()
    sys.exit(max(abs(w.exitcode or 0) for w in workers))
"""


@pytest.mark.parametrize("python", INTERPRETERS, ids=lambda p: p.split("/")[-3] if "pyenv" in p else "debian")
def test_forked_and_spawned_workers_have_python_frames(python: str, tmp_path: Path) -> None:
    """multiprocessing workers (fork: no exec, the parent's interpreter image; spawn and forkserver: a new
    interpreter) are walked like the parent: while a worker runs its target, every sample shows it."""
    # Oracle: by construction — each worker runs its own spin_<method> target
    script = tmp_path / "workers.py"
    script.write_text(WORKERS)
    aiflame("profile", "-q", "-F", "199", "-o", str(tmp_path / "o"), "--", python, str(script))
    cap = read_capture(tmp_path / "o" / "profile.aiflame")
    prof = symbolize_capture(cap, options=StackOptions(group="none", python="python"))
    parent = cap.samples[0].pid
    for method in ("fork", "spawn", "forkserver"):
        fn = f"spin_{method}"
        counts = Counter(s.pid for s in prof.samples if any(f.name == fn for f in s.stack))
        # The worker is the process that ran it. (A sample of the parent's start-up can carry the name: code
        # objects are read at the next drain, ~0.1 s on, and a start-up code object freed by then may have given
        # its address to this one. One sample, never a run of them.)
        pid, _n = counts.most_common(1)[0]
        assert pid != parent, (method, counts)
        mine = sorted((s for s in prof.samples if s.pid == pid and s.tid == pid), key=lambda s: s.time_ns)
        hits = [i for i, s in enumerate(mine) if any(f.name == fn for f in s.stack)]
        # Between the first and the last sample in its target the worker does nothing else.
        window = mine[hits[0] : hits[-1] + 1]
        raw = {(r.pid, r.tid, r.time_ns): r for r in cap.samples}
        misses = [(raw[(s.pid, s.tid, s.time_ns)].py_flags, len(raw[(s.pid, s.tid, s.time_ns)].py),
                   [f.name for f in s.stack]) for s in window if not any(f.name == fn for f in s.stack)]
        assert len(hits) >= 20 and len(hits) >= 0.95 * len(window), (method, len(hits), len(window), misses[:5])
    # The merged view keeps them (the interpreter's own frames fold into the Python frames, never the reverse).
    merged = symbolize_capture(cap, options=StackOptions(group="none"))
    names = {f.name for s in merged.samples for f in s.stack}
    assert {"spin_fork", "spin_spawn", "spin_forkserver", "spin"} <= names


def _names(stack: str) -> tuple[str, ...]:
    """A py-spy raw stack line's frames, root first, without their `(file:line)`."""
    return tuple(f.rsplit(" (", 1)[0] for f in stack.split(";"))


def test_python_stacks_agree_with_py_spy(tmp_path: Path) -> None:
    """py-spy, sampling the same process at the same time, is the oracle for Python frames: the same stack shapes
    (function names, root to leaf) and the same splits within a few points.

    Oracle: py-spy record --pid on the same process over the same 8 s."""
    pyspy = Path(sys.executable).parent / "py-spy"
    assert pyspy.exists(), "py-spy is a dev dependency (make setup)"
    python = "/root/.pyenv/versions/3.12.1/bin/python"
    target = subprocess.Popen([python, str(SCRIPT), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        spy = subprocess.Popen([str(pyspy), "record", "--nonblocking", "-r", "97", "-d", "8", "-f", "raw", "-o",
                                str(tmp_path / "spy.txt"), "--pid", str(target.pid)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        aiflame("profile", "-q", "-p", str(target.pid), "-d", "8", "-F", "499", "-o", str(tmp_path / "af"))
        assert spy.wait(timeout=120) == 0
    finally:
        target.kill()
        target.wait()
    theirs: Counter[tuple[str, ...]] = Counter()
    for line in (tmp_path / "spy.txt").read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        theirs[_names(stack)] += int(n)
    prof = symbolize_capture(read_capture(tmp_path / "af" / "profile.aiflame"),
                             options=StackOptions(group="none", python="python"))
    ours: Counter[tuple[str, ...]] = Counter()
    for s in prof.samples:
        names = tuple(f.name for f in s.stack if f.kind == FrameKind.PYTHON)
        if names:
            ours[names] += s.weight

    def shapes(c: Counter[tuple[str, ...]]) -> set[tuple[str, ...]]:
        total = sum(c.values())
        return {k for k, v in c.items() if v >= 0.03 * total}

    assert shapes(ours) == shapes(theirs), (ours.most_common(8), theirs.most_common(8))

    def split(c: Counter[tuple[str, ...]], a: str, b: str) -> tuple[float, int]:
        na = sum(v for k, v in c.items() if a in k)
        nb = sum(v for k, v in c.items() if b in k)
        return na / max(na + nb, 1), na + nb

    # Within 6 points, or 4 standard errors of the two shares where the samples are few: aiflame samples time on a
    # CPU, py-spy wall time, so on a busy host aiflame has fewer samples of the same split (not a wider split).
    for a, b in (("work_60", "work_40"), ("task_75", "task_25")):
        (p_ours, n_ours), (p_theirs, n_theirs) = split(ours, a, b), split(theirs, a, b)
        assert n_ours >= 50 and n_theirs >= 50, (a, n_ours, n_theirs)
        tol = max(0.06, 4 * math.sqrt(p_theirs * (1 - p_theirs) * (1 / n_ours + 1 / n_theirs)))
        assert abs(p_ours - p_theirs) < tol, (a, p_ours, n_ours, p_theirs, n_theirs, tol)
