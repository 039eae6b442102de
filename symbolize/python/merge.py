"""Merge Python frames into a native stack.

The walker ships Python frames newest first. Each C-level call of the evaluator runs one Python frame (3.10)
or a run of them (3.11+: a run starts at an entry frame, marked by `is_entry` on 3.11 and preceded by a C-stack
shim frame on 3.12/3.13). When the native stack holds as many evaluator frames as there are runs, each evaluator
frame is replaced by its run. A native stack is complete when the CFI walker reached the outermost frame (the
sample says so), or, for a stack walked otherwise, when its root frame is a process or thread entry point by name
(a stripped interpreter or libc leaves `_start` and `start_thread` unnamed: the walker's word is the one to trust).
When the native stack was cut short (a depth limit, a library without CFI), its evaluator frames are still the
newest ones: the newest runs replace them, matched from the leaf, and only the older runs the walk never reached
are spliced at the root, above the native frames it found; the sample is marked spliced. With no evaluator frame
at all, the whole Python stack is spliced at the root, followed by the native frames the current Python frame
called into.

Then, by default, the interpreter's own native frames fold away, as py-spy does. Below the first Python frame
they are the evaluator's helpers (argument parsing, attribute lookup, the call machinery between a Python frame
and the C function it calls): a Python frame calling a C extension reads `f;ext_func`, not
`f;_PyObject_MakeTpCall;cfunction_call;...;ext_func`; builtins whose names say what the program waits on or
spends its time in (time.sleep, the GC, os calls, locks and the GIL) stay. Above it they are how the interpreter
was entered (`_start;__libc_start_main;Py_BytesMain;Py_RunMain;...;PyEval_EvalCode`, or a thread's start):
those go too, with the process and thread entry points, so a stack the native unwinder walked to its root and
one it spliced both start at the same Python frame. Native frames of other code stay wherever they are (a C++
thread that calls into Python keeps its frames above the Python ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiflame.core.model import Frame, FrameKind
from aiflame.core.raw import RawPyFrame

EVAL_NAMES = frozenset({"_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold", "_PyEval_EvalFrame",
                        "PyEval_EvalFrameEx"})
# Where a complete native stack starts; a stack rooted elsewhere was cut short.
NATIVE_ROOTS = frozenset({"_start", "__libc_start_main", "__libc_start_call_main", "start_thread", "clone",
                          "clone3", "thread_start"})
# Interpreter functions kept under a Python frame: builtin modules and the waits a user wants to see.
KEPT_INTERPRETER_PREFIXES = ("time_", "gc_", "os_", "sys_", "thread_", "lock_", "rlock_", "PyThread_", "PyGILState_",
                             "take_gil", "select_", "sock_", "sre_", "_sre_")
_NATIVE_KINDS = frozenset({FrameKind.NATIVE, FrameKind.NATIVE_CPP, FrameKind.UNKNOWN})


@dataclass(frozen=True)
class MergeResult:
    stack: tuple[Frame, ...]
    spliced: bool  # Python frames (all, or the runs older than the walk reached) put at the root
    mismatched: bool  # evaluator frames and Python runs disagreed in number


def python_runs(frames: Sequence[RawPyFrame], version: tuple[int, int], owner_cstack: int) -> list[list[RawPyFrame]]:
    """Group frames (given newest first) into evaluator runs, oldest run first, each run oldest frame first.

    C-stack shim frames are dropped: they only mark where a run begins."""
    oldest_first = list(reversed(frames))
    runs: list[list[RawPyFrame]] = []
    if version < (3, 11):
        return [[f] for f in oldest_first]
    for f in oldest_first:
        if version >= (3, 12) and owner_cstack >= 0 and f.owner == owner_cstack:
            runs.append([])  # a shim opens the run of the evaluator call it belongs to
            continue
        if version == (3, 11) and f.is_entry:
            runs.append([f])
            continue
        if not runs:
            runs.append([])
        runs[-1].append(f)
    return [r for r in runs if r]


def merge(
    native: Sequence[Frame],
    runs: Sequence[Sequence[RawPyFrame]],
    name: Callable[[RawPyFrame], Frame],
    complete: bool | None = None,
) -> MergeResult:
    """`native` root -> leaf; `runs` from python_runs(); `name` turns a raw frame into a model Frame. `complete`:
    whether the native walk reached the outermost frame (None: judged by the root frame's name)."""
    if not runs:
        return MergeResult(tuple(native), False, False)
    evals = [i for i, f in enumerate(native) if f.name in EVAL_NAMES]
    if complete is None:
        complete = bool(native) and native[0].name in NATIVE_ROOTS
    if evals and (len(evals) == len(runs) or not complete):
        # Matched from the leaf: the newest runs replace the evaluator frames the walk found. Runs older than
        # every evaluator frame found (the walk stopped before reaching theirs) go at the root; evaluator frames
        # older than every run (Python frames truncated) stay as they are.
        k = min(len(evals), len(runs))
        older = runs[:len(runs) - k]
        out = [name(f) for run in older for f in run]
        prev = 0
        for i, run in zip(evals[len(evals) - k:], runs[len(runs) - k:], strict=True):
            out.extend(native[prev:i])
            out.extend(name(f) for f in run)
            prev = i + 1
        out.extend(native[prev:])
        return MergeResult(tuple(out), bool(older), False)
    # Splice: every Python frame, then what the newest Python frame called into: the native frames after the
    # last evaluator frame; when none unwound, those after the last unnamed frame (the unwinder lost its way
    # there; e.g. a C library called through ctypes unwinds down to libffi), at least the leaf.
    py = [name(f) for run in runs for f in run]
    if evals:
        tail = list(native[evals[-1] + 1:])
    else:
        unknown = [i for i, f in enumerate(native) if f.is_unknown]
        start = unknown[-1] + 1 if unknown else len(native) - 1
        tail = list(native[min(start, len(native) - 1):]) if native else []
    return MergeResult(tuple(py + tail), not complete, complete)


def fold_interpreter(stack: Sequence[Frame], interpreter: str) -> tuple[Frame, ...]:
    """`stack` (root -> leaf) without the native frames of module `interpreter` (the ELF file holding the
    interpreter, as Frame.module names it) below the first Python frame, all but the builtins
    KEPT_INTERPRETER_PREFIXES names; rootward of it the native path into Python stays whole (`main -> Py_RunMain ->
    ... -> PyEval_EvalCode -> py::<module>`), as the native unwinder found it. A stack with no Python frame
    (start-up, shutdown, a thread running no Python) is left whole."""
    first = next((i for i, f in enumerate(stack) if f.kind == FrameKind.PYTHON), None)
    if first is None or not interpreter:
        return tuple(stack)
    out = list(stack[:first + 1])  # the native path that entered Python (main, Py_RunMain, a thread start) stays

    for f in stack[first + 1:]:
        if f.module == interpreter and f.kind in _NATIVE_KINDS and not f.name.startswith(KEPT_INTERPRETER_PREFIXES):
            continue
        out.append(f)
    return tuple(out)
