"""perf's DWARF unwinding as the truth oracle of the CFI unwinder (tests/integration/test_unwind_vs_perf.py and
bench/bench_unwind.py).

perf record --call-graph dwarf copies 16 KiB of stack per sample and unwinds it in user space with the same
.eh_frame tables; it is the independent reference. One aiflame capture runs this module as its command (main):
it starts each workload held at its exec and attaches `perf record -p` to it, so both profilers watch the very
same processes over the same time (perf on CLOCK_MONOTONIC, the clock of aiflame's samples) and their samples
are compared per workload over the window both were sampling. perf prints user frames leaf first as
`ADDR SYMBOL (DSO)`; only names are compared (Python frames are invisible to perf)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aiflame.core.capture import read_capture
from aiflame.core.model import Frame, FrameKind
from aiflame.core.raw import Capture, RawSample
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from tests.conftest import PROGRAMS

__all__ = ["C_WORK", "CPP_PREFIXES", "HZ", "OUTERMOST", "PY_WORK", "TORCH_WORK", "Ours", "PerfStack", "Workload",
           "build_c_workload", "cpp_under_python", "perf_record", "read_perf", "reaches", "run_oracle", "share"]

T = TypeVar("T")
HZ = 499
PERF_STACK_BYTES = 16384
C_WORK = PROGRAMS / "unwind_work.c"
C_LIB = PROGRAMS / "unwind_lib.c"
PY_WORK = PROGRAMS / "unwind_py.py"
TORCH_WORK = PROGRAMS / "unwind_torch.py"
OUTERMOST = frozenset({"_start", "clone", "clone3", "start_thread"})  # where a complete user stack begins
CPP_PREFIXES = ("at::", "c10::")

_FRAME = re.compile(r"^\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)$")
_HEAD = re.compile(r"^(.*?)\s+(\d+)/(\d+)\s+(\d+)\.(\d+):\s*$")


def build_c_workload(d: Path, opt: str) -> Path:
    """tests/programs/unwind_work.c and its library at `opt` (-O1, -O2) without frame pointers, in `d`."""
    d.mkdir(parents=True, exist_ok=True)
    flags = [opt, "-g", "-fomit-frame-pointer"]
    subprocess.run(["gcc", *flags, "-shared", "-fPIC", "-o", str(d / "libunwind_lib.so"), str(C_LIB)], check=True)
    exe = d / f"unwind_work{opt}"
    subprocess.run(["gcc", *flags, "-o", str(exe), str(C_WORK), f"-L{d}", "-lunwind_lib", f"-Wl,-rpath,{d}"],
                   check=True)
    return exe


def perf_record(data: Path, pid: int) -> list[str]:
    """The argv of `perf record` with DWARF call graphs of process `pid` into `data`, on CLOCK_MONOTONIC (the
    clock of aiflame's sample times)."""
    return ["perf", "record", "-q", "-F", str(HZ), "--call-graph", f"dwarf,{PERF_STACK_BYTES}", "-k", "monotonic",
            "-o", str(data), "-p", str(pid)]


def _perf_attached(pid: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]" for fd in fds)
    except OSError:
        return False


def _wait(pred: Callable[[], bool], what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.02)


_PTRACE_TRACEME, _PTRACE_DETACH = 0, 17
AGENT_READS_EXEC_S = 0.5  # the agent handles a target's exec within its 0.1 s poll, then reads the new image


def run_under_perf(data: Path, cmd: Sequence[str]) -> int:
    """Start `cmd` held at its exec, attach `perf record -p` to it, let it run, wait for both; returns its pid.

    perf record does not start the command itself: aiflame stops its targets at library opens (SIGSTOP) and
    perf takes the SIGCHLD of a stopped child for its exit, stops reading and loses every sample. The command
    is held (ptrace) right after its exec, so that aiflame has read the new image before it runs: until the
    agent handles an exec, the unwinder walks with the mappings of the image before it."""
    libc = ctypes.CDLL(None, use_errno=True)
    work = subprocess.Popen(cmd, preexec_fn=lambda: libc.ptrace(_PTRACE_TRACEME, 0, None, None))
    _, status = os.waitpid(work.pid, 0)
    if not os.WIFSTOPPED(status):
        raise SystemExit(f"{shlex.join(cmd)} did not stop at its exec ({status:#x})")
    perf = subprocess.Popen(perf_record(data, work.pid), stdout=subprocess.DEVNULL)
    _wait(lambda: _perf_attached(perf.pid), "perf did not open its events")
    time.sleep(AGENT_READS_EXEC_S)  # also perf's time from opening its events to reading their buffers
    libc.ptrace(_PTRACE_DETACH, work.pid, None, None)
    if work.wait() != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({work.returncode})")
    perf.wait(timeout=120)
    return work.pid


@dataclass(frozen=True)
class PerfStack:
    pid: int
    tid: int
    time_ns: int  # CLOCK_MONOTONIC
    frames: tuple[str, ...]  # root -> leaf, names as perf prints them without +0x offsets and @@ versions
    dsos: tuple[str, ...]


def read_perf(data: Path) -> list[PerfStack]:
    """Every sample of a perf.data file (`perf script --no-inline`), kernel frames dropped."""
    out = subprocess.run(["perf", "script", "--no-inline", "-F", "comm,pid,tid,time,ip,sym,dso", "-i", str(data)],
                         capture_output=True, text=True, check=True).stdout
    stacks: list[PerfStack] = []
    head: tuple[int, int, int] | None = None
    frames: list[tuple[str, str]] = []
    for line in out.splitlines() + [""]:
        if not line.strip():
            if head is not None:
                user = [(f, d) for f, d in reversed(frames) if not d.startswith("[kernel")]
                stacks.append(PerfStack(*head, tuple(f for f, _ in user), tuple(d for _, d in user)))
            head, frames = None, []
        elif line[0].isspace():
            m = _FRAME.match(line)
            if m:
                name = re.sub(r"(\+0x[0-9a-f]+|@@?[A-Z_0-9.]+)$", "", m.group(1))
                frames.append((name, m.group(2)))
        elif m := _HEAD.match(line):
            head = (int(m.group(2)), int(m.group(3)), int(m.group(4)) * 10**9 + int(m.group(5).ljust(9, "0")))
    return stacks


@dataclass
class Ours:
    """aiflame's view of one workload: its samples symbolized (Python frames merged in place, no kernel frames),
    the raw samples in the same order, and the counters of that symbolization (python_spliced...)."""

    stacks: list[tuple[Frame, ...]]
    raw: list[RawSample]
    counters: dict[str, int]

    def names(self) -> list[list[str]]:
        return [[f.name for f in st] for st in self.stacks]


@dataclass
class Workload:
    name: str
    perf: list[PerfStack]
    ours: Ours


def _ours(cap: Capture, pid: int, window: tuple[int, int], native: NativeSymbolizer) -> Ours:
    lo, hi = window
    samples = [s for s in cap.samples if s.pid == pid and lo <= s.time_ns <= hi]
    part = dataclasses.replace(cap, samples=samples, events=[], footer=None)
    # the interpreter's native frames kept (native_interp): the test looks at the C frames between Python ones
    prof = symbolize_capture(part, native, StackOptions(group="none", kernel=False, native_interp=True))
    return Ours([s.stack for s in prof.samples], part.samples, dict(prof.counters))


def run_oracle(workloads: Iterable[tuple[str, Sequence[str | Path]]], out: Path,
               aiflame: Callable[..., object]) -> dict[str, Workload]:
    """Run each (name, command) in turn under `perf record`, all inside one `aiflame profile -F HZ` capture;
    `aiflame` runs the CLI (tests.integration.conftest.aiflame). Returns each workload's samples from both
    profilers over the time both were sampling it."""
    out.mkdir(parents=True, exist_ok=True)
    todo = [(name, [str(c) for c in cmd]) for name, cmd in workloads]
    (out / "workloads.json").write_text(json.dumps(todo))
    aiflame("profile", "-q", "-F", str(HZ), "--formats", "folded", "-o", str(out / "aiflame"), "--",
            sys.executable, "-m", "tests.unwind_oracle", str(out), timeout=600)
    pids = json.loads((out / "pids.json").read_text())
    cap = read_capture(out / "aiflame" / "profile.aiflame")
    native = NativeSymbolizer()
    result = {}
    for name, _ in todo:
        pid = pids[name]
        perf = [p for p in read_perf(out / f"{name}.perf") if p.pid == pid]
        mine = [s.time_ns for s in cap.samples if s.pid == pid]
        window = (max(min(mine, default=0), min((p.time_ns for p in perf), default=0)),
                  min(max(mine, default=0), max((p.time_ns for p in perf), default=0)))
        perf = [p for p in perf if window[0] <= p.time_ns <= window[1]]
        result[name] = Workload(name, perf, _ours(cap, pid, window, native))
    return result


def share(stacks: Sequence[T], pred: Callable[[T], bool]) -> float:
    """The fraction of `stacks` that satisfy `pred`."""
    return sum(1 for s in stacks if pred(s)) / max(1, len(stacks))


def reaches(frames: Sequence[str], roots: Iterable[str] = OUTERMOST) -> bool:
    """The stack's root frame is one where a complete user stack begins."""
    return bool(frames) and frames[0] in set(roots)


def cpp_under_python(stack: Sequence[Frame]) -> bool:
    """A libtorch C++ frame leafward of the last Python frame: the operator under the line that called it."""
    last_py = max((i for i, f in enumerate(stack) if f.kind == FrameKind.PYTHON), default=-1)
    return last_py >= 0 and any(f.name.startswith(CPP_PREFIXES) for f in stack[last_py + 1:])


def main(out: Path) -> None:
    """The command aiflame profiles in run_oracle: each workload of OUT/workloads.json under perf."""
    pids = {}
    for name, cmd in json.loads((out / "workloads.json").read_text()):
        pids[name] = run_under_perf(out / f"{name}.perf", cmd)
    (out / "pids.json").write_text(json.dumps(pids))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
