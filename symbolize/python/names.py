"""Python frames of a capture named from the code objects it recorded, and merged with a stack's native frames
(symbolize/python/merge.py) as a ThreadStack (a sample's or an event's) asks."""

from __future__ import annotations

import bisect
import os
from collections import defaultdict
from collections.abc import Iterable

from aiflame.core.model import Frame, FrameKind
from aiflame.core.raw import PyCode, PyFlag, PyRuntimeInfo, RawPyFrame, ThreadStack
from aiflame.core.unwind import END as UNWIND_END
from aiflame.core.unwind import stop_of
from aiflame.symbolize.python.code import line_for
from aiflame.symbolize.python.merge import fold_interpreter, merge, python_runs

TRUNCATED = Frame("[truncated python stack]", FrameKind.UNKNOWN)


class PythonNames:
    """Names Python frames from the code objects the capture recorded, and merges them with native frames."""

    def __init__(self, py_codes: Iterable[PyCode], py_runtimes: Iterable[PyRuntimeInfo]) -> None:
        from aiflame.core.python_layouts import layout_for

        self.codes: dict[tuple[int, int], list[PyCode]] = defaultdict(list)
        for c in py_codes:
            self.codes[(c.pid, c.addr)].append(c)
        # Per pid, when an address got its 2nd, 3rd... code object: names depend on a sample's time only by
        # how many of these precede it.
        changes: dict[int, list[int]] = defaultdict(list)
        for (pid, _), lst in self.codes.items():
            lst.sort(key=lambda c: c.time_ns)
            changes[pid].extend(c.time_ns for c in lst[1:])
        self._changes = {pid: sorted(times) for pid, times in changes.items() if times}
        self.version: dict[int, tuple[int, int]] = {}
        self.owner_cstack: dict[int, int] = {}
        self.interpreter: dict[int, str] = {}  # the module (Frame.module) of the ELF file running the interpreter
        for r in py_runtimes:
            self.interpreter[r.pid] = os.path.basename(r.binary.removesuffix(" (deleted)"))
            parts = r.version.split(".")
            v = (int(parts[0]), int(parts[1]))
            self.version[r.pid] = v
            lay = layout_for(v)
            self.owner_cstack[r.pid] = lay.owner_cstack if lay else -1
        self._frames: dict[tuple[int, int, int, int], Frame] = {}

    def epoch(self, pid: int, time_ns: int) -> int:
        """How many code-object replacements in `pid` precede `time_ns`; `frame` depends on time only by this."""
        times = self._changes.get(pid)
        return bisect.bisect_right(times, time_ns) if times else 0

    def frame(self, pid: int, f: RawPyFrame, time_ns: int) -> Frame:
        cands = self.codes.get((pid, f.code))
        if not cands:
            return Frame("[unknown python]", FrameKind.PYTHON)
        # The record in force at the sample's time (an address can be reused by a later code object).
        code = cands[0]
        for c in cands:
            if c.time_ns <= time_ns:
                code = c
        key = (pid, f.code, code.time_ns, f.instr)
        hit = self._frames.get(key)
        if hit is None:
            info = code.info
            hit = Frame(info.qualname, FrameKind.PYTHON, module=os.path.basename(info.filename), file=info.filename,
                        line=line_for(info, f.instr))
            self._frames[key] = hit
        return hit

    def merged(self, s: ThreadStack, native: list[Frame], counters: dict[str, int], unwind: int, python_only: bool,
               fold: bool = True) -> list[Frame]:
        """`s`'s Python frames merged with its `native` frames (or alone); `unwind`: how its native walk ended."""
        version = self.version.get(s.pid)
        if version is None:
            return native
        runs = python_runs(s.py, version, self.owner_cstack.get(s.pid, -1))
        def name(f: RawPyFrame) -> Frame:
            return self.frame(s.pid, f, s.time_ns)
        trunc = [TRUNCATED] if s.py_flags & PyFlag.TRUNCATED else []
        if python_only:
            return trunc + [name(f) for run in runs for f in run]
        # the CFI walker's own word on whether it reached the outermost frame; other walks are judged by name
        stop = stop_of(unwind)
        complete = stop == UNWIND_END if stop else None
        result = merge(native, runs, name, complete)
        counters["python_samples"] = counters.get("python_samples", 0) + 1
        if result.spliced:
            counters["python_spliced"] = counters.get("python_spliced", 0) + 1
        if result.mismatched:
            counters["python_mismatched"] = counters.get("python_mismatched", 0) + 1
        stack = fold_interpreter(result.stack, self.interpreter.get(s.pid, "")) if fold else result.stack
        return trunc + list(stack)
